"""The storage-slot table (Prefill, pure state; ``rd2h.prefill.gate`` adds the waiting across threads).

Layerwise Prefill reuses a few physical buffers (slots, keyed by storage address) across
logical layers. A slot written for a layer stays BUSY until every Decode endpoint told about
that layer has replied; the compute path waits for it before overwriting. Replies of
READ_FAILED (the sender reports a silent endpoint as one) and layers that could not be sent
release it too, and their error reaches the next waiter. Transitions are tables over ``Enum``
states; an illegal event raises :class:`~rd2h.errors.StateError`.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from enum import Enum

from rd2h.errors import GateTimeout, LayerFailedError, StateError
from rd2h.statemachine import step as _step

__all__ = ["SlotState", "LayerState", "SlotTable"]


class SlotState(Enum):
    FREE = "free"
    BUSY = "busy"  # holds a layer that some Decode endpoint may still be reading


class _SlotEvent(Enum):
    CLAIM = "claim"
    RELEASE = "release"


_SLOT_TRANSITIONS = {
    (SlotState.FREE, _SlotEvent.CLAIM): SlotState.BUSY,
    (SlotState.BUSY, _SlotEvent.RELEASE): SlotState.FREE,
}


class LayerState(Enum):
    CLAIMED = "claimed"  # slots written, readiness not yet sent (replies are held)
    SENT = "sent"  # readiness sent, waiting for the pending endpoints
    RELEASED = "released"  # every endpoint replied (or the send failed): slots free


class _LayerEvent(Enum):
    SEND = "send"
    SEND_NONE = "send to no pending endpoint"
    REPLY = "reply"
    LAST_REPLY = "last reply"
    FAIL = "fail"


_LAYER_TRANSITIONS = {
    (LayerState.CLAIMED, _LayerEvent.SEND): LayerState.SENT,
    (LayerState.CLAIMED, _LayerEvent.SEND_NONE): LayerState.RELEASED,
    (LayerState.CLAIMED, _LayerEvent.REPLY): LayerState.CLAIMED,  # early reply, held
    (LayerState.CLAIMED, _LayerEvent.FAIL): LayerState.RELEASED,  # nobody is reading
    (LayerState.SENT, _LayerEvent.REPLY): LayerState.SENT,
    (LayerState.SENT, _LayerEvent.LAST_REPLY): LayerState.RELEASED,
    (LayerState.SENT, _LayerEvent.FAIL): LayerState.SENT,  # readers still hold the slots
}


@dataclass(slots=True)
class _Layer:
    idx: int
    slots: tuple[Hashable, ...]
    state: LayerState = LayerState.CLAIMED
    pending: set[Hashable] = field(default_factory=set)
    early: dict[Hashable, str | None] = field(default_factory=dict)  # replies before sent: error or None
    failures: list[tuple[Hashable | None, str]] = field(default_factory=list)


@dataclass(eq=False, slots=True)
class _Failure:
    """One released layer's errors, attached to all its slots until one waiter takes it."""

    layer_idx: int
    slots: tuple[Hashable, ...]
    details: tuple[tuple[Hashable | None, str], ...]

    def describe(self) -> str:
        parts = [
            f"the sender could not send readiness: {error}"
            if endpoint is None
            else f"Decode endpoint {endpoint!r} failed the read: {error}"
            for endpoint, error in self.details
        ]
        return f"layer {self.layer_idx}: " + "; ".join(parts)


class SlotTable:
    """Which storage slots hold which layer, and which Decode endpoints have not replied.

    Pure and single-threaded; :class:`rd2h.prefill.gate.SlotGate` wraps it for use across threads. Slots
    are any hashable keys (e.g. ``("main", addr)`` and ``("indexer", addr)``).

    Order of calls per layer: ``claim`` (compute path, after ``check``/``wait`` said the
    slots are free), then ``sent`` with the endpoints that got readiness, then one
    ``replied`` per endpoint. Replies arriving between ``claim`` and ``sent`` are held and
    applied by ``sent``. A slot is FREE exactly when no in-flight layer holds it.
    """

    def __init__(self) -> None:
        self._owner: dict[Hashable, int] = {}  # busy slot -> layer
        self._layers: dict[int, _Layer] = {}  # in-flight layers
        self._failures: dict[Hashable, list[_Failure]] = {}
        self._stray = 0

    # events

    def claim(self, layer_idx: int, slots: Iterable[Hashable]) -> None:
        """The compute path wrote ``layer_idx`` into ``slots``: they become BUSY.

        Raises StateError if a slot is still busy (``wait`` first) or the layer is in flight.
        """
        keys = tuple(dict.fromkeys(slots))
        if layer_idx in self._layers:
            raise StateError(
                f"layer {layer_idx} claimed again while still in flight "
                f"({self._layers[layer_idx].state.name})"
            )
        for slot in keys:
            if slot in self._owner:
                raise StateError(
                    f"slot {slot!r} is still busy with {self._holder(slot)}; "
                    f"wait for it before claiming it for layer {layer_idx}"
                )
        for slot in keys:
            _step(_SLOT_TRANSITIONS, SlotState.FREE, _SlotEvent.CLAIM, f"slot {slot!r}")
            self._owner[slot] = layer_idx
        self._layers[layer_idx] = _Layer(layer_idx, keys)

    def sent(self, layer_idx: int, endpoints: Iterable[Hashable]) -> bool:
        """Readiness for ``layer_idx`` went to ``endpoints``; returns True if that released it
        (no endpoints, or all of them already replied). Raises StateError if not claimed."""
        layer = self._in_flight(layer_idx, "sent")
        pending = set(endpoints)
        for endpoint, error in layer.early.items():
            if endpoint in pending:
                pending.discard(endpoint)
                if error is not None:
                    layer.failures.append((endpoint, error))
            else:
                self._stray += 1
        layer.early.clear()
        event = _LayerEvent.SEND if pending else _LayerEvent.SEND_NONE
        return self._advance(layer, event, pending)

    def replied(self, layer_idx: int, endpoint: Hashable, error: str | None = None) -> bool:
        """``endpoint`` answered for ``layer_idx`` (``error`` set for READ_FAILED).

        Returns True if this released the layer's slots. A reply that matches no pending
        (layer, endpoint) is ignored and counted in :attr:`stray_replies`.
        """
        layer = self._layers.get(layer_idx)
        if layer is None:
            self._stray += 1
            return False
        if layer.state is LayerState.CLAIMED:
            if endpoint in layer.early:
                self._stray += 1
                return False
            layer.early[endpoint] = error
            return self._advance(layer, _LayerEvent.REPLY, set())
        if endpoint not in layer.pending:
            self._stray += 1
            return False
        layer.pending.discard(endpoint)
        if error is not None:
            layer.failures.append((endpoint, error))
        event = _LayerEvent.REPLY if layer.pending else _LayerEvent.LAST_REPLY
        return self._advance(layer, event, layer.pending)

    def fail_layer(self, layer_idx: int, error: str) -> bool:
        """The sender could not announce ``layer_idx``: record ``error`` for the next waiter.

        Before ``sent`` the slots are released at once (no one reads them); after it they
        are released when the endpoints that did get readiness have replied, since they
        may still be reading. Returns True if released now. Raises StateError if the
        layer is not in flight.
        """
        layer = self._in_flight(layer_idx, "fail_layer")
        layer.failures.append((None, error))
        layer.early.clear()
        return self._advance(layer, _LayerEvent.FAIL, layer.pending)

    # queries

    def check(self, slots: Iterable[Hashable]) -> bool:
        """True if every slot is FREE. Raises LayerFailedError (once, then cleared) if a
        layer that held any of them failed."""
        keys = tuple(slots)
        found: list[_Failure] = []
        for slot in keys:
            for failure in self._failures.get(slot, ()):
                if failure not in found:
                    found.append(failure)
        if found:
            for failure in found:
                for slot in failure.slots:
                    attached = self._failures[slot]
                    attached.remove(failure)
                    if not attached:
                        del self._failures[slot]
            raise LayerFailedError(" | ".join(f.describe() for f in found))
        return all(slot not in self._owner for slot in keys)

    def timeout_error(self, slots: Iterable[Hashable], timeout: float) -> GateTimeout:
        """The GateTimeout for a wait on ``slots``: names each busy slot, its layer and
        the endpoints that never replied."""
        busy = [f"slot {s!r} held by {self._holder(s)}" for s in slots if s in self._owner]
        return GateTimeout(f"storage slots not released within {timeout:g} s: " + "; ".join(busy))

    def state(self, slot: Hashable) -> SlotState:
        return SlotState.BUSY if slot in self._owner else SlotState.FREE

    def owner(self, slot: Hashable) -> int | None:
        """The in-flight layer holding ``slot``, or None when it is free."""
        return self._owner.get(slot)

    def layer_state(self, layer_idx: int) -> LayerState:
        layer = self._layers.get(layer_idx)
        return LayerState.RELEASED if layer is None else layer.state

    def pending(self, layer_idx: int) -> frozenset[Hashable]:
        """Endpoints that got readiness for ``layer_idx`` and have not replied."""
        layer = self._layers.get(layer_idx)
        return frozenset() if layer is None else frozenset(layer.pending)

    @property
    def stray_replies(self) -> int:
        """Replies that matched no pending (layer, endpoint): late, duplicate or unknown."""
        return self._stray

    # internals

    def _in_flight(self, layer_idx: int, what: str) -> _Layer:
        layer = self._layers.get(layer_idx)
        if layer is None:
            raise StateError(f"{what}: layer {layer_idx} is not in flight (unclaimed or released)")
        return layer

    def _holder(self, slot: Hashable) -> str:
        layer = self._layers[self._owner[slot]]
        if layer.state is LayerState.CLAIMED:
            return f"layer {layer.idx} (readiness not sent yet)"
        waiting = ", ".join(sorted(repr(e) for e in layer.pending))
        return f"layer {layer.idx} (no reply from {waiting})"

    def _advance(self, layer: _Layer, event: _LayerEvent, pending: set[Hashable]) -> bool:
        layer.state = _step(_LAYER_TRANSITIONS, layer.state, event, f"layer {layer.idx}")
        layer.pending = pending
        if layer.state is not LayerState.RELEASED:
            return False
        for slot in layer.slots:
            _step(_SLOT_TRANSITIONS, SlotState.BUSY, _SlotEvent.RELEASE, f"slot {slot!r}")
            del self._owner[slot]
        if layer.failures:
            failure = _Failure(layer.idx, layer.slots, tuple(layer.failures))
            for slot in layer.slots:
                self._failures.setdefault(slot, []).append(failure)
        del self._layers[layer.idx]
        return True
