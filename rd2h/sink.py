"""Decode runtime: readiness -> validate -> one batched read -> exactly one reply.

One :class:`Sink` serves one Decode TP rank. It owns a listener (bound to the rank's
port) and a background thread that handles every message from every Prefill peer:

- ``mf_meta``: version check, layer layouts decoded, an engine session opened, ACK sent.
- ``read_ready_batch``: the layer is validated, this rank's share of every request is
  worked out (:func:`plan_reads`), all of them are read in one ``read_batch``, and one
  READ_DONE or READ_FAILED goes back. A request that cannot be read fails alone.

Requests are expected with their destination block ids before Prefill announces them
(:meth:`Sink.expect`); their terminal states are taken with :meth:`Sink.take_terminal`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from rd2h import protocol
from rd2h.coverage import CoverageTracker
from rd2h.errors import BlockRangeError, ProtocolError, RD2HError, StateError
from rd2h.interfaces import Listener, Session, TransferEngine
from rd2h.layout import LayerLayout
from rd2h.planning import LayerPlan, PlanBuilder, RequestRead
from rd2h.regions import RegionSet, merge_by_device
from rd2h.topology import indexer_share, main_share
from rd2h.tracking import (
    ContributorTracker,
    RequestState,
    RequestTracker,
    TerminalState,
)

__all__ = ["Destinations", "LayerStat", "Sink", "plan_reads"]

log = logging.getLogger("rd2h.sink")

@dataclass(frozen=True, slots=True)
class Destinations:
    """Where one request lands on this Decode rank: its main and indexer block ids."""

    main: np.ndarray
    indexer: np.ndarray

    @classmethod
    def of(cls, main: Sequence[int], indexer: Sequence[int] | None = None) -> Destinations:
        main_ids = np.asarray(main, dtype=np.int64).reshape(-1)
        index_ids = main_ids if indexer is None else np.asarray(indexer, dtype=np.int64).reshape(-1)
        return cls(main_ids, index_ids)


@dataclass(frozen=True, slots=True)
class LayerStat:
    """One handled readiness: what was read and how long it took."""

    layer_idx: int
    nbytes: int
    descriptors: int
    read_seconds: float
    handle_seconds: float
    failed: int


def _slice(ids: np.ndarray, lo: int, hi: int, what: str) -> np.ndarray:
    if hi > len(ids):
        raise BlockRangeError(
            f"{what} destinations {lo}..{hi} beyond the {len(ids)} blocks expected for it"
        )
    return ids[lo:hi]


def plan_reads(
    batch: protocol.ReadReadyBatch,
    destinations: Mapping[str, Destinations],
    *,
    decode_rank: int,
    decode_tp: int,
) -> tuple[list[RequestRead], dict[str, str]]:
    """This rank's share of every request in ``batch`` (pure).

    Main: only contributor member 0 pulls, split over the Decode TP ranks. Indexer and
    scale: split over the ``tp_ratio`` contributors. Returns the reads and, per request
    that cannot be read (unknown, or destinations too short), the reason.
    """
    member, ratio = batch.group_member_idx, batch.tp_ratio
    reads: list[RequestRead] = []
    refused: dict[str, str] = {}
    for req in batch.read_reqs:
        dest = destinations.get(req.ext_req_id)
        if dest is None:
            refused[req.ext_req_id] = f"request {req.ext_req_id!r} is not expected on this Decode rank"
            continue
        m_lo, m_hi = main_share(len(req.main_block_ids), req.main_start_block, decode_tp, decode_rank, member)
        i_lo, i_hi = indexer_share(len(req.indexer_block_ids), req.indexer_start_block, ratio, member)
        m_start, i_start = req.main_start_block, req.indexer_start_block
        try:
            dst_main = _slice(dest.main, m_start + m_lo, m_start + m_hi, f"{req.ext_req_id!r} main")
            dst_index = _slice(dest.indexer, i_start + i_lo, i_start + i_hi, f"{req.ext_req_id!r} indexer")
        except BlockRangeError as exc:
            refused[req.ext_req_id] = str(exc)
            continue
        src_main, src_index = req.main_ids()[m_lo:m_hi], req.indexer_ids()[i_lo:i_hi]
        reads.append(RequestRead(req.ext_req_id, src_main, dst_main, src_index, dst_index))
    return reads, refused


def _chunk_key(req: protocol.ReadRequest) -> tuple[int, int, int, int]:
    return (req.main_start_block, len(req.main_block_ids), req.indexer_start_block, len(req.indexer_block_ids))


def _summarize(refused: Mapping[str, str], shown: int = 4) -> str:
    """One error text for a READ_FAILED that names several requests: each with its reason."""
    parts = [f"{ext_id!r}: {reason}" for ext_id, reason in list(refused.items())[:shown]]
    if len(refused) > shown:
        parts.append(f"and {len(refused) - shown} more")
    return f"{len(refused)} request(s) failed: " + "; ".join(parts)


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
    read_seconds: float = 0.0
    stats: deque[LayerStat] = field(default_factory=lambda: deque(maxlen=1 << 16))  # the latest layers


class Sink:
    """The Decode runtime of one TP rank. Start it, ``expect`` requests, take results.

    ``layers`` maps layer names to this rank's destination layouts; their tensors are
    registered with ``engine`` as destinations. The engine, listener and thread belong to
    the sink: ``close()`` stops the thread and closes all of them.
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
        poll_seconds: float = 0.1,
        on_layer: Callable[[LayerStat], None] | None = None,
    ) -> None:
        if not 0 <= rank < tp_size:
            raise RD2HError(f"rank {rank} outside 0..{tp_size - 1}")
        self.rank, self.tp_size = rank, tp_size
        self._engine, self._listener = engine, listener
        self._layers = dict(layers)
        regions = [r for layout in self._layers.values() for r in layout.regions()]
        self._regions = RegionSet(regions)  # every destination: no write lands outside it
        self._engine.register(merge_by_device(regions))
        self._accept_legacy = accept_legacy
        self._poll = poll_seconds
        self._on_layer = on_layer
        self._peers: dict[bytes, _Peer] = {}
        self._plans = PlanBuilder()  # loop thread only; a plan is read before the next is built
        self._destinations: dict[str, Destinations] = {}
        self._requests = RequestTracker()
        self._contributors = ContributorTracker()
        self._coverage = CoverageTracker(self._layers)
        self._lock = threading.Lock()  # guards destinations and trackers (user vs loop thread)
        self._changed = threading.Condition(self._lock)
        self._reading: frozenset[str] = frozenset()  # requests whose destinations a read may write
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.counters = _Counters()

    # -- user side -----------------------------------------------------------------------

    @property
    def address(self) -> str:
        return self._listener.address

    def start(self) -> Sink:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"rd2h-sink-{self.rank}", daemon=True)
            self._thread.start()
        return self

    def expect(self, ext_id: str, main_blocks: Sequence[int], indexer_blocks: Sequence[int] | None = None) -> None:
        """``ext_id`` lands in these destination blocks (in prompt order; the indexer's default
        to the main ones). Prefill may announce it from now on."""
        destinations = Destinations.of(main_blocks, indexer_blocks)
        with self._lock:
            self._requests.expect(ext_id)
            self._destinations[ext_id] = destinations

    def abort(self, ext_id: str) -> None:
        """Stop writing into ``ext_id``'s destinations; it is still reported terminal.

        Returns once no read into them is in flight, so the blocks may be reused at once.
        """
        with self._changed:
            self._requests.abort(ext_id)
            self._destinations.pop(ext_id, None)
            self._changed.notify_all()
            while ext_id in self._reading:  # bounded: the engine bounds every read
                self._changed.wait(1.0)

    def take_terminal(self) -> dict[str, TerminalState]:
        """Requests that became terminal on this rank since the last call."""
        with self._changed:
            while any(self._requests.state(e) is RequestState.ABORTED for e in self._reading if e in self._requests):
                self._changed.wait(1.0)  # an aborted request is reported only once no read writes it
            taken = self._requests.take_terminal()
            for ext_id in taken:  # reported once: keep nothing, so the id may be expected again
                self._destinations.pop(ext_id, None)
                self._contributors.forget(ext_id)
                self._coverage.forget(ext_id)
                self._requests.forget(ext_id)
            return taken

    def wait(self, ext_ids: Sequence[str], timeout: float) -> dict[str, TerminalState]:
        """Block until every request in ``ext_ids`` is terminal on this rank; their states.

        Raises TimeoutError naming the requests still waiting.
        """
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                states = {e: self._requests.state(e) for e in ext_ids}
                waiting = [e for e, s in states.items() if s in (RequestState.WAITING, RequestState.RECEIVING)]
                if not waiting:
                    return {e: TerminalState(s.value) for e, s in states.items()}
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"rank {self.rank}: still receiving {waiting[:5]} after {timeout:.1f}s")
                self._changed.wait(remaining)

    def reason(self, ext_id: str) -> str | None:
        with self._lock:
            return self._requests.reason(ext_id)

    def close(self) -> None:
        """Stop the loop, then close the listener and the engine. Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self._poll + 60.0)  # one message in hand: a read is bounded by the engine
            if self._thread.is_alive():
                log.error("rank %d: loop did not stop; closing under it", self.rank)
            self._thread = None
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
        while not self._stop.is_set():
            item = self._listener.recv(self._poll)
            if item is None:
                continue
            identity, frame = item
            try:
                self._handle(identity, frame)
            except Exception:  # one bad message must never kill the rank's loop
                log.exception("rank %d: unexpected error handling a message", self.rank)

    def _handle(self, identity: bytes, frame: bytes) -> None:
        try:
            message = protocol.decode_request(frame)
        except ProtocolError as exc:
            self.counters.malformed += 1
            log.warning("rank %d: dropped a malformed message from %r: %s", self.rank, identity, exc)
            return
        if isinstance(message, protocol.MfMeta):
            self._on_meta(identity, message)
        else:
            self._on_ready(identity, message)

    def _on_meta(self, identity: bytes, meta: protocol.MfMeta) -> None:
        try:
            protocol.check_compatible(meta, accept_legacy=self._accept_legacy)
            layers = meta.layers()
            session = self._engine.connect(meta.engine_metadata)
        except RD2HError as exc:
            # No ACK: the peer's next readiness gets META_REQUIRED and fails visibly.
            log.error("rank %d: refused mf_meta from %s: %s", self.rank, meta.p_session, exc)
            return
        old = self._peers.pop(identity, None)
        if old is not None:
            old.session.close()
        regions = RegionSet(session.peer_regions)
        self._peers[identity] = _Peer(meta.p_session, layers, session, regions)
        self._listener.send(identity, protocol.ACK_FRAME)

    def _on_ready(self, identity: bytes, batch: protocol.ReadReadyBatch) -> None:
        started = time.perf_counter()
        ext_ids = [r.ext_req_id for r in batch.read_reqs]
        peer = self._peers.get(identity)
        if peer is None:
            self._reply_failed(identity, batch, protocol.META_REQUIRED, ext_ids)
            return
        src = peer.layers.get(batch.layer_name)
        dst = self._layers.get(batch.layer_name)
        if src is None or dst is None:
            side = "Prefill" if src is None else "Decode"
            self._fail_layer(identity, batch, f"layer {batch.layer_name!r} unknown on {side}")
            return
        with self._lock:
            readable = {e: self._destinations[e] for e in ext_ids if self._readable(e)}
            self._reading = frozenset(readable)
        try:
            self._read_layer(identity, batch, peer, src, dst, readable, started)
        finally:
            with self._changed:
                self._reading = frozenset()
                self._changed.notify_all()

    def _read_layer(
        self,
        identity: bytes,
        batch: protocol.ReadReadyBatch,
        peer: _Peer,
        src: LayerLayout,
        dst: LayerLayout,
        readable: dict[str, Destinations],
        started: float,
    ) -> None:
        reads, refused = plan_reads(batch, readable, decode_rank=self.rank, decode_tp=self.tp_size)
        try:
            plan = self._plans.build(
                src, dst, reads, src_regions=peer.regions, dst_regions=self._regions, layer_name=batch.layer_name
            )
        except RD2HError as exc:  # a layout mismatch fails the whole layer before any read
            self._fail_layer(identity, batch, str(exc))
            return
        refused.update({e: str(err) for e, err in plan.failed.items()})
        read_seconds = self._read(peer, plan, refused)
        try:
            self._finish(batch, plan.requests, refused)
        finally:  # whatever happened to our bookkeeping, Prefill gets its one reply
            self._reply(identity, batch, refused)
        stat = LayerStat(
            batch.layer_idx, plan.nbytes, len(plan),
            read_seconds, time.perf_counter() - started, len(refused),
        )
        self.counters.stats.append(stat)
        if self._on_layer is not None:
            self._on_layer(stat)

    def _readable(self, ext_id: str) -> bool:
        return ext_id in self._destinations and self._requests.state(ext_id) in (
            RequestState.WAITING,
            RequestState.RECEIVING,
        )

    def _read(self, peer: _Peer, plan: LayerPlan, refused: dict[str, str]) -> float:
        if not len(plan):
            return 0.0
        started = time.perf_counter()
        try:
            self._engine.read_batch(peer.session, plan.local, plan.remote, plan.lengths)
        except RD2HError as exc:
            refused.update({e: f"read failed: {exc}" for e in plan.requests})
            return time.perf_counter() - started
        seconds = time.perf_counter() - started
        self.counters.bytes_read += plan.nbytes
        self.counters.layers_read += 1
        self.counters.read_seconds += seconds
        return seconds

    def _finish(self, batch: protocol.ReadReadyBatch, read: Sequence[str], refused: dict[str, str]) -> None:
        member = batch.group_member_idx
        chunks = {r.ext_req_id: _chunk_key(r) for r in batch.read_reqs}
        with self._changed:
            for ext_id in read:
                if ext_id not in refused and ext_id in self._requests:  # not taken meanwhile
                    self._requests.on_layer_read(ext_id)
                    self._coverage.record(ext_id, member, batch.layer_name, chunks[ext_id])
            for ext_id, reason in refused.items():
                if ext_id in self._requests:
                    self._requests.on_failed(ext_id, reason)
            for ext_id in batch.done_ext_ids:
                if ext_id not in self._requests:
                    continue
                gap = self._coverage.missing(ext_id, member)
                if gap is not None:  # the final signal claims more than was read
                    self._requests.on_failed(ext_id, gap)
                    continue
                try:
                    complete = self._contributors.record_final(ext_id, member, batch.tp_ratio)
                except StateError as exc:
                    self._requests.on_failed(ext_id, str(exc))
                    continue
                if complete:
                    self._requests.on_contributors_complete(ext_id)
            self._changed.notify_all()

    def _fail_layer(self, identity: bytes, batch: protocol.ReadReadyBatch, reason: str) -> None:
        ext_ids = [r.ext_req_id for r in batch.read_reqs]
        refused = dict.fromkeys(ext_ids, reason)
        self._finish(batch, (), refused)
        self._reply_failed(identity, batch, reason, ext_ids)

    def _reply(self, identity: bytes, batch: protocol.ReadReadyBatch, refused: Mapping[str, str]) -> None:
        if not refused:
            self._listener.send(identity, protocol.encode(protocol.ReadDone(batch.layer_idx)))
            return
        self._reply_failed(identity, batch, _summarize(refused), list(refused))

    def _reply_failed(self, identity: bytes, batch: protocol.ReadReadyBatch, error: str, ext_ids: list[str]) -> None:
        log.warning("rank %d: layer %d failed for %d request(s): %s", self.rank, batch.layer_idx, len(ext_ids), error)
        reply = protocol.ReadFailed(batch.layer_idx, error, tuple(ext_ids))
        self._listener.send(identity, protocol.encode(reply))
