"""How a request ended, the same type on both sides (pure: no I/O, no threads).

Prefill's send tracker and Decode's receive tracker each settle every request they were
given exactly once, into an :class:`Outcome`. Callers collect outcomes by one rule on both
sides: ``take()`` returns every outcome settled since the last call, ``wait(ids)`` returns
those of ``ids``; either way what is returned is consumed, so the id may be used again.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

from rd2h.errors import RD2HError

__all__ = ["TerminalState", "Outcome", "OutcomeBook"]


class TerminalState(Enum):
    DONE = "done"  # every expected byte arrived (Decode) / every endpoint read it (Prefill)
    FAILED = "failed"  # ``Outcome.error`` says why
    ABORTED = "aborted"  # the caller gave up on it; still reported, so its blocks are freed


@dataclass(frozen=True, slots=True)
class Outcome:
    """One request's end: its id, terminal state, the error if it failed, bytes moved
    (read on Decode, announced to be read on Prefill) and when it started and ended, in
    the tracker's clock."""

    ext_id: str
    state: TerminalState
    error: RD2HError | None = None
    nbytes: int = 0
    started: float = 0.0
    finished: float = 0.0

    @property
    def ok(self) -> bool:
        return self.state is TerminalState.DONE

    @property
    def seconds(self) -> float:
        return self.finished - self.started


class OutcomeBook:
    """Settled outcomes not yet collected, in settling order; each is handed out once."""

    def __init__(self) -> None:
        self._ready: dict[str, Outcome] = {}

    def settle(self, outcome: Outcome) -> None:
        # a tracker settles a request once; a second settle would be a tracker bug
        assert outcome.ext_id not in self._ready, f"{outcome.ext_id!r} settled twice"
        self._ready[outcome.ext_id] = outcome

    def take(self) -> dict[str, Outcome]:
        taken, self._ready = self._ready, {}
        return taken

    def replace(self, outcome: Outcome) -> None:
        """Settle again an outcome not collected yet (a DONE that must become FAILED)."""
        assert outcome.ext_id in self._ready, f"{outcome.ext_id!r} is not settled"
        self._ready[outcome.ext_id] = outcome

    def peek(self, ext_id: str) -> Outcome:
        """The settled outcome of ``ext_id``, not consumed (KeyError if none)."""
        return self._ready[ext_id]

    def has_all(self, ext_ids: Iterable[str]) -> bool:
        return all(e in self._ready for e in ext_ids)

    def pop(self, ext_ids: Iterable[str]) -> dict[str, Outcome]:
        """The outcomes of ``ext_ids`` that are settled, consumed."""
        return {e: self._ready.pop(e) for e in list(ext_ids) if e in self._ready}

    def __contains__(self, ext_id: object) -> bool:
        return ext_id in self._ready

    def __len__(self) -> int:
        return len(self._ready)
