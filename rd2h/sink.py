"""Decode runtime: readiness -> validate -> one batched read -> exactly one reply.

One :class:`Sink` serves one Decode TP rank. It owns a listener (bound to the rank's
port), the engine sessions of its Prefill peers and a background thread that handles
every message. All per-request and per-peer state is in a pure
:class:`~rd2h.receiving.ReceiveTracker`; this module only moves bytes between it, the
listener and the engine:

- ``mf_meta``: version check, layer layouts decoded, an engine session opened, ACK sent;
  a refusal is remembered and sent back, with its reason, in the reply to every readiness
  of that peer.
- ``read_ready_batch``: the tracker says which requests to read; the layer is validated,
  this rank's share planned, everything read in one ``read_batch``, and one READ_DONE or
  READ_FAILED (naming each failed request) goes back.
- Between messages: request deadlines and the liveness of peers are checked.

Requests are expected with their destination block ids (:meth:`Sink.expect`) before
Prefill announces them; their outcomes are collected with :meth:`Sink.take` or
:meth:`Sink.wait`, which consume what they return.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from functools import partial
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field


from rd2h import protocol
from rd2h.clock import Clock, monotonic
from rd2h.errors import (
    ChannelError,
    LayoutError,
    PeerGoneError,
    ProtocolError,
    RD2HError,
    WaitTimeout,
    wire_kind,
)
from rd2h.admission import Admissions, Handshake
from rd2h.interfaces import Capability, Listener, Session, TransferEngine
from rd2h.layout import LayerLayout
from rd2h.plan_cache import StepPlans
from rd2h.planning import LayerPlan, RequestRead
from rd2h.outcome import Outcome
from rd2h.peer_limits import Oversized, PeerBook, PeerLimits, oversized_readiness
from rd2h.readiness import ReadinessDecoder
from rd2h.receiving import Admission, ReceiveTracker
from rd2h.shares import Destinations, MainSplit, StepReads
from rd2h.regions import RegionSet, merge_by_device

__all__ = ["Destinations", "LayerStat", "MainSplit", "Sink"]

log = logging.getLogger("rd2h.sink")
_SLOW_SECONDS = 1.0  # a message that holds the loop longer is logged: the other peers waited
_ADMISSION_POLL = 0.002  # how often the loop looks at handshakes in progress


@dataclass(frozen=True, slots=True)
class LayerStat:
    """One handled readiness: what was read and how long it took."""

    layer_idx: int
    nbytes: int
    descriptors: int
    read_seconds: float
    handle_seconds: float
    failed: int


@dataclass(slots=True)
class _Peer:
    p_session: str
    layers: dict[str, LayerLayout]
    session: Session
    regions: RegionSet


@dataclass(slots=True)
class _Counters:
    bytes_read: int = 0
    layers_read: int = 0
    malformed: int = 0
    oversized: int = 0  # readiness refused for naming too many block ids
    peers_dropped: int = 0  # peers forgotten: over a cap, or idle
    read_seconds: float = 0.0
    stats: deque[LayerStat] = field(default_factory=lambda: deque(maxlen=1 << 16))  # the latest layers


def _bytes_per_block(layout: LayerLayout) -> tuple[int, int]:
    """Bytes one main block id and one indexer block id move on this layer."""
    main = sum(t.block_len * t.block_size_scale for t in layout.main)
    extra = sum(t.block_len * t.block_size_scale for t in (layout.indexer, layout.scale) if t is not None)
    return main, extra


def _summarize(failures: Mapping[str, RD2HError], shown: int = 4) -> str:
    """One error text for a READ_FAILED that names several requests: each with its reason."""
    parts = [f"{ext_id!r}: {error}" for ext_id, error in list(failures.items())[:shown]]
    if len(failures) > shown:
        parts.append(f"and {len(failures) - shown} more")
    return f"{len(failures)} request(s) failed: " + "; ".join(parts)


def _failed_reply(layer_idx: int, failures: Mapping[str, RD2HError]) -> protocol.ReadFailed:
    kinds = {wire_kind(e) for e in failures.values()}
    kind = kinds.pop() if len(kinds) == 1 else "RD2HError"
    return protocol.ReadFailed(layer_idx, _summarize(failures), tuple(failures), kind)


class Sink:
    """The Decode runtime of one TP rank. Start it, ``expect`` requests, collect outcomes.

    ``layers`` maps layer names to this rank's destination layouts; their tensors are
    registered with ``engine`` as destinations. ``main_split`` says how the Decode ranks
    share main K/V (``shared``: one pool, disjoint shares; ``replicated``: a full copy per
    rank). ``request_timeout`` is the default deadline of an expected request (None: none).
    ``peer_limits`` bounds what peers may cost: entries in all and per Prefill process, idle
    time, block ids per readiness (:class:`~rd2h.peer_limits.PeerLimits`).
    The engine, listener and thread belong to the sink: ``close()`` stops and closes them.
    """

    def __init__(
        self,
        *,
        rank: int,
        tp_size: int,
        engine: TransferEngine,
        listener: Listener,
        layers: Mapping[str, LayerLayout],
        accept_legacy: bool = False,
        main_split: MainSplit | str = MainSplit.SHARED,
        request_timeout: float | None = 300.0,
        clock: Clock = monotonic,
        poll_seconds: float = 0.1,
        liveness_seconds: float = 0.5,
        on_layer: Callable[[LayerStat], None] | None = None,
        peer_limits: PeerLimits | None = None,
    ) -> None:
        self._tracker = ReceiveTracker(
            layers, decode_rank=rank, decode_tp=tp_size, main_split=main_split, request_timeout=request_timeout
        )
        self.rank, self.tp_size = rank, tp_size
        self._engine, self._listener = engine, listener
        self._layers = dict(layers)
        self._block_bytes = {name: _bytes_per_block(layout) for name, layout in self._layers.items()}
        regions = [r for layout in self._layers.values() for r in layout.regions()]
        self._regions = RegionSet(regions)  # every destination: no write lands outside it
        self._engine.register(merge_by_device(regions))
        self._accept_legacy = accept_legacy
        self._clock = clock
        self._poll = poll_seconds
        self._liveness = liveness_seconds
        self._on_layer = on_layer
        self._peers: dict[bytes, _Peer] = {}  # loop thread only
        # handshakes run off the loop when the engine allows it (rd2h.admission)
        self._concurrent_connect = bool(getattr(engine, "capabilities", Capability.NONE) & Capability.CONCURRENT_CONNECT)
        self._admissions = Admissions(rank)
        self._book = PeerBook(peer_limits or PeerLimits())  # loop thread only; caps and idle peers
        # loop thread only: what a step repeats on every layer is derived once per step
        self._decoder = ReadinessDecoder()
        self._plans = StepPlans()  # a plan is read before the next is built
        self._plans.learn(self._layers.values(), self._regions)
        self._step_reads = StepReads(decode_rank=rank, decode_tp=tp_size, main_split=self._tracker.main_split)
        self._changed = threading.Condition()  # guards the tracker (user threads vs the loop)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.counters = _Counters()

    # -- user side -----------------------------------------------------------------------

    @property
    def address(self) -> str:
        return self._listener.address

    @property
    def main_split(self) -> MainSplit:
        return self._tracker.main_split

    def start(self) -> Sink:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"rd2h-sink-{self.rank}", daemon=True)
            self._thread.start()
        return self

    def expect(
        self,
        ext_id: str,
        main_blocks: Sequence[int],
        indexer_blocks: Sequence[int] | None = None,
        *,
        first_block: int = 0,
        indexer_first_block: int | None = None,
        deadline: float | None = None,
        prefill: str | None = None,
    ) -> None:
        """``ext_id`` lands in these destination blocks (in prompt order; the indexer's default
        to the main ones). Prefill sends positions ``first_block`` on (blocks before it are a
        prefix this rank has cached); ``deadline`` is seconds from now after which the request
        fails with DeadlineExceeded (default: the sink's ``request_timeout``). ``prefill``: the
        identity of the one Prefill that may announce it, as the rendezvous names it (its
        engine session id or its CURVE public key); another peer's readiness naming it is
        refused and leaves it untouched (docs/security.md). None: any admitted peer.

        Raises DuplicateRequestError for an id that is live or not yet collected,
        DestinationError for a block repeated, out of range or held by a live request.
        """
        destinations = Destinations.of(main_blocks, indexer_blocks)
        with self._changed:
            self._tracker.expect(
                ext_id, destinations, self._clock(),
                first_block=first_block, indexer_first_block=indexer_first_block, deadline=deadline,
                expected_peer=prefill,
            )
            self._changed.notify_all()  # an early readiness may have failed it at once

    def abort(self, ext_id: str) -> bool:
        """Stop writing into ``ext_id``'s destinations; it is still reported, ABORTED.

        Returns once no read into them is in flight, so the blocks may be reused at once.
        False (and nothing reported) for an id not live on this rank.
        """
        with self._changed:
            found = self._tracker.abort(ext_id, self._clock())
            self._await_idle(ext_id)
            return found

    def fail(self, ext_id: str, error: RD2HError) -> bool:
        """Fail ``ext_id`` with ``error``; like :meth:`abort`, returns once no read writes it."""
        with self._changed:
            found = self._tracker.fail(ext_id, error, self._clock())
            self._await_idle(ext_id)
            return found

    def take(self) -> dict[str, Outcome]:
        """Every outcome settled on this rank since the last call (consumed)."""
        with self._changed:
            return self._tracker.take()

    def wait(self, ext_ids: Sequence[str], timeout: float) -> dict[str, Outcome]:
        """Block until every request in ``ext_ids`` settled on this rank; their outcomes
        (consumed). Raises WaitTimeout (a TimeoutError) naming those still pending, and
        consumes nothing then; UnknownRequestError for an id never expected."""
        until = time.monotonic() + timeout
        with self._changed:
            while True:
                outcomes = self._tracker.collect(ext_ids)
                if outcomes is not None:
                    return outcomes
                remaining = until - time.monotonic()
                if remaining <= 0:
                    pending = self._tracker.pending(ext_ids)
                    raise WaitTimeout(f"Decode rank {self.rank}: {pending[:5]} still pending after {timeout:.1f}s")
                self._changed.wait(remaining)

    def wait_any(self, timeout: float) -> bool:
        """Block until some outcome is settled and not taken, ``timeout`` seconds at most;
        whether one is. Consumes nothing."""
        with self._changed:
            return self._changed.wait_for(lambda: self._tracker.settled() > 0, timeout)

    def close(self) -> None:
        """Stop the loop, fail what is still live, close the sessions, listener and engine.
        Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self._poll + 60.0)  # one message in hand: a read is bounded by the engine
            if self._thread.is_alive():
                log.error("rank %d: loop did not stop; closing under it", self.rank)
            self._thread = None
        with self._changed:
            for ext_id in self._tracker.live():
                self._tracker.fail(ext_id, RD2HError(f"Decode rank {self.rank} closed"), self._clock())
            self._changed.notify_all()
        self._admissions.close()
        for peer in self._peers.values():
            peer.session.close()
        self._peers.clear()
        self._listener.close()
        self._engine.close()

    def __enter__(self) -> Sink:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _await_idle(self, ext_id: str) -> None:
        self._changed.notify_all()
        while self._tracker.reading(ext_id):  # bounded: the engine bounds every read
            self._changed.wait(1.0)

    # -- loop ----------------------------------------------------------------------------

    def _run(self) -> None:
        next_check = 0.0
        while not self._stop.is_set():
            # while a handshake runs, look at it often: the peer's readiness waits for it
            item = self._listener.recv(_ADMISSION_POLL if self._admissions else self._poll)
            try:
                if self._admissions:
                    self._finish_handshakes()
                if item is not None:
                    started = time.monotonic()
                    self._handle(*item)
                    took = time.monotonic() - started
                    if took > _SLOW_SECONDS:  # every other peer waited this long
                        log.warning("rank %d: one message from %r held the loop %.1f s", self.rank, item[0], took)
                with self._changed:
                    if self._tracker.expire(self._clock()):
                        self._changed.notify_all()
                if time.monotonic() >= next_check:  # a cadence, not a timeout: real time
                    next_check = time.monotonic() + self._liveness
                    self._check_peers()
            except Exception:  # one bad message must never kill the rank's loop
                log.exception("rank %d: unexpected error in the loop", self.rank)

    def _handle(self, identity: bytes, frame: bytes) -> None:
        self._book.seen(identity, self._clock())
        if identity in self._admissions:  # handled in order once its handshake ends
            self._admissions.hold(identity, frame)
            return
        over = oversized_readiness(frame, self._book.limits.max_ids_per_message)
        if over is not None:  # refused before decoding: decoding costs ~28 bytes per id
            self._refuse_oversized(identity, over)
            return
        try:
            message = self._decoder.decode(frame)
        except ProtocolError as exc:
            self.counters.malformed += 1
            log.warning("rank %d: dropped a malformed message from %r: %s", self.rank, identity, exc)
            return
        if isinstance(message, protocol.MfMeta):
            self._on_meta(identity, message)
        elif isinstance(message, protocol.Settled):
            with self._changed:
                if self._tracker.on_settled(identity, message, self._clock()):
                    self._changed.notify_all()
        else:
            self._on_ready(identity, message)

    def _on_meta(self, identity: bytes, meta: protocol.MfMeta) -> None:
        old = self._peers.pop(identity, None)
        if old is not None:
            old.session.close()
        started = time.monotonic()
        try:
            protocol.check_compatible(meta, accept_legacy=self._accept_legacy)
            layers = meta.layers()
            if meta.legacy:  # a reference-shaped peer: only its session id to go on
                session = self._engine.connect_legacy(meta.p_session)
            elif self._concurrent_connect:
                connect = partial(self._engine.connect, meta.engine_metadata)
                if not self._admissions.start(identity, meta, layers, connect):
                    raise ChannelError("too many handshakes in progress on this Decode rank; introduce yourself again later")
                return
            else:
                session = self._engine.connect(meta.engine_metadata)
        except RD2HError as exc:
            self._refuse(identity, meta, exc)
            return
        took = time.monotonic() - started
        if took > _SLOW_SECONDS:
            log.warning("rank %d: connecting to Prefill %s took %.1f s", self.rank, meta.p_session[:80], took)
        self._admit(identity, meta, layers, session)

    def _finish_handshakes(self) -> None:
        for identity, handshake in self._admissions.finished():
            self._finish_handshake(identity, handshake)

    def _finish_handshake(self, identity: bytes, handshake: Handshake) -> None:
        result = handshake.result()
        if isinstance(result, RD2HError):
            self._refuse(identity, handshake.meta, result)
        else:
            self._admit(identity, handshake.meta, handshake.layers, result)
        for frame in handshake.held:  # in the order they came; another mf_meta holds the rest again
            self._handle(identity, frame)

    def _refuse(self, identity: bytes, meta: protocol.MfMeta, exc: RD2HError) -> None:
        # No ACK: every readiness of this peer is answered with this reason instead.
        log.error("rank %d: refused mf_meta from %s: %s", self.rank, meta.p_session[:80], exc)
        with self._changed:
            self._tracker.peer_refused(identity, meta.p_session, exc)
        self._forget_all(self._book.admit(identity, None, self._clock(), self._announcing))

    def _admit(self, identity: bytes, meta: protocol.MfMeta, layers: dict[str, LayerLayout], session: Session) -> None:
        peer = self._peers[identity] = _Peer(meta.p_session, layers, session, RegionSet(session.peer_regions))
        # now, not on the first layer of a step
        self._plans.learn(layers.values(), peer.regions)
        self._plans.learn_pairs((name, layout, self._layers[name]) for name, layout in layers.items() if name in self._layers)
        # What the peer proved: the engine's peer id (proven by a PROVES_PEER engine, else as
        # declared) and the channel's authenticated key, if any.
        key = self._listener.peer_key(identity)
        proven = [session.peer_id] if key is None else [session.peer_id, key]
        with self._changed:
            self._tracker.peer_admitted(identity, meta.p_session, proven, confirms=not meta.legacy)
        self._forget_all(self._book.admit(identity, session.peer_id, self._clock(), self._announcing))
        try:
            self._listener.send(identity, protocol.ACK_FRAME)
        except RD2HError as exc:
            log.warning("rank %d: could not acknowledge %r: %s", self.rank, identity, exc)

    def _on_ready(self, identity: bytes, batch: protocol.ReadReadyBatch) -> None:
        started = time.perf_counter()
        with self._changed:
            admission = self._tracker.on_readiness(identity, batch, self._clock())
        if admission.meta_required:
            self._send(identity, protocol.ReadFailed.meta_required(batch.layer_idx))
            return
        plan: LayerPlan | None = None
        read_seconds = 0.0
        failed: dict[str, RD2HError] = {}
        nbytes: dict[str, int] = {}
        try:
            if admission.readable:
                plan, reads, failed = self._plan(identity, batch, admission)
        except RD2HError as exc:  # a layout mismatch fails the whole layer before any read
            with self._changed:
                failures = self._tracker.fail_readable(admission, exc, self._clock())
                self._answer(identity, batch, admission, failures)
        else:
            if plan is not None:
                read_seconds = self._read(identity, plan, failed)
                nbytes = self._step_reads.request_bytes(reads, self._block_bytes[batch.layer_name], failed)
            with self._changed:
                failures = self._tracker.on_read(identity, batch, admission, failed, nbytes, self._clock())
                self._answer(identity, batch, admission, failures)
        stat = LayerStat(
            batch.layer_idx, 0 if plan is None else plan.nbytes, 0 if plan is None else len(plan),
            read_seconds, time.perf_counter() - started, len(failures),
        )
        self.counters.stats.append(stat)
        if self._on_layer is not None:
            self._on_layer(stat)

    def _plan(
        self, identity: bytes, batch: protocol.ReadReadyBatch, admission: Admission
    ) -> tuple[LayerPlan, list[RequestRead], dict[str, RD2HError]]:
        """This rank's reads of the readable requests, their descriptors and the requests
        that cannot be read; raises for a layer-wide mismatch."""
        peer = self._peers[identity]  # admitted peers have a session
        src = peer.layers.get(batch.layer_name)
        dst = self._layers.get(batch.layer_name)
        if src is None or dst is None:
            side = "Prefill" if src is None else "Decode"
            raise LayoutError(f"layer {batch.layer_name!r} unknown on {side}")
        key, reads, refused = self._step_reads.reads(identity, batch, admission.readable, admission.requests)
        plan = self._plans.build(
            key, src, dst, reads, src_regions=peer.regions, dst_regions=self._regions, layer_name=batch.layer_name
        )
        return plan, reads, {**refused, **plan.failed}

    def _read(self, identity: bytes, plan: LayerPlan, failed: dict[str, RD2HError]) -> float:
        if not len(plan):
            return 0.0
        started = time.perf_counter()
        try:
            self._engine.read_batch(self._peers[identity].session, plan.local, plan.remote, plan.lengths)
        except RD2HError as exc:
            failed.update({e: exc for e in plan.requests})
            return time.perf_counter() - started
        seconds = time.perf_counter() - started
        self.counters.bytes_read += plan.nbytes
        self.counters.layers_read += 1
        self.counters.read_seconds += seconds
        return seconds

    def _answer(
        self, identity: bytes, batch: protocol.ReadReadyBatch, admission: Admission, failures: Mapping[str, RD2HError]
    ) -> None:
        """Reply (under the tracker's lock, so no outcome of this readiness is collected
        before its reply is known to be sent); a reply that cannot be sent fails on Decode
        what Prefill will fail for want of it, so the two sides agree."""
        lost = self._reply(identity, batch, failures)
        if lost is not None:
            hit = self._tracker.reply_lost(admission, lost, self._clock())
            if hit:
                log.warning("rank %d: reply lost, failed %d request(s) Prefill will fail too", self.rank, len(hit))
        self._changed.notify_all()

    def _reply(
        self, identity: bytes, batch: protocol.ReadReadyBatch, failures: Mapping[str, RD2HError]
    ) -> RD2HError | None:
        if not failures:
            return self._send(identity, protocol.ReadDone(batch.layer_idx))
        log.warning(
            "rank %d: layer %d failed for %d request(s): %s",
            self.rank, batch.layer_idx, len(failures), _summarize(failures),
        )
        return self._send(identity, _failed_reply(batch.layer_idx, failures))

    def _send(self, identity: bytes, message: protocol.Reply) -> RD2HError | None:
        """Send a reply; the error if it could not be sent (it never blocks: see the channel)."""
        try:
            self._listener.send(identity, protocol.encode(message))
        except RD2HError as exc:  # the peer is gone or unreachable
            log.warning("rank %d: could not reply to %r: %s", self.rank, identity, exc)
            return exc
        return None

    def _announcing(self, identity: bytes) -> bool:
        with self._changed:
            return self._tracker.announcing(identity)

    def _forget_all(self, identities: Sequence[bytes], why: str = "more peers than the limits allow") -> None:
        """Forget peers (their sessions and fds); what they announced and is live fails."""
        for identity in identities:
            self.counters.peers_dropped += 1
            peer = self._peers.pop(identity, None)
            if peer is not None:
                peer.session.close()
            self._book.forget(identity)
            with self._changed:
                hit = self._tracker.peer_gone(identity, PeerGoneError(f"Prefill peer dropped by Decode: {why}"), self._clock())
                self._changed.notify_all()
            log.warning("rank %d: dropped peer %r (%s); failed %d request(s)", self.rank, identity, why, len(hit))

    def _refuse_oversized(self, identity: bytes, over: Oversized) -> None:
        """Refuse a readiness naming too many ids, per request, without decoding its ids."""
        self.counters.oversized += 1
        error = over.refusal(self._book.limits.max_ids_per_message)
        log.warning("rank %d: refused %r: %s", self.rank, identity, error)
        stub = over.as_batch()
        if stub is None:  # not even its header is valid: nothing to answer
            self.counters.malformed += 1
            return
        with self._changed:
            admission = self._tracker.on_readiness(identity, stub, self._clock())
            failures = self._tracker.fail_readable(admission, error, self._clock())
            self._changed.notify_all()
        if admission.meta_required:
            self._send(identity, protocol.ReadFailed.meta_required(over.layer_idx))
        elif failures:
            self._send(identity, _failed_reply(over.layer_idx, failures))
        else:  # it named no request by a valid id: the whole layer is refused
            self._send(identity, protocol.ReadFailed.from_error(over.layer_idx, error))

    def _check_peers(self) -> None:
        """Fail what a dead Prefill announced, and forget the peer (its session, its fds)."""
        for identity, peer in list(self._peers.items()):
            if not peer.session.peer_exited():
                continue
            error = PeerGoneError(f"Prefill {peer.p_session[:80]} exited before sending everything")
            with self._changed:
                hit = self._tracker.peer_gone(identity, error, self._clock())
                self._changed.notify_all()
            log.warning("rank %d: Prefill %s exited; failed %d request(s)", self.rank, peer.p_session[:80], len(hit))
            peer.session.close()
            del self._peers[identity]
            self._book.forget(identity)
        self._forget_all(self._book.idle(self._clock(), self._announcing), "idle")
