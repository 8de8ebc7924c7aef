"""Decode runtime: readiness -> validate -> one batched read -> exactly one reply.

One :class:`Sink` serves one Decode TP rank. It owns a listener (bound to the rank's
port), the engine sessions of its Prefill peers and a background thread that handles
every message. All per-request and per-peer state is in a pure
:class:`~rd2h.decode.receive_tracker.ReceiveTracker`; this module only moves bytes
between it, the listener and the engine:

- ``mf_meta``: version check, layer layouts decoded, an engine session opened, ACK sent;
  a refusal is remembered and sent back, with its reason, in the reply to every readiness
  of that peer.
- ``read_ready_batch``: handed to the :class:`~rd2h.decode.layer_read.LayerReader`: the
  tracker says which requests to read; the layer is validated, this rank's share planned,
  everything read in one ``read_batch``, and one READ_DONE or READ_FAILED (naming each
  failed request) goes back.
- Between messages: request deadlines and the liveness of peers are checked.

Requests are expected with their destination block ids (:meth:`Sink.expect`) before
Prefill announces them; their outcomes are collected with :meth:`Sink.take` or
:meth:`Sink.wait`, which consume what they return.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial

from rd2h import quiet_log
from rd2h.clock import Clock, monotonic
from rd2h.decode.admission import Admissions, Handshake, bare
from rd2h.decode.layer_read import AdmittedPeer, Counters, LayerReader, LayerStat
from rd2h.decode.peer_limits import PeerBook, PeerLimits, oversized_readiness, oversized_settled
from rd2h.decode.rank_reads import Destinations, MainSplit
from rd2h.decode.receive_tracker import ReceiveTracker
from rd2h.engine_support import check_peer_kinds
from rd2h.errors import ChannelError, PeerGoneError, ProtocolError, RD2HError, WaitTimeout
from rd2h.interfaces import Capability, Listener, Session, TransferEngine
from rd2h.layout.layers import LayerLayout
from rd2h.layout.regions import RegionSet, merge_by_device
from rd2h.outcome import Outcome
from rd2h.quiet_log import quiet
from rd2h.wire import protocol
from rd2h.wire.readiness_decoder import ReadinessDecoder

__all__ = ["Destinations", "LayerStat", "MainSplit", "Sink"]

log = logging.getLogger("rd2h.decode.sink")
_SLOW_SECONDS = 1.0  # a message that holds the loop longer is logged: the other peers waited
_ADMISSION_POLL = 0.002  # how often the loop looks at handshakes in progress


class Sink:
    """The Decode runtime of one TP rank. Start it, ``expect`` requests, collect outcomes.

    ``layers`` maps layer names to this rank's destination layouts; their tensors are
    registered with ``engine`` as destinations. ``main_split`` says how the Decode ranks
    share main K/V (``shared``: one pool, disjoint shares; ``replicated``: a full copy per
    rank). ``request_timeout`` is the default deadline of an expected request (None: none).
    ``peer_limits`` bounds what peers may cost: entries in all and per Prefill process, idle
    time, block ids per readiness (:class:`~rd2h.decode.peer_limits.PeerLimits`).
    ``on_layer`` and ``on_handshake`` are called on the loop thread with each handled
    readiness's :class:`LayerStat` and each handshake's seconds (from a peer's ``mf_meta`` to
    its admission or refusal); both may be set after construction. They must not block.
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
        on_handshake: Callable[[float], None] | None = None,
    ) -> None:
        self._tracker = ReceiveTracker(
            layers, decode_rank=rank, decode_tp=tp_size, main_split=main_split, request_timeout=request_timeout
        )
        self.rank, self.tp_size = rank, tp_size
        self._engine, self._listener = engine, listener
        self._layers = dict(layers)
        regions = [r for layout in self._layers.values() for r in layout.regions()]
        self._regions = RegionSet(regions)  # every destination: no write lands outside it
        self._engine.register(merge_by_device(regions))
        self._accept_legacy = accept_legacy
        self._clock = clock
        self._poll = poll_seconds
        self._liveness = liveness_seconds
        self._peers: dict[bytes, AdmittedPeer] = {}  # loop thread only
        # handshakes run off the loop when the engine allows it (rd2h.decode.admission)
        self._concurrent_connect = bool(getattr(engine, "capabilities", Capability.NONE) & Capability.CONCURRENT_CONNECT)
        self._admissions = Admissions(rank)
        self._book = PeerBook(peer_limits or PeerLimits())  # loop thread only; caps and idle peers
        self._decoder = ReadinessDecoder()  # loop thread only: a step's ids decoded once
        self._changed = threading.Condition()  # guards the tracker (user threads vs the loop)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.counters = Counters()
        self.on_handshake = on_handshake
        self._reader = LayerReader(
            rank=rank, tp_size=tp_size, engine=engine, listener=listener, tracker=self._tracker,
            changed=self._changed, layers=self._layers, regions=self._regions, peers=self._peers,
            clock=clock, counters=self.counters, on_layer=on_layer,
        )  # fmt: skip

    # -- user side -----------------------------------------------------------------------

    @property
    def address(self) -> str:
        return self._listener.address

    @property
    def main_split(self) -> MainSplit:
        return self._tracker.main_split

    @property
    def on_layer(self) -> Callable[[LayerStat], None] | None:
        return self._reader.on_layer

    @on_layer.setter
    def on_layer(self, observe: Callable[[LayerStat], None] | None) -> None:
        self._reader.on_layer = observe

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
        """Stop writing into ``ext_id``'s destinations. Returns at once (it never waits for a
        read: the vLLM worker calls it on the forward path).

        True if ``ext_id`` is live on this rank; it is then reported once, through
        :meth:`take`/:meth:`wait`: ABORTED once no read is writing its destinations (a read
        in flight ends first, and its reply tells Prefill the request failed). Once its final
        layer was answered READ_DONE, Prefill reports it DONE on the strength of that reply:
        the abort then changes nothing and the request is reported as Prefill confirms it
        (DONE, or FAILED), so both sides agree. Its destination blocks stay held until its
        outcome is settled: reuse them, or ``expect`` them for another request, only after
        collecting it (an ``expect`` before raises DestinationError, "held by live request").
        False, and nothing reported, for an id not live on this rank.
        """
        with self._changed:
            found = self._tracker.abort(ext_id, self._clock())
            self._changed.notify_all()
            return found

    def fail(self, ext_id: str, error: RD2HError) -> bool:
        """Fail ``ext_id`` with ``error``; returns at once. Like :meth:`abort`, the outcome
        (FAILED) is settled, and the blocks released, once no read writes them; unlike it, a
        request whose final layer was answered fails too (Decode FAILED, Prefill DONE: the
        caller chose to discard bytes that did arrive). False for an id not live here."""
        with self._changed:
            found = self._tracker.fail(ext_id, error, self._clock())
            self._changed.notify_all()
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
                        quiet(log).warning(
                            "slow message", (self.rank, item[0]), "rank %d: one message from %r held the loop %.1f s",
                            self.rank, item[0], took,
                        )  # fmt: skip
                with self._changed:
                    if self._tracker.expire(self._clock()):
                        self._changed.notify_all()
                if time.monotonic() >= next_check:  # a cadence, not a timeout: real time
                    next_check = time.monotonic() + self._liveness
                    self._check_peers()
                    quiet_log.flush_shared()  # counts of a flood that ended: written, not kept for ever
            except Exception:  # one bad message must never kill the rank's loop
                log.exception("rank %d: unexpected error in the loop", self.rank)

    def _handle(self, identity: bytes, frame: bytes) -> None:
        self._book.seen(identity, self._clock())
        if identity in self._admissions:  # handled in order once its handshake ends
            self._admissions.hold(identity, frame)
            return
        over = oversized_readiness(frame, self._book.limits.max_ids_per_message)
        if over is not None:  # refused before decoding: decoding costs ~28 bytes per id
            self._reader.refuse_oversized(identity, over, self._book.limits.max_ids_per_message)
            return
        settled_ids = oversized_settled(frame, self._book.limits.max_ids_per_message)
        if settled_ids is not None:  # the same cap on every message; never answered, so dropped
            self.counters.oversized += 1
            quiet(log).warning(
                "oversized", (self.rank, identity), "rank %d: dropped a settled from %r naming %d ids, above "
                "max_ids_per_message=%d", self.rank, identity, settled_ids, self._book.limits.max_ids_per_message,
            )  # fmt: skip
            return
        try:
            message = self._decoder.decode(frame)
        except ProtocolError as exc:
            self.counters.malformed += 1
            quiet(log).warning(
                "malformed", (self.rank, identity), "rank %d: dropped a malformed message from %r: %s",
                self.rank, identity, exc,
            )  # fmt: skip
            if identity not in self._peers:  # a stranger's garbage: its connection goes first
                self._listener.disown(identity)
            return
        if isinstance(message, protocol.MfMeta):
            self._on_meta(identity, message)
        elif isinstance(message, protocol.Settled):
            with self._changed:
                if self._tracker.on_settled(identity, message, self._clock()):
                    self._changed.notify_all()
        else:
            self._reader.on_ready(identity, message)

    def _on_meta(self, identity: bytes, meta: protocol.MfMeta) -> None:
        old = self._peers.pop(identity, None)
        if old is not None:
            old.session.close()
        started = time.monotonic()
        try:
            protocol.check_compatible(meta, accept_legacy=self._accept_legacy)
            layers = meta.layers()
            check_peer_kinds(self._engine, layers)  # memory this engine cannot read: refused now
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
            self._handshake_ended(started)
            return
        took = time.monotonic() - started
        if took > _SLOW_SECONDS:
            quiet(log).warning(
                "slow handshake", (self.rank, identity), "rank %d: connecting to Prefill %s took %.1f s",
                self.rank, meta.p_session[:80], took,
            )  # fmt: skip
        self._admit(identity, meta, layers, session)
        self._handshake_ended(started)

    def _handshake_ended(self, started: float) -> None:
        observe = self.on_handshake
        if observe is not None:
            observe(time.monotonic() - started)

    def _finish_handshakes(self) -> None:
        finished = self._admissions.finished()
        while finished:  # popped: a handled handshake's frames are freed before memory is given back
            self._finish_handshake(*finished.pop(0))
        self._admissions.give_back()

    def _finish_handshake(self, identity: bytes, handshake: Handshake) -> None:
        result = handshake.result()
        if isinstance(result, RD2HError):
            self._refuse(identity, handshake.meta, result)
        else:
            self._admit(identity, handshake.meta, handshake.layers, result)
        self._handshake_ended(handshake.started)
        if handshake.dropped:
            quiet(log).warning(
                "held frames dropped", (self.rank, identity), "rank %d: %d frame(s) of %r dropped while its "
                "handshake ran (beyond its share of what handshakes may hold)", self.rank, handshake.dropped, identity,
            )  # fmt: skip
        held, handshake.held = handshake.held, []  # nothing keeps them once handled
        while held:  # in the order they came; another mf_meta holds the rest again
            self._handle(identity, held.pop(0))

    def _refuse(self, identity: bytes, meta: protocol.MfMeta, exc: RD2HError) -> None:
        # No ACK: every readiness of this peer is answered with this reason instead.
        quiet(log).error(
            "refused mf_meta", (self.rank, identity), "rank %d: refused mf_meta from %s: %s",
            self.rank, meta.p_session[:80], exc,
        )  # fmt: skip
        with self._changed:  # kept bare: a traceback would keep the refused peer's frames alive
            self._tracker.peer_refused(identity, meta.p_session[:256], bare(exc))  # kept: bounded
        self._listener.disown(identity)  # its connection goes first when strangers hold too many
        self._forget_all(self._book.admit(identity, None, self._clock(), self._announcing))

    def _admit(self, identity: bytes, meta: protocol.MfMeta, layers: dict[str, LayerLayout], session: Session) -> None:
        peer = self._peers[identity] = AdmittedPeer(meta.p_session, layers, session, RegionSet(session.peer_regions))
        self._reader.learn_peer(peer)
        # What the peer proved: the engine's peer id (proven by a PROVES_PEER engine, else as
        # declared) and the channel's authenticated key, if any.
        key = self._listener.peer_key(identity)
        proven = [session.peer_id] if key is None else [session.peer_id, key]
        with self._changed:
            stage = meta.pp_rank if meta.pp_size > 1 else None  # a pipeline stage sends its own layers only
            self._tracker.peer_admitted(identity, meta.p_session, proven, confirms=not meta.legacy, stage=stage,
                                        stage_layers=layers)  # fmt: skip
        self._listener.vouch(identity)  # the channel never closes an admitted peer's connection
        self._forget_all(self._book.admit(identity, session.peer_id, self._clock(), self._announcing))
        try:
            self._listener.send(identity, protocol.ACK_FRAME)
        except RD2HError as exc:
            quiet(log).warning(
                "ack not sent", (self.rank, identity), "rank %d: could not acknowledge %r: %s", self.rank, identity, exc
            )

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
            self._listener.disown(identity)
            with self._changed:
                hit = self._tracker.peer_gone(identity, PeerGoneError(f"Prefill peer dropped by Decode: {why}"), self._clock())
                self._changed.notify_all()
            quiet(log).warning(  # per reason: a flood of identities is one line per interval, with its count
                "dropped peer", (self.rank, why), "rank %d: dropped peer %r (%s); failed %d request(s)",
                self.rank, identity, why, len(hit),
            )  # fmt: skip

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
            self._listener.disown(identity)
        self._forget_all(self._book.idle(self._clock(), self._announcing), "idle")
