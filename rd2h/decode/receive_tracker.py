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

Its states and transitions are drawn in :mod:`rd2h.decode.receive_states`; the local half
(requests, destinations, deadlines, outcomes) is :mod:`rd2h.decode.receive_requests`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from rd2h.decode.completeness import ChunkKey
from rd2h.decode.rank_reads import Destinations, MainSplit
from rd2h.decode.receive_requests import RequestTable
from rd2h.decode.receive_states import PeerRecord as _Peer
from rd2h.decode.receive_states import PeerState as _PeerState
from rd2h.decode.receive_states import ReceiveEvent as _Event
from rd2h.decode.receive_states import ReceiveState
from rd2h.decode.receive_states import RequestRecord as _Request
from rd2h.errors import (
    BlockRangeError,
    ConfigError,
    ProtocolError,
    RD2HError,
    StateError,
    UnknownRequestError,
)
from rd2h.layout.layers import LayerLayout
from rd2h.outcome import Outcome, TerminalState
from rd2h.wire import protocol

__all__ = [
    "ReceiveState",
    "Admission",
    "ReceiveTracker",
]


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


def _broken(what: str, exc: Exception) -> ProtocolError:
    """The failure of the requests a message named when handling it raised (a defect here,
    or input no check foresaw): the message's fault as far as its requests go."""
    return ProtocolError(f"Decode could not handle this {what}: {type(exc).__name__}: {exc}")


class ReceiveTracker(RequestTable):
    """Receive state of one Decode rank: its requests (local calls, deadlines, outcomes: see
    :class:`~rd2h.decode.receive_requests.RequestTable`) and its Prefill peers' messages.

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
        super().__init__(layers, request_timeout)
        self.decode_rank, self.decode_tp = decode_rank, decode_tp
        self._layer_names = frozenset(layers)
        self._peers: dict[bytes, _Peer] = {}
        self.malformed = 0  # messages refused before any request could be named
        self.stray_settles = 0  # ids in a ``settled`` that named nothing this peer may settle

    # -- remote input -------------------------------------------------------------------

    def peer_admitted(
        self, identity: bytes, p_session: str, proven: Iterable[str] = (), *, confirms: bool = True,
        stage: int | None = None, stage_layers: Iterable[str] = (),
    ) -> None:
        """The peer's mf_meta was accepted (a repeated one replaces the earlier). ``proven``:
        the identities it proved (its engine session id, its CURVE key), which requests
        expected from a given Prefill are matched against. ``confirms``: it says how each
        request ended (``on_settled``), so the requests it contributes to wait for that
        before DONE; False for a reference-implementation peer, which never does.
        ``stage``: the peer is that pipeline stage of its Prefill and holds ``stage_layers``
        only: its final signal covers those of this rank's layers, and a contributor member is
        complete once its stages' finals cover every layer (None: the peer must send them all)."""
        layers = None if stage is None else frozenset(stage_layers) & self._layer_names
        self._peers[identity] = _Peer(
            _PeerState.ADMITTED, p_session, proven=frozenset(proven), confirms=confirms, stage=stage,
            stage_layers=layers,
        )

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

    def peer_token(self, identity: bytes) -> object:
        """What ``readmit`` compares to tell that the peer's record did not change since."""
        return self._peers.get(identity)

    def readmit(self, identity: bytes, admission: Admission, token: object) -> bool:
        """Admit again, for another layer of the same step, exactly what ``admission`` admitted
        (marked as being read), when ``on_readiness`` would: the peer's record is still
        ``token`` (``peer_token``), and each request is the same instance, live, not
        confirming and announced by this peer. False, and nothing changed, otherwise (the
        caller then takes ``on_readiness``)."""
        peer = self._peers.get(identity)
        if peer is None or peer is not token or peer.state is not _PeerState.ADMITTED or admission.refused:
            return False
        records = []
        requests = self._requests
        for ext_id, serial in admission.requests:
            request = requests.get(ext_id)
            if (
                request is None or request.serial != serial or request.terminal
                or request.state is ReceiveState.CONFIRMING or identity not in request.peers
            ):
                return False
            records.append(request)
        if len(records) != len(admission.readable):
            return False
        for request in records:
            request.reading = True
        return True

    # Each entry below is guarded (the h11 habit): whatever a peer's message makes the tracker
    # do, an exception becomes the failure of the requests that message named, which the
    # reply names too, so both sides settle them; the loop goes on.

    def on_readiness(self, identity: bytes, batch: protocol.ReadReadyBatch, now: float) -> Admission:
        """A readiness arrived: which of its requests to read now (marked as being read)."""
        try:
            return self._admit(identity, batch, now)
        except Exception as exc:  # noqa: BLE001 - it costs the named requests, never the loop
            named = [r.ext_req_id for r in batch.read_reqs] + list(batch.done_ext_ids)
            return Admission({}, self._fail_named(identity, named, _broken("readiness", exc), now))

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
        failed in the reply (the refused, the failed, those aborted or failed on Decode while
        the read ran, and finals that claim what was not read), so Prefill's outcome agrees
        with Decode's."""
        try:
            return self._apply_read(identity, batch, admission, failed, nbytes, now)
        except Exception as exc:  # noqa: BLE001
            return self.fail_readable(admission, _broken("read result", exc), now)

    def on_settled(self, identity: bytes, settled: protocol.Settled, now: float) -> list[str]:
        """Prefill says how requests ended on its side: a DONE confirms (the request is DONE
        once every final contributor confirmed), a failure fails the request here too. Ids
        this peer may not settle are counted and ignored; a DONE for a request this peer
        never finished reading is a protocol violation that fails it. Returns the ids that
        settled."""
        try:
            return self._apply_settled(identity, settled, now)
        except Exception as exc:  # noqa: BLE001
            named = [*settled.done_ext_ids, *settled.failed_ext_ids]
            return list(self._fail_named(identity, named, _broken("settled notice", exc), now, only_hit=True))

    def reply_lost(self, admission: Admission, error: RD2HError, now: float) -> list[str]:
        """The reply to the readiness ``admission`` answered never reached Prefill (it gave
        up on this Decode, or does not read): Prefill will fail its requests, so Decode
        fails them too, a DONE this very readiness settled included (it is not collected
        yet: the caller holds the tracker from ``on_read`` to the reply). Returns their ids."""
        return self._fail_admitted(admission, error, now)

    def fail_readable(self, admission: Admission, error: RD2HError, now: float) -> dict[str, RD2HError]:
        """The whole layer failed (a layout mismatch before any read, or a read Decode could
        not handle): fail every request the admission allowed; the reply names them and the
        refused ones."""
        self._fail_admitted(admission, error, now)
        return {**admission.refused, **dict.fromkeys(admission.readable, error)}

    # -- remote input, unguarded (only through the entries above) -------------------------

    def _admit(self, identity: bytes, batch: protocol.ReadReadyBatch, now: float) -> Admission:
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
                if readable.pop(ext_id, None) is not None:  # the reply names it failed: Decode fails it too
                    twice = self._requests[ext_id]
                    twice.reading = False  # its mark from the first entry: nothing will read it
                    serials.remove((ext_id, twice.serial))
                    self._fail(twice, refused[ext_id], now)
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

    def _apply_read(
        self,
        identity: bytes,
        batch: protocol.ReadReadyBatch,
        admission: Admission,
        failed: Mapping[str, RD2HError],
        nbytes: Mapping[str, int],
        now: float,
    ) -> dict[str, RD2HError]:
        reply_failures = dict(admission.refused)
        chunks = {r.ext_req_id: _chunk(r) for r in batch.read_reqs}
        member = batch.group_member_idx
        peer = self._peers.get(identity)
        stage = None if peer is None else peer.stage  # a pipeline stage's chunks are its own
        for ext_id in admission.readable:
            request = self._requests[ext_id]  # being read: it cannot have settled
            request.reading = False
            error = failed.get(ext_id)
            if error is not None:
                reply_failures[ext_id] = error
                self._fail(request, error, now)
            elif request.terminal:  # aborted or failed here while the read ran: Prefill must not say DONE
                reply_failures[ext_id] = request.error or StateError(f"request {ext_id!r} was aborted on Decode")
                request.nbytes += nbytes.get(ext_id, 0)
            else:
                request.apply(_Event.READ)
                request.nbytes += nbytes.get(ext_id, 0)
                request.coverage.record(member if stage is None else (member, stage), batch.layer_name, chunks[ext_id])
        done = batch.done_ext_ids
        repeated = Counter(done) if len(set(done)) != len(done) else None  # rare: counted only then
        for ext_id in done if repeated is None else repeated:
            request = self._requests.get(ext_id)
            if request is None or request.terminal or ext_id not in admission.readable:
                continue
            times = 1 if repeated is None else repeated[ext_id]
            error = (
                ProtocolError(f"request {ext_id!r} is named {times} times in one readiness's final signals")
                if times > 1 else self._final(request, identity, member, batch.tp_ratio)
            )  # fmt: skip
            if error is not None:
                reply_failures[ext_id] = error
                self._fail(request, error, now)
        for ext_id in admission.readable:  # an abort or failure that came during the read
            request = self._requests.get(ext_id)
            if request is not None:
                self._settle_if_idle(request, now)
        return reply_failures

    def _apply_settled(self, identity: bytes, settled: protocol.Settled, now: float) -> list[str]:
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

    def _fail_named(
        self, identity: bytes, ext_ids: Iterable[str], error: RD2HError, now: float, *, only_hit: bool = False
    ) -> dict[str, RD2HError]:
        """A message from ``identity`` naming ``ext_ids`` could not be handled: the requests
        it may announce fail with ``error`` (no read of this rank is in flight while the loop
        handles a message, so none is being written). Returns every named id (the reply names
        them all), or with ``only_hit`` only those that failed here."""
        peer = self._peers.get(identity)
        named: dict[str, RD2HError] = {}
        for ext_id in ext_ids:
            request = self._requests.get(ext_id)
            admitted = peer is not None and peer.state is _PeerState.ADMITTED
            if request is not None and admitted and not request.terminal and self._may_announce(request, peer.proven):
                request.reading = False
                self._fail(request, error, now)
            elif only_hit:
                continue
            named[ext_id] = error
        return named

    def _fail_admitted(self, admission: Admission, error: RD2HError, now: float) -> list[str]:
        """Fail what ``admission`` allowed to be read, a DONE its own read settled included
        (its reply is about to name it failed); their ids."""
        hit = []
        for ext_id in admission.readable:
            request = self._requests.get(ext_id)
            if request is not None:
                request.reading = False
                if not request.terminal:
                    request.apply(_Event.FAIL, error)
                    hit.append(ext_id)
                self._settle_if_idle(request, now)
            elif ext_id in self._book and self._book.peek(ext_id).state is TerminalState.DONE:
                done = self._book.peek(ext_id)
                self._book.replace(Outcome(ext_id, TerminalState.FAILED, error, done.nbytes, done.started, now))
                hit.append(ext_id)
        return hit

    # -- internals ----------------------------------------------------------------------

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
        self._early.note(ext_id, now, proven)  # an expect bound to another Prefill ignores it
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
        peer = self._peers.get(identity)
        stage = None if peer is None else peer.stage
        required = self._layer_names if peer is None or peer.stage_layers is None else peer.stage_layers
        gap = request.coverage.missing(member if stage is None else (member, stage), required)
        if gap is not None:
            return BlockRangeError(f"request {request.ext_id!r}: final signal, but {gap}")
        covered = request.final_layers.get(member)
        request.final_layers[member] = required if covered is None else covered | required
        if request.final_layers[member] >= self._layer_names:  # a pipeline's stages add up to the model
            request.finals.add(member)
        if peer is not None and peer.confirms:
            request.unconfirmed.add(identity)
        if len(request.finals) == ratio:
            request.apply(_Event.READ_ALL if request.unconfirmed else _Event.COMPLETE)
        return None
