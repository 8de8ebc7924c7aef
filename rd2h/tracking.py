"""Completion tracking: storage-slot gates (Prefill), contributor and request completion
(Decode). Pure state machines over ``Enum`` states and transition tables; no I/O, no
threads. Only :class:`SlotGate` holds a ``threading.Condition`` so the compute path can
block on a slot with a timeout.

An event a table does not allow raises :class:`~rd2h.errors.StateError` naming the state
and the event; an id a tracker does not know raises :class:`~rd2h.errors.UnknownRequestError`.
"""

from __future__ import annotations

import operator
import threading
import time
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TypeVar

from rd2h.errors import ConfigError, GateTimeout, LayerFailedError, StateError, UnknownRequestError

__all__ = [
    "SlotState",
    "LayerState",
    "SlotTable",
    "SlotGate",
    "ContributorState",
    "ContributorTracker",
    "RequestState",
    "TerminalState",
    "RequestTracker",
    "GatherResult",
    "CompletionGatherer",
    "gather_terminal",
    "RequestIdMap",
]

_S = TypeVar("_S", bound=Enum)
_E = TypeVar("_E", bound=Enum)


def _step(table: Mapping[tuple[_S, _E], _S], state: _S, event: _E, what: str) -> _S:
    try:
        return table[(state, event)]
    except KeyError:
        raise StateError(f"{what}: {event.name} is illegal in state {state.name}") from None


def _count(name: str, value: object, minimum: int) -> int:
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        number = None
    if number is None or isinstance(value, bool) or number < minimum:
        raise StateError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return number


# -- storage-slot gate (Prefill) -----------------------------------------------------------


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
    early: dict[Hashable, tuple[str | None, bool]] = field(default_factory=dict)  # (error, abandon)
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

    Pure and single-threaded; :class:`SlotGate` wraps it for use across threads. Slots
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
        for endpoint, (error, from_abandon) in layer.early.items():
            if endpoint in pending:
                pending.discard(endpoint)
                if error is not None:
                    layer.failures.append((endpoint, error))
            elif not from_abandon:
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
            layer.early[endpoint] = (error, False)
            return self._advance(layer, _LayerEvent.REPLY, set())
        if endpoint not in layer.pending:
            self._stray += 1
            return False
        layer.pending.discard(endpoint)
        if error is not None:
            layer.failures.append((endpoint, error))
        event = _LayerEvent.REPLY if layer.pending else _LayerEvent.LAST_REPLY
        return self._advance(layer, event, layer.pending)

    def abandon(self, endpoint: Hashable, error: str) -> tuple[int, ...]:
        """``endpoint`` is gone: every layer waiting on it gets its reply, as ``error``.

        Layers claimed but not yet sent hold the error, so a later ``sent`` naming the
        endpoint does not wait for it. Returns the layers this released.
        """
        released = []
        for layer in list(self._layers.values()):
            if layer.state is LayerState.CLAIMED:
                layer.early.setdefault(endpoint, (error, True))
            elif endpoint in layer.pending and self.replied(layer.idx, endpoint, error):
                released.append(layer.idx)
        return tuple(released)

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


class SlotGate:
    """:class:`SlotTable` made safe across threads: the compute path ``wait``s, the
    background sender reports ``sent``/``replied``/``abandon``/``fail_layer``."""

    def __init__(self) -> None:
        self._table = SlotTable()
        self._cond = threading.Condition()

    def claim(self, layer_idx: int, slots: Iterable[Hashable]) -> None:
        with self._cond:
            self._table.claim(layer_idx, slots)

    def sent(self, layer_idx: int, endpoints: Iterable[Hashable]) -> bool:
        with self._cond:
            return self._notify(self._table.sent(layer_idx, endpoints))

    def replied(self, layer_idx: int, endpoint: Hashable, error: str | None = None) -> bool:
        with self._cond:
            return self._notify(self._table.replied(layer_idx, endpoint, error))

    def abandon(self, endpoint: Hashable, error: str) -> tuple[int, ...]:
        with self._cond:
            released = self._table.abandon(endpoint, error)
            self._notify(bool(released))
            return released

    def fail_layer(self, layer_idx: int, error: str) -> bool:
        with self._cond:
            return self._notify(self._table.fail_layer(layer_idx, error))

    def wait(self, slots: Iterable[Hashable], timeout: float) -> None:
        """Block until every slot is FREE.

        Raises LayerFailedError if a layer that held one of them failed (each failure
        reaches one waiter), GateTimeout after ``timeout`` seconds (0 polls once).
        """
        if not timeout >= 0:
            raise ConfigError(f"timeout must be >= 0 seconds, got {timeout!r}")
        keys = tuple(slots)
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._table.check(keys):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise self._table.timeout_error(keys, timeout)
                self._cond.wait(remaining)

    def state(self, slot: Hashable) -> SlotState:
        with self._cond:
            return self._table.state(slot)

    def owner(self, slot: Hashable) -> int | None:
        with self._cond:
            return self._table.owner(slot)

    def layer_state(self, layer_idx: int) -> LayerState:
        with self._cond:
            return self._table.layer_state(layer_idx)

    def pending(self, layer_idx: int) -> frozenset[Hashable]:
        with self._cond:
            return self._table.pending(layer_idx)

    @property
    def stray_replies(self) -> int:
        with self._cond:
            return self._table.stray_replies

    def _notify(self, released: bool) -> bool:
        if released:
            self._cond.notify_all()
        return released


# -- contributor completion (Decode) --------------------------------------------------------


class ContributorState(Enum):
    PARTIAL = "partial"  # some of the ratio contributors reported the final layer
    COMPLETE = "complete"  # all of them did


class _FinalEvent(Enum):
    NEW = "final from a new member"
    LAST = "final from the last member"
    DUPLICATE = "final from a member already counted"


_CONTRIBUTOR_TRANSITIONS = {
    (ContributorState.PARTIAL, _FinalEvent.NEW): ContributorState.PARTIAL,
    (ContributorState.PARTIAL, _FinalEvent.LAST): ContributorState.COMPLETE,
    (ContributorState.PARTIAL, _FinalEvent.DUPLICATE): ContributorState.PARTIAL,
    (ContributorState.COMPLETE, _FinalEvent.DUPLICATE): ContributorState.COMPLETE,
}


@dataclass(slots=True)
class _Group:
    ratio: int
    members: set[int] = field(default_factory=set)
    state: ContributorState = ContributorState.PARTIAL


class ContributorTracker:
    """Per request: which Prefill contributors of this Decode rank reported the final layer."""

    def __init__(self) -> None:
        self._groups: dict[str, _Group] = {}

    def record_final(self, ext_id: str, member: int, ratio: int) -> bool:
        """Contributor ``member`` of ``ratio`` reported ``ext_id``'s final layer.

        Returns True on the one call that completes the request; a repeated signal from
        one member does not count. Raises StateError for a member outside
        ``0..ratio-1`` or a ratio other than the first one seen for the request.
        """
        ratio = _count("ratio", ratio, 1)
        member = _count("member", member, 0)
        if member >= ratio:
            raise StateError(
                f"request {ext_id!r}: member {member} is outside 0..{ratio - 1} (ratio {ratio})"
            )
        group = self._groups.get(ext_id)
        if group is None:
            group = self._groups[ext_id] = _Group(ratio)
        elif group.ratio != ratio:
            raise StateError(
                f"request {ext_id!r}: member {member} reports ratio {ratio}, "
                f"but the request's contributors reported ratio {group.ratio} before"
            )
        if member in group.members:
            event = _FinalEvent.DUPLICATE
        else:
            group.members.add(member)
            event = _FinalEvent.LAST if len(group.members) == ratio else _FinalEvent.NEW
        group.state = _step(_CONTRIBUTOR_TRANSITIONS, group.state, event, f"request {ext_id!r}")
        return event is _FinalEvent.LAST

    def is_complete(self, ext_id: str) -> bool:
        group = self._groups.get(ext_id)
        return group is not None and group.state is ContributorState.COMPLETE

    def members(self, ext_id: str) -> frozenset[int]:
        """The members counted so far for ``ext_id`` (empty if none)."""
        group = self._groups.get(ext_id)
        return frozenset() if group is None else frozenset(group.members)

    def forget(self, ext_id: str) -> None:
        """Drop ``ext_id`` (no error if unknown). A later signal starts it afresh."""
        self._groups.pop(ext_id, None)

    def __contains__(self, ext_id: object) -> bool:
        return ext_id in self._groups

    def __len__(self) -> int:
        return len(self._groups)


# -- request states per Decode rank ----------------------------------------------------------


class RequestState(Enum):
    WAITING = "waiting"  # expected: destinations known, nothing read yet
    RECEIVING = "receiving"  # some layer read
    DONE = "done"  # every contributor reported the final layer
    FAILED = "failed"  # a read failed; carries the first reason
    ABORTED = "aborted"  # vLLM aborted it; still reported, so vLLM frees its blocks


class TerminalState(Enum):
    DONE = "done"
    FAILED = "failed"
    ABORTED = "aborted"


class _RequestEvent(Enum):
    EXPECT = "expect"
    LAYER_READ = "layer read"
    FAIL = "fail"
    CONTRIBUTORS_COMPLETE = "contributors complete"
    ABORT = "abort"


_R, _V = RequestState, _RequestEvent
_REQUEST_TRANSITIONS = {
    (_R.WAITING, _V.LAYER_READ): _R.RECEIVING,
    (_R.WAITING, _V.CONTRIBUTORS_COMPLETE): _R.DONE,  # zero blocks for this rank
    (_R.WAITING, _V.FAIL): _R.FAILED,
    (_R.WAITING, _V.ABORT): _R.ABORTED,
    (_R.RECEIVING, _V.LAYER_READ): _R.RECEIVING,
    (_R.RECEIVING, _V.CONTRIBUTORS_COMPLETE): _R.DONE,
    (_R.RECEIVING, _V.FAIL): _R.FAILED,
    (_R.RECEIVING, _V.ABORT): _R.ABORTED,
    (_R.DONE, _V.ABORT): _R.DONE,  # finished before the abort arrived
    # after a failure the other contributors keep sending: absorbed, first reason kept
    (_R.FAILED, _V.LAYER_READ): _R.FAILED,
    (_R.FAILED, _V.FAIL): _R.FAILED,
    (_R.FAILED, _V.CONTRIBUTORS_COMPLETE): _R.FAILED,
    (_R.FAILED, _V.ABORT): _R.FAILED,
    # an aborted request ignores whatever is still in flight for it
    (_R.ABORTED, _V.EXPECT): _R.ABORTED,
    (_R.ABORTED, _V.LAYER_READ): _R.ABORTED,
    (_R.ABORTED, _V.FAIL): _R.ABORTED,
    (_R.ABORTED, _V.CONTRIBUTORS_COMPLETE): _R.ABORTED,
    (_R.ABORTED, _V.ABORT): _R.ABORTED,
}
_TERMINAL = {
    RequestState.DONE: TerminalState.DONE,
    RequestState.FAILED: TerminalState.FAILED,
    RequestState.ABORTED: TerminalState.ABORTED,
}


class RequestTracker:
    """Receive state of each request on one Decode rank, keyed by external request id.

    Every request ends terminal (DONE, FAILED or ABORTED) and each terminal state is
    reported once by :meth:`take_terminal`. ``abort`` of a request not yet expected
    records it ABORTED (and a later ``expect`` of it is ignored), so an abort never leaves
    vLLM waiting for blocks that nobody reports. Records stay until ``forget``.
    """

    def __init__(self) -> None:
        self._states: dict[str, RequestState] = {}
        self._reasons: dict[str, str] = {}
        self._unreported: dict[str, None] = {}  # ordered set

    def expect(self, ext_id: str) -> None:
        """Destinations for ``ext_id`` are known; raises StateError if already expected."""
        if ext_id not in self._states:
            self._states[ext_id] = RequestState.WAITING
        else:
            self._event(ext_id, _RequestEvent.EXPECT)

    def on_layer_read(self, ext_id: str) -> None:
        self._event(ext_id, _RequestEvent.LAYER_READ)

    def on_failed(self, ext_id: str, reason: str) -> None:
        if self._event(ext_id, _RequestEvent.FAIL) is RequestState.FAILED:
            self._reasons.setdefault(ext_id, reason)

    def on_contributors_complete(self, ext_id: str) -> None:
        self._event(ext_id, _RequestEvent.CONTRIBUTORS_COMPLETE)

    def abort(self, ext_id: str) -> None:
        """vLLM aborted ``ext_id``: it ends ABORTED unless already terminal."""
        if ext_id not in self._states:
            self._states[ext_id] = RequestState.ABORTED
            self._unreported[ext_id] = None
        else:
            self._event(ext_id, _RequestEvent.ABORT)

    def take_terminal(self) -> dict[str, TerminalState]:
        """Requests that became terminal since the last call, each reported once."""
        taken = {ext_id: _TERMINAL[self._states[ext_id]] for ext_id in self._unreported}
        self._unreported.clear()
        return taken

    def state(self, ext_id: str) -> RequestState:
        """Raises UnknownRequestError if ``ext_id`` is not tracked."""
        return self._known(ext_id)

    def reason(self, ext_id: str) -> str | None:
        """The first failure reason of a FAILED request, else None."""
        return self._reasons.get(ext_id)

    def forget(self, ext_id: str) -> None:
        """Drop ``ext_id`` (no error if unknown), reported or not."""
        self._states.pop(ext_id, None)
        self._reasons.pop(ext_id, None)
        self._unreported.pop(ext_id, None)

    def __contains__(self, ext_id: object) -> bool:
        return ext_id in self._states

    def __len__(self) -> int:
        return len(self._states)

    def _known(self, ext_id: str) -> RequestState:
        try:
            return self._states[ext_id]
        except KeyError:
            raise UnknownRequestError(f"request {ext_id!r} is not expected on this rank") from None

    def _event(self, ext_id: str, event: _RequestEvent) -> RequestState:
        old = self._known(ext_id)
        new = _step(_REQUEST_TRANSITIONS, old, event, f"request {ext_id!r}")
        self._states[ext_id] = new
        if new is not old and new in _TERMINAL:
            self._unreported[ext_id] = None
        return new


# -- gathering over Decode TP ranks ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GatherResult:
    """Requests terminal on every Decode rank.

    ``finished`` holds all of them, ``failed`` those some rank failed: failed ids are also
    in ``finished`` because vLLM must free them too (report ``finished`` as
    finished-receiving and ``failed`` as failed-receiving). ABORTED counts as finished.
    """

    finished: frozenset[str] = frozenset()
    failed: frozenset[str] = frozenset()

    @property
    def succeeded(self) -> frozenset[str]:
        return self.finished - self.failed


class CompletionGatherer:
    """Accumulates per-rank terminal reports (each rank may report a request in a different
    step) and emits each request once, when every one of ``tp_size`` ranks reported it."""

    def __init__(self, tp_size: int) -> None:
        size = operator.index(tp_size) if not isinstance(tp_size, bool) else 0
        if size < 1:
            raise ConfigError(f"tp_size must be >= 1, got {tp_size!r}")
        self._tp_size = size
        self._reports: dict[str, dict[int, TerminalState]] = {}

    @property
    def tp_size(self) -> int:
        return self._tp_size

    def add(self, rank: int, terminal: Mapping[str, TerminalState]) -> None:
        """Rank ``rank`` reports ``terminal`` (as from its :meth:`RequestTracker.take_terminal`).

        A repeated identical report is ignored; a conflicting one raises StateError.
        """
        if isinstance(rank, bool) or not 0 <= operator.index(rank) < self._tp_size:
            raise ConfigError(f"rank {rank!r} is out of range for tp_size {self._tp_size}")
        report = {ext_id: TerminalState(state) for ext_id, state in terminal.items()}
        for ext_id, state in report.items():  # check everything before changing anything
            seen = self._reports.get(ext_id, {}).get(rank, state)
            if seen is not state:
                raise StateError(
                    f"request {ext_id!r}: rank {rank} reported {state.name} after {seen.name}"
                )
        for ext_id, state in report.items():
            self._reports.setdefault(ext_id, {})[rank] = state

    def take(self) -> GatherResult:
        """Requests that every rank has reported since they were last taken."""
        finished, failed = set(), set()
        for ext_id, by_rank in list(self._reports.items()):
            if len(by_rank) == self._tp_size:
                finished.add(ext_id)
                if TerminalState.FAILED in by_rank.values():
                    failed.add(ext_id)
                del self._reports[ext_id]
        return GatherResult(frozenset(finished), frozenset(failed))

    def update(self, per_rank: Sequence[Mapping[str, TerminalState]]) -> GatherResult:
        """One step: every rank's report (index = rank), then :meth:`take`."""
        if len(per_rank) != self._tp_size:
            raise ConfigError(f"expected {self._tp_size} rank reports, got {len(per_rank)}")
        for rank, terminal in enumerate(per_rank):
            self.add(rank, terminal)
        return self.take()

    def waiting_on(self, ext_id: str) -> frozenset[int]:
        """Ranks that have not yet reported ``ext_id`` (empty if nothing is held for it)."""
        by_rank = self._reports.get(ext_id)
        return frozenset() if by_rank is None else frozenset(range(self._tp_size)) - by_rank.keys()

    def __len__(self) -> int:
        return len(self._reports)


def gather_terminal(per_rank: Sequence[Mapping[str, TerminalState]]) -> GatherResult:
    """One-shot gather: requests terminal in every rank's mapping (index = rank)."""
    if not per_rank:
        raise ConfigError("gather_terminal needs at least one rank's report")
    return CompletionGatherer(len(per_rank)).update(per_rank)


# -- request ids ----------------------------------------------------------------------------


class RequestIdMap:
    """External (cross-engine) <-> internal (vLLM) request ids, one to one."""

    def __init__(self) -> None:
        self._to_internal: dict[str, str] = {}
        self._to_external: dict[str, str] = {}

    def add(self, ext_id: str, internal_id: str) -> None:
        """Raises StateError if either id is already mapped."""
        if ext_id in self._to_internal:
            raise StateError(
                f"external id {ext_id!r} already maps to {self._to_internal[ext_id]!r}"
            )
        if internal_id in self._to_external:
            raise StateError(
                f"internal id {internal_id!r} already maps to {self._to_external[internal_id]!r}"
            )
        self._to_internal[ext_id] = internal_id
        self._to_external[internal_id] = ext_id

    def internal(self, ext_id: str) -> str:
        try:
            return self._to_internal[ext_id]
        except KeyError:
            raise UnknownRequestError(f"no internal id for external id {ext_id!r}") from None

    def external(self, internal_id: str) -> str:
        try:
            return self._to_external[internal_id]
        except KeyError:
            raise UnknownRequestError(f"no external id for internal id {internal_id!r}") from None

    def pop(self, ext_id: str) -> str:
        """Remove ``ext_id``'s mapping and return its internal id."""
        internal_id = self.internal(ext_id)
        del self._to_internal[ext_id]
        del self._to_external[internal_id]
        return internal_id

    def __contains__(self, ext_id: object) -> bool:
        return ext_id in self._to_internal

    def __len__(self) -> int:
        return len(self._to_internal)
