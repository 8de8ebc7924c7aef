"""One readiness of an admitted Prefill peer: this rank's share planned, one batched read, one reply.

The :class:`~rd2h.decode.sink.Sink` loop hands every ``read_ready_batch`` here. The tracker
says which requests may be read; the layer's layouts are checked against the peer's, this
rank's share is planned into descriptors (moved from the step's template when the step was
seen on an earlier layer), everything is read in one ``read_batch``, the tracker records
what arrived, and exactly one READ_DONE or READ_FAILED goes back, naming each failed request.
The reply is sent under the tracker's lock, after the tracker recorded the read: no outcome
of a readiness can be collected before its reply is known to be sent.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from rd2h.decode.layer_lane import Lane, PeerLayers
from rd2h.decode.peer_limits import Oversized
from rd2h.decode.rank_reads import StepReads
from rd2h.decode.receive_tracker import Admission, ReceiveTracker
from rd2h.errors import ChannelError, LayoutError, ProtocolError, RD2HError, wire_kind
from rd2h.interfaces import Listener, Session, TransferEngine
from rd2h.layout.heads import HeadViews
from rd2h.layout.layers import LayerLayout
from rd2h.layout.planning import Int64Array, LayerPlan, RequestRead
from rd2h.layout.regions import RegionSet
from rd2h.layout.step_plans import StepPlans
from rd2h.quiet_log import quiet
from rd2h.wire import protocol

__all__ = ["AdmittedPeer", "Counters", "LayerReader", "LayerStat"]

log = logging.getLogger("rd2h.decode.sink")


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
class AdmittedPeer:
    """A Prefill peer whose ``mf_meta`` was accepted: its layouts, engine session and regions."""

    p_session: str
    layers: dict[str, LayerLayout]
    session: Session
    regions: RegionSet
    lanes: PeerLayers | None = None  # what a step's lane needs of its layers: derived at admission


@dataclass(slots=True)
class Counters:
    """What a Decode rank did, for tests, benchmarks and operators (loop thread writes)."""

    bytes_read: int = 0
    layers_read: int = 0
    lane_reads: int = 0  # layers read on a step's lane (rd2h.decode.layer_lane), not planned on their own
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


def summarize(failures: Mapping[str, RD2HError], shown: int = 4) -> str:
    """One error text for a READ_FAILED that names several requests: each with its reason."""
    parts = [f"{ext_id!r}: {error}" for ext_id, error in list(failures.items())[:shown]]
    if len(failures) > shown:
        parts.append(f"and {len(failures) - shown} more")
    return f"{len(failures)} request(s) failed: " + "; ".join(parts)


def failed_reply(layer_idx: int, failures: Mapping[str, RD2HError]) -> protocol.ReadFailed:
    kinds = {wire_kind(e) for e in failures.values()}
    kind = kinds.pop() if len(kinds) == 1 else "RD2HError"
    return protocol.ReadFailed(layer_idx, summarize(failures), tuple(failures), kind)


class LayerReader:
    """Reads layers for one Decode rank; runs on the sink's loop thread only.

    It shares with the sink the tracker and the Condition that guards it, the listener
    (replies), the engine (reads), the admitted peers (the sink adds and removes them) and
    the counters.
    """

    def __init__(
        self,
        *,
        rank: int,
        tp_size: int,
        engine: TransferEngine,
        listener: Listener,
        tracker: ReceiveTracker,
        changed: threading.Condition,
        layers: Mapping[str, LayerLayout],
        regions: RegionSet,
        peers: Mapping[bytes, AdmittedPeer],
        clock: Callable[[], float],
        counters: Counters,
        on_layer: Callable[[LayerStat], None] | None = None,
    ) -> None:
        self.rank = rank
        self._engine, self._listener = engine, listener
        self._tracker, self._changed = tracker, changed
        self._layers, self._regions, self._peers = layers, regions, peers
        self._clock = clock
        self.counters = counters
        self.on_layer = on_layer  # the sink may set it later (see Sink.on_layer)
        self._block_bytes = {name: _bytes_per_block(layout) for name, layout in layers.items()}
        self._done_frames: dict[int, bytes] = {}
        # what a step repeats on every layer is derived once per step
        self._plans = StepPlans()  # a plan is read before the next is built
        self._plans.learn(layers.values(), regions)
        # a dense GQA/MHA cache holds this rank's KV heads only: a peer of another TP size is
        # read head range by head range (rd2h.layout.heads)
        kv_heads = next((layout.heads.total for layout in layers.values() if layout.heads is not None), None)
        self._heads = HeadViews(decode_tp=tp_size, decode_rank=rank)
        self._step_reads = StepReads(
            decode_rank=rank, decode_tp=tp_size, main_split=tracker.main_split, kv_heads=kv_heads
        )
        # a step's next small layers from one peer: precomputed, admitted again in one call
        self.lanes = True  # False: every readiness takes the general path (tests compare the two)
        self._lanes: dict[bytes, Lane] = {}  # identity -> its latest step's lane

    def learn_peer(self, peer: AdmittedPeer) -> None:
        """Validate and describe a new peer's layouts now, not on the first layer of a step."""
        self._plans.learn(peer.layers.values(), peer.regions)
        self._plans.learn_pairs(
            (name, layout, self._layers[name]) for name, layout in peer.layers.items() if name in self._layers
        )
        if self.lanes:  # derived at admission, not on a step's first layer
            peer.lanes = PeerLayers(peer.layers, self._layers, peer.regions, self._regions)
        # a lane holds its peer: the lanes of peers no longer admitted (or admitted again) go
        self._lanes = {i: lane for i, lane in self._lanes.items() if self._peers.get(i) is lane.peer}

    def on_ready(self, identity: bytes, batch: protocol.ReadReadyBatch) -> None:
        lane = self._lanes.get(identity)
        if lane is not None and lane.fits(batch) and self._lane_read(lane, identity, batch):
            return
        started = time.perf_counter()
        with self._changed:
            admission = self._tracker.on_readiness(identity, batch, self._clock())
        if admission.meta_required:
            self.send(identity, protocol.ReadFailed.meta_required(batch.layer_idx))
            # not introduced: its connection is among the first shut when strangers hold too
            # many (a Prefill that introduces itself now is vouched for again on admission)
            self._listener.disown(identity)
            return
        plan: LayerPlan | None = None
        read_seconds = 0.0
        failed: dict[str, RD2HError] = {}
        nbytes: dict[str, int] = {}
        key = None
        error: Exception | None = None
        try:
            if admission.readable:
                plan, reads, failed, per_block, key = self._plan(identity, batch, admission)
            if plan is not None:
                read_seconds = self._read(identity, plan.local, plan.remote, plan.lengths, plan, failed)
                nbytes = self._step_reads.request_bytes(reads, per_block, failed)
        except Exception as exc:  # noqa: BLE001 - the admitted requests fail, never the loop
            error = exc
        failures = self._settle(identity, batch, admission, error, failed, nbytes)
        if error is None and key is not None and plan is not None and not failures and self.lanes:
            self._open_lane(identity, batch, admission, reads, plan, key)
        self._observe(
            batch.layer_idx, 0 if plan is None else plan.nbytes, 0 if plan is None else len(plan), read_seconds,
            started, len(failures),
        )  # fmt: skip

    def _observe(self, layer_idx: int, nbytes: int, descriptors: int, read_seconds: float, started: float,
                 failed: int) -> None:  # fmt: skip
        stat = LayerStat(layer_idx, nbytes, descriptors, read_seconds, time.perf_counter() - started, failed)
        self.counters.stats.append(stat)
        observe = self.on_layer  # read once: another thread may set it
        if observe is not None:
            observe(stat)

    # -- a step's lane -------------------------------------------------------------------

    def _open_lane(
        self, identity: bytes, batch: protocol.ReadReadyBatch, admission: Admission, reads: list[RequestRead],
        plan: LayerPlan, key: object,
    ) -> None:
        """After a clean read of a small layer with no final signal: the step's other layers
        precomputed, so they skip admission and planning (rd2h.decode.layer_lane)."""
        self._lanes.pop(identity, None)
        if batch.done_ext_ids or admission.refused or not batch.reqs_bytes:
            return
        peer = self._peers.get(identity)
        if peer is None or peer.lanes is None:
            return  # learnt while lanes were off
        with self._changed:
            token = self._tracker.peer_token(identity)
        lane = Lane.of(
            peer=peer, batch=batch, admission=admission, peer_token=token, reads=reads, plan=plan, table=peer.lanes,
            nbytes=plan.nbytes, key=key,
        )  # fmt: skip
        if lane is not None:
            self._lanes[identity] = lane

    def _lane_read(self, lane: Lane, identity: bytes, batch: protocol.ReadReadyBatch) -> bool:
        """The next layer of a lane's step: admitted again, read, answered. False (nothing
        done) where the general path must take it: the layer has no row, the peer was
        admitted again, or the tracker would not admit the same requests now."""
        rows = lane.descriptors(batch.layer_name)
        if rows is None or self._peers.get(identity) is not lane.peer:
            return False
        started = time.perf_counter()
        admission = lane.admission
        with self._changed:
            if not self._tracker.readmit(identity, admission, lane.peer_token):
                del self._lanes[identity]
                return False
        failed: dict[str, RD2HError] = {}
        nbytes: dict[str, int] = {}
        read_seconds = 0.0
        error: Exception | None = None
        try:
            read_seconds = self._read(identity, *rows, lane, failed)
            nbytes = self._step_reads.request_bytes(lane.reads, self._block_bytes[batch.layer_name], failed)
        except Exception as exc:  # noqa: BLE001 - as on the general path: the requests fail, never the loop
            error = exc
        failures = self._settle(identity, batch, admission, error, failed, nbytes)
        if failures:
            self._lanes.pop(identity, None)
        self.counters.lane_reads += 1
        self._observe(batch.layer_idx, lane.nbytes, len(rows[2]), read_seconds, started, len(failures))
        return True

    def _settle(
        self, identity: bytes, batch: protocol.ReadReadyBatch, admission: Admission, error: Exception | None,
        failed: dict[str, RD2HError], nbytes: dict[str, int],
    ) -> Mapping[str, RD2HError]:
        """Answer a layer's read: its admitted requests are marked read (``failed`` naming those
        whose blocks did not come), or, where the read raised ``error``, all fail: a layout
        mismatch fails the whole layer before any read, and anything unforeseen (a defect) fails
        it too, since the requests it admitted must not stay marked as read."""
        if error is not None and not isinstance(error, RD2HError):
            log.error("rank %d: layer %d could not be read", self.rank, batch.layer_idx, exc_info=error)
            error = ProtocolError(f"Decode could not read layer {batch.layer_idx}: {type(error).__name__}: {error}")
        with self._changed:
            if error is not None:
                failures = self._tracker.fail_readable(admission, error, self._clock())
            else:
                failures = self._tracker.on_read(identity, batch, admission, failed, nbytes, self._clock())
            self._answer(identity, batch, admission, failures)
        return failures

    def refuse_oversized(self, identity: bytes, over: Oversized, max_ids: int) -> None:
        """Refuse a readiness naming too many ids, per request, without decoding its ids."""
        self.counters.oversized += 1
        error = over.refusal(max_ids)
        quiet(log).warning("oversized", (self.rank, identity), "rank %d: refused %r: %s", self.rank, identity, error)
        stub = over.as_batch()
        if stub is None:  # not even its header is valid: nothing to answer
            self.counters.malformed += 1
            return
        with self._changed:
            admission = self._tracker.on_readiness(identity, stub, self._clock())
            failures = self._tracker.fail_readable(admission, error, self._clock())
            self._changed.notify_all()
        if admission.meta_required:
            self.send(identity, protocol.ReadFailed.meta_required(over.layer_idx))
        elif failures:
            self.send(identity, failed_reply(over.layer_idx, failures))
        else:  # it named no request by a valid id: the whole layer is refused
            self.send(identity, protocol.ReadFailed.from_error(over.layer_idx, error))

    def send(self, identity: bytes, message: protocol.Reply | int) -> RD2HError | None:
        """Send a reply (an int: READ_DONE for that layer); the error if it could not be sent
        (it never blocks: see the channel)."""
        try:
            self._listener.send(identity, self._done(message) if type(message) is int else protocol.encode(message))
        except Exception as exc:  # noqa: BLE001 - the peer is gone or unreachable (a channel defect too)
            quiet(log).warning(
                "reply not sent", (self.rank, identity), "rank %d: could not reply to %r: %s", self.rank, identity, exc
            )
            return exc if isinstance(exc, RD2HError) else ChannelError(f"reply not sent: {type(exc).__name__}: {exc}")
        return None

    def _done(self, layer_idx: int) -> bytes:
        """READ_DONE's frame for a layer, encoded once (a message and its checks cost ~4 us)."""
        frame = self._done_frames.get(layer_idx)
        if frame is None:
            if len(self._done_frames) >= 1 << 14:  # layer indices are a peer's: bound the cache
                self._done_frames.clear()
            frame = self._done_frames[layer_idx] = protocol.encode(protocol.ReadDone(layer_idx))
        return frame

    def _plan(
        self, identity: bytes, batch: protocol.ReadReadyBatch, admission: Admission
    ) -> tuple[LayerPlan, list[RequestRead], dict[str, RD2HError], tuple[int, int], object]:
        """This rank's reads of the readable requests, their descriptors, the requests
        that cannot be read and the bytes a block id moves; raises for a layer-wide mismatch."""
        peer = self._peers[identity]  # admitted peers have a session
        src = peer.layers.get(batch.layer_name)
        dst = self._layers.get(batch.layer_name)
        if src is None or dst is None:
            side = "Prefill" if src is None else "Decode"
            raise LayoutError(f"layer {batch.layer_name!r} unknown on {side}")
        whole = dst
        src, dst = self._heads.pair(src, dst, batch.tp_ratio, batch.group_member_idx)
        per_block = self._block_bytes[batch.layer_name] if dst is whole else _bytes_per_block(dst)
        key, reads, refused = self._step_reads.reads(identity, batch, admission.readable, admission.requests)
        plan = self._plans.build(
            key, src, dst, reads, src_regions=peer.regions, dst_regions=self._regions, layer_name=batch.layer_name
        )
        lane_key = key if dst is whole and not refused else None  # a head split or a refusal: no lane
        return plan, reads, {**refused, **plan.failed}, per_block, lane_key

    def _read(
        self, identity: bytes, local: Int64Array, remote: Int64Array, lengths: Int64Array, plan: LayerPlan | Lane,
        failed: dict[str, RD2HError],
    ) -> float:
        """Read ``plan``'s descriptors; on failure every request of ``plan`` goes into ``failed``."""
        if not len(lengths):
            return 0.0
        started = time.perf_counter()
        try:
            self._engine.read_batch(self._peers[identity].session, local, remote, lengths)
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
                quiet(log).warning(
                    "reply lost", (self.rank, identity), "rank %d: reply lost, failed %d request(s) Prefill will fail too",
                    self.rank, len(hit),
                )  # fmt: skip
        self._changed.notify_all()

    def _reply(
        self, identity: bytes, batch: protocol.ReadReadyBatch, failures: Mapping[str, RD2HError]
    ) -> RD2HError | None:
        if not failures:
            return self.send(identity, batch.layer_idx)
        quiet(log).warning(
            "layer failed", (self.rank, identity), "rank %d: layer %d failed for %d request(s): %s",
            self.rank, batch.layer_idx, len(failures), summarize(failures),
        )  # fmt: skip
        return self.send(identity, failed_reply(batch.layer_idx, failures))
