"""Across the Decode TP ranks: gathering per-rank outcomes, and request id mapping (pure).

Each rank's requests are tracked by its :class:`~rd2h.receiving.ReceiveTracker`; a worker
with several ranks (vLLM's TP group) reports a request finished only when every rank has
settled it, which :class:`CompletionGatherer` decides. :class:`RequestIdMap` maps the
cross-engine request id to vLLM's internal one.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from rd2h.errors import ConfigError, StateError, UnknownRequestError
from rd2h.outcome import TerminalState

__all__ = [
    "GatherResult",
    "CompletionGatherer",
    "gather_terminal",
    "RequestIdMap",
]

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
        """Rank ``rank`` reports ``terminal`` (the states of the outcomes it took).

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
