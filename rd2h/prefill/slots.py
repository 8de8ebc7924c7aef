"""The storage-slot table (Prefill, pure state; ``rd2h.prefill.gate`` adds the waiting across threads).

Layerwise Prefill reuses a few physical buffers (slots, keyed by storage address) across
logical layers. A slot written for a layer stays BUSY until every Decode endpoint told about
that layer has replied; the compute path waits for it before overwriting. A READ_FAILED
(the sender reports a silent endpoint as one) releases it like a READ_DONE: the requests a
layer failed are the send tracker's to report, one by one, never an error on the compute
path. Transitions are tables over ``Enum`` states; an illegal event raises
:class:`~rd2h.errors.StateError`.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from enum import Enum

from rd2h.errors import GateTimeout, StateError
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
    RELEASED = "released"  # every endpoint replied (or none was sent to): slots free


class _LayerEvent(Enum):
    SEND = "send"
    SEND_NONE = "send to no pending endpoint"
    REPLY = "reply"
    LAST_REPLY = "last reply"


_LAYER_TRANSITIONS = {
    (LayerState.CLAIMED, _LayerEvent.SEND): LayerState.SENT,
    (LayerState.CLAIMED, _LayerEvent.SEND_NONE): LayerState.RELEASED,
    (LayerState.CLAIMED, _LayerEvent.REPLY): LayerState.CLAIMED,  # early reply, held
    (LayerState.SENT, _LayerEvent.REPLY): LayerState.SENT,
    (LayerState.SENT, _LayerEvent.LAST_REPLY): LayerState.RELEASED,
}


@dataclass(slots=True)
class _Layer:
    idx: int
    slots: tuple[Hashable, ...]
    state: LayerState = LayerState.CLAIMED
    pending: set[Hashable] = field(default_factory=set)
    early: set[Hashable] = field(default_factory=set)  # endpoints that replied before ``sent``


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
            _step(_SLOT_TRANSITIONS, SlotState.FREE, _SlotEvent.CLAIM, "slot %r", slot)
            self._owner[slot] = layer_idx
        self._layers[layer_idx] = _Layer(layer_idx, keys)

    def sent(self, layer_idx: int, endpoints: Iterable[Hashable]) -> bool:
        """Readiness for ``layer_idx`` went to ``endpoints``; returns True if that released it
        (no endpoints, or all of them already replied). Raises StateError if not claimed."""
        layer = self._in_flight(layer_idx, "sent")
        pending = set(endpoints)
        for endpoint in layer.early:
            if endpoint in pending:
                pending.discard(endpoint)
            else:
                self._stray += 1
        layer.early.clear()
        event = _LayerEvent.SEND if pending else _LayerEvent.SEND_NONE
        return self._advance(layer, event, pending)

    def replied(self, layer_idx: int, endpoint: Hashable) -> bool:
        """``endpoint`` answered for ``layer_idx`` (READ_DONE or READ_FAILED alike: what
        failed is the send tracker's business; the slot only waits for every reader).

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
            layer.early.add(endpoint)
            return self._advance(layer, _LayerEvent.REPLY, set())
        if endpoint not in layer.pending:
            self._stray += 1
            return False
        layer.pending.discard(endpoint)
        event = _LayerEvent.REPLY if layer.pending else _LayerEvent.LAST_REPLY
        return self._advance(layer, event, layer.pending)

    # queries

    def check(self, slots: Iterable[Hashable]) -> bool:
        """True if every slot is FREE."""
        return all(slot not in self._owner for slot in slots)

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
        layer.state = _step(_LAYER_TRANSITIONS, layer.state, event, "layer %d", layer.idx)
        layer.pending = pending
        if layer.state is not LayerState.RELEASED:
            return False
        for slot in layer.slots:
            _step(_SLOT_TRANSITIONS, SlotState.BUSY, _SlotEvent.RELEASE, "slot %r", slot)
            del self._owner[slot]
        del self._layers[layer.idx]
        return True
