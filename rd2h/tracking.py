"""Completion tracking on Decode: contributor and request completion, gathering over the
Decode TP ranks, request id mapping. Pure state machines over ``Enum`` states and
transition tables; no I/O, no threads. (The Prefill storage-slot gate is ``rd2h.slots``.)

An event a table does not allow raises :class:`~rd2h.errors.StateError` naming the state
and the event; an id a tracker does not know raises :class:`~rd2h.errors.UnknownRequestError`.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum

from rd2h.errors import ConfigError, StateError, UnknownRequestError
from rd2h.statemachine import count as _count
from rd2h.statemachine import step as _step

__all__ = [
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
