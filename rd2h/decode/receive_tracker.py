"""Decode's receive tracker: per request and per Prefill peer, as a pure state machine.

One :class:`ReceiveTracker` serves one Decode TP rank. The runtime (``rd2h.decode.sink``) feeds
it local calls (``expect``, ``abort``, ``fail``), remote messages (a peer admitted or
refused, a readiness, the result of its read), the clock (``expire``) and peer deaths;
the tracker answers with what to read and what to tell Prefill. It never raises on remote
input: a peer's bad, late or repeated message becomes a per-request failure named in the
reply. Local misuse (expecting a live id again, destinations that overlap) raises.

Invariants, checked by the stateful tests: every expected request settles exactly once
into an :class:`~rd2h.outcome.Outcome`; nothing settles for an id the caller never
expected; a settled request leaves no state behind but its uncollected outcome; a request
whose destinations a read may be writing settles only after that read.

Its states and transitions are drawn in :mod:`rd2h.decode.receive_states`.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from rd2h.decode.completeness import ChunkKey, Coverage
from rd2h.decode.held_blocks import HeldBlocks
from rd2h.decode.rank_reads import Destinations, MainSplit
from rd2h.decode.receive_states import TERMINAL as _TERMINAL
from rd2h.decode.receive_states import PeerRecord as _Peer
from rd2h.decode.receive_states import PeerState as _PeerState
from rd2h.decode.receive_states import ReceiveEvent as _Event
from rd2h.decode.receive_states import ReceiveState
from rd2h.decode.receive_states import RequestRecord as _Request
from rd2h.errors import (
    BlockRangeError,
    ConfigError,
    DeadlineExceeded,
    DuplicateRequestError,
    ProtocolError,
    RD2HError,
    StateError,
    UnknownRequestError,
)
from rd2h.layout.layers import LayerLayout
from rd2h.outcome import Outcome, OutcomeBook, TerminalState
from rd2h.wire import protocol

__all__ = [
    "ReceiveState",
    "Admission",
    "ReceiveTracker",
]

Int64Array = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class Admission:
    """What to do with one readiness: read ``readable``, refuse ``refused`` (named in the
    reply with their errors), or, with ``meta_required``, ask the peer who it is."""

    readable: dict[str, Destinations]
    refused: dict[str, RD2HError]
    meta_required: bool = False
    # which expected requests were admitted (id, serial): what is derived from ``readable``
    # may be reused while this stays the same
    requests: tuple[tuple[str, int], ...] = ()


def _chunk(req: protocol.ReadRequest) -> ChunkKey:
    return (req.main_start_block, len(req.main_block_ids), req.indexer_start_block, len(req.indexer_block_ids))


# A readiness for an id not (yet) expected is refused; the id is remembered a while so an
# expect that arrives late (a rendezvous race) fails at once instead of waiting for bytes
# Prefill will never send again. Bounded in count and age.
_EARLY_LIMIT = 4096
_EARLY_SECONDS = 120.0


class ReceiveTracker:
    """Receive state of one Decode rank.

    ``layers`` are this rank's destination layouts (their block counts bound the
    destinations ``expect`` accepts, their names are the layers coverage requires).
    ``request_timeout``: seconds after ``expect`` when a request not yet complete fails
    with DeadlineExceeded (None: no default deadline).
    """

    def __init__(
        self,
        layers: Mapping[str, LayerLayout],
        *,
        decode_rank: int = 0,
        decode_tp: int = 1,
        main_split: MainSplit | str = MainSplit.SHARED,
        request_timeout: float | None = None,
    ) -> None:
        if not layers:
            raise ConfigError("a Decode rank needs at least one destination layer")
        if not 0 <= decode_rank < decode_tp:
            raise ConfigError(f"decode rank {decode_rank} outside 0..{decode_tp - 1}")
        try:
            self.main_split = MainSplit(main_split)
        except ValueError:
            modes = ", ".join(m.value for m in MainSplit)
            raise ConfigError(f"main_split {main_split!r} is not one of: {modes}") from None
        self.decode_rank, self.decode_tp = decode_rank, decode_tp
        self.request_timeout = request_timeout
        self._layer_names = frozenset(layers)
        self._held = HeldBlocks(layers)  # no two live requests share a destination block
        self._requests: dict[str, _Request] = {}
        self._peers: dict[bytes, _Peer] = {}
        self._early: OrderedDict[str, tuple[float, frozenset[str]]] = OrderedDict()
        # no live request's deadline is earlier (a lower bound: an ended request may have set
        # it); expire scans the requests only once it passed
        self._next_deadline = math.inf
        self._serials = 0
        self._book = OutcomeBook()
        self.malformed = 0  # messages refused before any request could be named
        self.stray_settles = 0  # ids in a ``settled`` that named nothing this peer may settle

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
        early = self._early.pop(ext_id, None)
        if early is not None and self._may_announce(request, early[1]):
            self._fail(request, StateError(
                f"request {ext_id!r}: Prefill announced it before Decode expected it (a rendezvous "
                "race); it was refused then and will not be sent again"
            ), now)

    def abort(self, ext_id: str, now: float) -> bool:
        """Stop writing into ``ext_id``'s destinations; it settles ABORTED (once no read is
        writing them). False, and nothing recorded, for an id not live here."""
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
        while self._early and now - next(iter(self._early.values()))[0] > _EARLY_SECONDS:
            self._early.popitem(last=False)
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

    # -- remote input -------------------------------------------------------------------

    def peer_admitted(
        self, identity: bytes, p_session: str, proven: Iterable[str] = (), *, confirms: bool = True
    ) -> None:
        """The peer's mf_meta was accepted (a repeated one replaces the earlier). ``proven``:
        the identities it proved (its engine session id, its CURVE key), which requests
        expected from a given Prefill are matched against. ``confirms``: it says how each
        request ended (``on_settled``), so the requests it contributes to wait for that
        before DONE; False for a reference-implementation peer, which never does."""
        self._peers[identity] = _Peer(_PeerState.ADMITTED, p_session, proven=frozenset(proven), confirms=confirms)

    def peer_refused(self, identity: bytes, p_session: str, error: RD2HError) -> None:
        """The peer's mf_meta was refused: its readiness fails with ``error`` from now on."""
        self._peers[identity] = _Peer(_PeerState.REFUSED, p_session, error)

    def peer_gone(self, identity: bytes, error: RD2HError, now: float) -> list[str]:
        """The peer died or was dropped: fail the live requests it announced; their ids."""
        self._peers.pop(identity, None)
        hit = [r for r in self._requests.values() if identity in r.peers and not r.terminal]
        for request in hit:
            self._fail(request, error, now)
        return [r.ext_id for r in hit]

    def announcing(self, identity: bytes) -> bool:
        """Whether a live request was announced by ``identity`` (forgetting it would fail it)."""
        return any(identity in r.peers and not r.terminal for r in self._requests.values())

    def peers(self) -> dict[bytes, str]:
        """Admitted peers: identity -> p_session."""
        return {i: p.p_session for i, p in self._peers.items() if p.state is _PeerState.ADMITTED}

    def on_readiness(self, identity: bytes, batch: protocol.ReadReadyBatch, now: float) -> Admission:
        """A readiness arrived: which of its requests to read now (marked as being read)."""
        peer = self._peers.get(identity)
        if peer is None:
            return Admission({}, {}, meta_required=True)
        readable: dict[str, Destinations] = {}
        refused: dict[str, RD2HError] = {}
        serials: list[tuple[str, int]] = []
        for req in batch.read_reqs:
            ext_id = req.ext_req_id
            if ext_id in readable or ext_id in refused:
                refused[ext_id] = ProtocolError(f"request {ext_id!r} is named twice in one readiness")
                readable.pop(ext_id, None)
                continue
            if peer.state is _PeerState.REFUSED:
                refused[ext_id] = peer.error or ProtocolError("mf_meta refused")
                request = self._requests.get(ext_id)
                if request is not None and self._may_announce(request, peer.proven):
                    self._fail(request, refused[ext_id], now)  # fail it here too: both sides agree
                continue
            refused_why = self._why_unreadable(ext_id, now, peer.proven)
            if refused_why is not None:
                refused[ext_id] = refused_why
                continue
            request = self._requests[ext_id]
            if not self._may_announce(request, peer.proven):  # not its to announce: untouched
                refused[ext_id] = ProtocolError(
                    f"request {ext_id!r} is expected from Prefill {request.expected_peer!r:.80}; "
                    f"this peer ({peer.p_session!r:.80}) may not announce it"
                )
                continue
            request.peers.add(identity)
            request.reading = True
            readable[ext_id] = request.destinations
            serials.append((ext_id, request.serial))
        return Admission(readable, refused, requests=tuple(serials))

    def on_read(
        self,
        identity: bytes,
        batch: protocol.ReadReadyBatch,
        admission: Admission,
        failed: Mapping[str, RD2HError],
        nbytes: Mapping[str, int],
        now: float,
    ) -> dict[str, RD2HError]:
        """The read that ``admission`` allowed finished; ``failed`` are the requests it did not
        read. Applies the layer and the final signals; returns every request to name as
        failed in the reply (the refused, the failed, and finals that claim what was not
        read), so Prefill's outcome agrees with Decode's."""
        reply_failures = dict(admission.refused)
        chunks = {r.ext_req_id: _chunk(r) for r in batch.read_reqs}
        member = batch.group_member_idx
        for ext_id in admission.readable:
            request = self._requests.get(ext_id)
            if request is None:
                continue
            request.reading = False
            error = failed.get(ext_id)
            if error is not None:
                reply_failures[ext_id] = error
                self._fail(request, error, now)
                continue
            request.apply(_Event.READ)
            request.nbytes += nbytes.get(ext_id, 0)
            request.coverage.record(member, batch.layer_name, chunks[ext_id])
        for ext_id in batch.done_ext_ids:
            request = self._requests.get(ext_id)
            if request is None or request.terminal or ext_id not in admission.readable:
                continue
            error = self._final(request, identity, member, batch.tp_ratio)
            if error is not None:
                reply_failures[ext_id] = error
                self._fail(request, error, now)
        for ext_id in admission.readable:  # an abort or failure that came during the read
            request = self._requests.get(ext_id)
            if request is not None:
                self._settle_if_idle(request, now)
        return reply_failures

    def on_settled(self, identity: bytes, settled: protocol.Settled, now: float) -> list[str]:
        """Prefill says how requests ended on its side: a DONE confirms (the request is DONE
        once every final contributor confirmed), a failure fails the request here too. Ids
        this peer may not settle are counted and ignored; a DONE for a request this peer
        never finished reading is a protocol violation that fails it. Returns the ids that
        settled."""
        peer = self._peers.get(identity)
        if peer is None or peer.state is not _PeerState.ADMITTED:
            self.stray_settles += len(settled.done_ext_ids) + len(settled.failed_ext_ids)
            return []
        hit = []
        for ext_id in settled.done_ext_ids:
            request = self._requests.get(ext_id)
            if request is None or request.terminal or identity not in request.peers:
                self.stray_settles += 1
                continue
            if identity not in request.unconfirmed:
                self._fail(request, ProtocolError(
                    f"request {ext_id!r}: Prefill {peer.p_session!r:.80} says it is done, but its final "
                    "layer was not read from that peer"
                ), now)
                hit.append(ext_id)
                continue
            request.unconfirmed.discard(identity)
            if request.state is ReceiveState.CONFIRMING and not request.unconfirmed:
                request.apply(_Event.CONFIRMED)
                self._settle_if_idle(request, now)
                hit.append(ext_id)
        if settled.failed_ext_ids:
            error = settled.exception()
            error.args = (f"Prefill {peer.p_session[:80]}: {error}", *error.args[1:])
            for ext_id in settled.failed_ext_ids:
                request = self._requests.get(ext_id)
                if request is None or request.terminal or not self._may_settle(request, identity, peer):
                    self.stray_settles += 1
                    continue
                self._fail(request, error, now)
                hit.append(ext_id)
        return hit

    def reply_lost(self, admission: Admission, error: RD2HError, now: float) -> list[str]:
        """The reply to the readiness ``admission`` answered never reached Prefill (it gave
        up on this Decode, or does not read): Prefill will fail its requests, so Decode
        fails them too, a DONE this very readiness settled included (it is not collected
        yet: the caller holds the tracker from ``on_read`` to the reply). Returns their ids."""
        hit = []
        for ext_id in admission.readable:
            request = self._requests.get(ext_id)
            if request is not None:
                if not request.terminal:
                    self._fail(request, error, now)
                    hit.append(ext_id)
            elif ext_id in self._book and self._book.peek(ext_id).state is TerminalState.DONE:
                done = self._book.peek(ext_id)
                self._book.replace(Outcome(ext_id, TerminalState.FAILED, error, done.nbytes, done.started, now))
                hit.append(ext_id)
        return hit

    def fail_readable(self, admission: Admission, error: RD2HError, now: float) -> dict[str, RD2HError]:
        """The whole layer failed before any read (a layout mismatch): fail every request the
        admission allowed; the reply names them and the refused ones."""
        failures = dict(admission.refused)
        for ext_id in admission.readable:
            request = self._requests.get(ext_id)
            if request is None:
                continue
            request.reading = False
            failures[ext_id] = error
            self._fail(request, error, now)
        return failures

    # -- internals ----------------------------------------------------------------------

    @staticmethod
    def _may_announce(request: _Request, proven: frozenset[str]) -> bool:
        return request.expected_peer is None or request.expected_peer in proven

    def _may_settle(self, request: _Request, identity: bytes, peer: _Peer) -> bool:
        """A peer may fail a request it announced, or one it may announce that nobody did yet."""
        if identity in request.peers:
            return True
        return not request.peers and self._may_announce(request, peer.proven)

    def _why_unreadable(self, ext_id: str, now: float, proven: frozenset[str] = frozenset()) -> RD2HError | None:
        request = self._requests.get(ext_id)
        if request is not None:
            if request.terminal or request.state is ReceiveState.CONFIRMING:
                return StateError(f"request {ext_id!r} is already {request.state.value} on Decode")
            return None
        if ext_id in self._book:
            outcome = self._book.peek(ext_id)
            return StateError(f"request {ext_id!r} already finished on Decode ({outcome.state.value}); not read again")
        # who announced it: an expect bound to another Prefill ignores this early announcement
        earlier = self._early.get(ext_id)
        self._early[ext_id] = (now, proven if earlier is None else earlier[1] | proven)
        self._early.move_to_end(ext_id)
        while len(self._early) > _EARLY_LIMIT:
            self._early.popitem(last=False)
        return UnknownRequestError(f"request {ext_id!r} is not expected on this Decode rank")

    def _final(self, request: _Request, identity: bytes, member: int, ratio: int) -> RD2HError | None:
        """Contributor ``member`` (peer ``identity``) says it sent everything; None if believed
        (and counted)."""
        if request.ratio is None:
            request.ratio = ratio
        elif request.ratio != ratio:
            return ProtocolError(
                f"request {request.ext_id!r}: member {member} reports tp_ratio {ratio}, "
                f"earlier contributors reported {request.ratio}"
            )
        gap = request.coverage.missing(member, self._layer_names)
        if gap is not None:
            return BlockRangeError(f"request {request.ext_id!r}: final signal, but {gap}")
        request.finals.add(member)
        peer = self._peers.get(identity)
        if peer is not None and peer.confirms:
            request.unconfirmed.add(identity)
        if len(request.finals) == ratio:
            request.apply(_Event.READ_ALL if request.unconfirmed else _Event.COMPLETE)
        return None

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
