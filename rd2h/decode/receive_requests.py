"""The requests of one Decode rank: destinations held, deadlines, outcomes (pure).

:class:`RequestTable` is the local half of :class:`~rd2h.decode.receive_tracker.ReceiveTracker`:
what the caller asks (``expect``, ``abort``, ``fail``), the clock (``expire``) and the
outcomes it collects. The tracker adds the remote half (peers and their messages) on top.
A request settles into an :class:`~rd2h.outcome.Outcome` once it is terminal and no read is
writing its destinations; only then are those released for another ``expect``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from rd2h.decode.completeness import Coverage
from rd2h.decode.early_announcements import EarlyAnnouncements
from rd2h.decode.held_blocks import HeldBlocks
from rd2h.decode.rank_reads import Destinations
from rd2h.decode.receive_states import TERMINAL as _TERMINAL
from rd2h.decode.receive_states import ReceiveEvent as _Event
from rd2h.decode.receive_states import ReceiveState
from rd2h.decode.receive_states import RequestRecord as _Request
from rd2h.errors import ConfigError, DeadlineExceeded, DuplicateRequestError, RD2HError, StateError, UnknownRequestError
from rd2h.layout.layers import LayerLayout
from rd2h.outcome import Outcome, OutcomeBook

__all__ = ["RequestTable"]


class RequestTable:
    """Live requests and settled outcomes of one Decode rank. ``layers`` bound the
    destinations ``expect`` accepts; ``request_timeout``: seconds after ``expect`` when a
    request not yet complete fails with DeadlineExceeded (None: no default deadline)."""

    def __init__(self, layers: Mapping[str, LayerLayout], request_timeout: float | None) -> None:
        self.request_timeout = request_timeout
        self._held = HeldBlocks(layers)  # no two live requests share a destination block
        self._requests: dict[str, _Request] = {}
        self._early = EarlyAnnouncements()  # ids refused before expect: a late expect fails at once
        # no live request's deadline is earlier (a lower bound: an ended request may have set
        # it); expire scans the requests only once it passed
        self._next_deadline = math.inf
        self._serials = 0
        self._book = OutcomeBook()

    # -- local calls --------------------------------------------------------------------

    def expect(
        self,
        ext_id: str,
        destinations: Destinations,
        now: float,
        *,
        first_block: int = 0,
        indexer_first_block: int | None = None,
        deadline: float | None = None,
        expected_peer: str | None = None,
    ) -> None:
        """``ext_id`` lands in ``destinations``; Prefill sends positions ``first_block`` on
        (a cached prefix is not sent). ``deadline`` is seconds from ``now`` (default: the
        tracker's ``request_timeout``). ``expected_peer``: only a peer that proved this
        identity (``peer_admitted``) may announce it; another peer's readiness naming it is
        refused and leaves it untouched (None: any admitted peer).

        Raises DuplicateRequestError if ``ext_id`` is live or its outcome is not collected
        yet, DestinationError for a block repeated, out of range or held by another live
        request, ConfigError for a first block past the destinations.
        """
        if ext_id in self._requests or ext_id in self._book:
            raise DuplicateRequestError(f"request {ext_id!r} is already expected on this rank (or not yet collected)")
        index_first = first_block if indexer_first_block is None else indexer_first_block
        for what, first, ids in (("main", first_block, destinations.main), ("indexer", index_first, destinations.indexer)):
            if not 0 <= first <= len(ids):
                raise ConfigError(f"request {ext_id!r}: {what} first block {first} outside 0..{len(ids)}")
        written = Destinations(destinations.main[first_block:], destinations.indexer[index_first:])
        self._held.check(ext_id, destinations, written, self._holder)
        self._held.hold(written)
        timeout = self.request_timeout if deadline is None else deadline
        request = _Request(
            ext_id,
            destinations,
            written,
            Coverage((first_block, len(destinations.main)), (index_first, len(destinations.indexer))),
            started=now,
            deadline=None if timeout is None else now + timeout,
            expected_peer=expected_peer,
        )
        self._serials += 1
        request.serial = self._serials
        self._requests[ext_id] = request
        if request.deadline is not None:
            self._next_deadline = min(self._next_deadline, request.deadline)
        early = self._early.pop(ext_id)
        if early is not None and self._may_announce(request, early):
            self._fail(request, StateError(
                f"request {ext_id!r}: Prefill announced it before Decode expected it (a rendezvous "
                "race); it was refused then and will not be sent again"
            ), now)

    def abort(self, ext_id: str, now: float) -> bool:
        """Stop writing into ``ext_id``'s destinations. True if it is live here, and then it
        will be reported: ABORTED once no read is writing them (the reply to a read in flight
        names it failed, so Prefill cannot report it DONE). Once its final layer was answered
        (CONFIRMING: every byte read, READ_DONE sent) Prefill reports it DONE on the strength
        of that reply, so the abort changes nothing: it ends as Prefill confirms it (DONE, or
        FAILED if Prefill failed it), the outcome both sides report. False, and nothing
        recorded, for an id not live here."""
        request = self._requests.get(ext_id)
        if request is None:
            return False
        request.apply(_Event.ABORT)
        self._settle_if_idle(request, now)
        return True

    def fail(self, ext_id: str, error: RD2HError, now: float) -> bool:
        """Fail ``ext_id`` with ``error`` (a local decision). False for an id not live here."""
        request = self._requests.get(ext_id)
        if request is None:
            return False
        self._fail(request, error, now)
        return True

    def expire(self, now: float) -> list[str]:
        """Fail every live request whose deadline passed; their ids. Scans the requests only
        when the earliest deadline may have passed (called after every message)."""
        self._early.prune(now)
        if now < self._next_deadline:
            return []
        late, self._next_deadline = [], math.inf
        for r in self._requests.values():
            if r.deadline is None or r.terminal:
                continue
            if now >= r.deadline:
                late.append(r)
            else:
                self._next_deadline = min(self._next_deadline, r.deadline)
        for request in late:
            waited = now - request.started
            self._fail(request, DeadlineExceeded(
                f"request {request.ext_id!r}: not complete {waited:.1f}s after it was expected "
                f"({request.state.value}; contributors final: {sorted(request.finals)})"
            ), now)
        return [r.ext_id for r in late]

    # -- collecting outcomes ------------------------------------------------------------

    def take(self) -> dict[str, Outcome]:
        """Every outcome settled since the last call (consumed)."""
        return self._book.take()

    def collect(self, ext_ids: Iterable[str]) -> dict[str, Outcome] | None:
        """The outcomes of ``ext_ids`` if all are settled (consumed), else None (nothing
        consumed). Raises UnknownRequestError for an id neither live nor settled."""
        ids = list(ext_ids)
        unknown = [e for e in ids if e not in self._requests and e not in self._book]
        if unknown:
            raise UnknownRequestError(f"request(s) {unknown[:5]} not expected on this rank (or already collected)")
        if not self._book.has_all(ids):
            return None
        return self._book.pop(ids)

    def settled(self) -> int:
        """Outcomes settled and not yet collected."""
        return len(self._book)

    def pending(self, ext_ids: Iterable[str]) -> list[str]:
        return [e for e in ext_ids if e not in self._book]

    def state(self, ext_id: str) -> ReceiveState:
        """The state of a live request, or of a settled one not yet collected."""
        request = self._requests.get(ext_id)
        if request is not None:
            return request.state
        if ext_id in self._book:
            return ReceiveState(self._book.peek(ext_id).state.value)
        raise UnknownRequestError(f"request {ext_id!r} is not tracked on this rank")

    def live(self) -> list[str]:
        """Requests expected and not yet settled."""
        return list(self._requests)

    def reading(self, ext_id: str) -> bool:
        request = self._requests.get(ext_id)
        return request is not None and request.reading

    def __contains__(self, ext_id: object) -> bool:
        return ext_id in self._requests or ext_id in self._book

    def __len__(self) -> int:
        """Live requests (settled ones not counted)."""
        return len(self._requests)

    # -- internals ----------------------------------------------------------------------

    @staticmethod
    def _may_announce(request: _Request, proven: frozenset[str]) -> bool:
        return request.expected_peer is None or request.expected_peer in proven


    def _holder(self, what: str, block: int) -> str:
        for request in self._requests.values():
            if block in (request.written.main if what == "main" else request.written.indexer):
                return request.ext_id
        return "another request"

    def _fail(self, request: _Request, error: RD2HError, now: float) -> None:
        request.apply(_Event.FAIL, error)
        self._settle_if_idle(request, now)

    def _settle_if_idle(self, request: _Request, now: float) -> None:
        if not request.terminal or request.reading:
            return
        del self._requests[request.ext_id]
        self._held.hold(request.written, False)
        self._book.settle(Outcome(
            request.ext_id,
            _TERMINAL[request.state],
            request.error if request.state is ReceiveState.FAILED else None,
            request.nbytes,
            request.started,
            now,
        ))
