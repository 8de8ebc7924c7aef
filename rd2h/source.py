"""Prefill runtime: layer events -> readiness -> replies -> storage-slot gates.

One :class:`Source` serves one Prefill TP rank. The compute path drives it:

    source.schedule({"req-1": computed_tokens})      # a prefill step: which blocks are new
    for layer in layers:
        source.wait_for_layer_send(layer)             # before overwriting the layer's slots
        ...write the layer's KV...
        source.layer_ready(layer, event)              # queue the announcement

A background sender (owned by the source) waits for each layer's event, sends
``mf_meta`` once per connection and one ``read_ready_batch`` per Decode endpoint, and
feeds every reply to the slot gate. A Decode endpoint that does not reply within
``reply_timeout`` is abandoned: its slots are released with an error, so the compute path
raises instead of hanging.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from rd2h import protocol
from rd2h.chunking import ChunkPlanner
from rd2h.errors import ConfigError, ProtocolError, RD2HError, UnknownRequestError
from rd2h.gate import SlotGate
from rd2h.interfaces import Dialer, TransferEngine
from rd2h.layout import LayerLayout
from rd2h.regions import merge_by_device
from rd2h.topology import Topology, remote_port

__all__ = ["DecodeEndpoint", "Source", "SendResult"]

log = logging.getLogger("rd2h.source")


class _Event(Protocol):
    def synchronize(self) -> Any: ...


@dataclass(frozen=True, slots=True)
class DecodeEndpoint:
    """A Decode instance as its rendezvous advertises it: host, base port and TP size."""

    host: str
    base_port: int
    tp_size: int

    def address(self, decode_rank: int) -> str:
        """The control address of one Decode TP rank (the port is range-checked)."""
        return f"tcp://{self.host}:{remote_port(self.base_port, decode_rank, self.tp_size)}"


@dataclass(frozen=True, slots=True)
class SendResult:
    """How a request's transfer ended, from Prefill's side."""

    ext_id: str
    error: str | None  # None when every Decode endpoint read every layer

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(slots=True)
class _Request:
    main_ids: np.ndarray
    indexer_ids: np.ndarray
    addresses: tuple[str, ...]  # the Decode ranks this Prefill rank announces to
    member: int
    ratio: int


@dataclass(slots=True)
class _Announcement:
    """What one endpoint is told for every layer of one step."""

    member: int
    ratio: int
    reads: list[protocol.ReadRequest] = field(default_factory=list)
    done: list[str] = field(default_factory=list)
    packed: bytes = b""  # the reads, encoded once per step for every layer's readiness


@dataclass(frozen=True, slots=True)
class _Step:
    by_address: dict[str, _Announcement]
    final_ids: tuple[str, ...]


@dataclass(slots=True)
class _Sent:
    """A readiness awaiting its reply from one endpoint."""

    frame: bytes
    ext_ids: tuple[str, ...]
    at: float  # monotonic time it was sent
    resent: bool = False  # repeated once after META_REQUIRED


@dataclass(frozen=True, slots=True)
class _Task:
    layer_idx: int
    layer_name: str
    event: _Event | None
    step: _Step


_STOP = object()


class Source:
    """The Prefill runtime of one TP rank.

    ``layers`` maps every logical layer name, in layer order, to its source layout;
    logical layers that reuse a physical buffer share its base addresses, and the slot
    gate keys on those. The engine, dialer and sender thread belong to the source.
    """

    def __init__(
        self,
        *,
        rank: int,
        tp_size: int,
        engine: TransferEngine,
        dialer: Dialer,
        layers: Mapping[str, LayerLayout],
        block_size: int,
        last_layer: str | None = None,
        reply_timeout: float = 30.0,
        poll_seconds: float = 0.05,
    ) -> None:
        if not layers:
            raise ConfigError("a Source needs at least one layer")
        if not 0 <= rank < tp_size:
            raise ConfigError(f"rank {rank} outside 0..{tp_size - 1}")
        self.rank, self.tp_size = rank, tp_size
        self._engine, self._dialer = engine, dialer
        self._layers = dict(layers)
        self._index = {name: i for i, name in enumerate(self._layers)}
        last = last_layer if last_layer is not None else next(reversed(self._layers))
        if last not in self._index:
            raise ConfigError(f"last_layer {last!r} is not one of the layers")
        self._last_idx = self._index[last]
        self._planner = ChunkPlanner(block_size)
        self._reply_timeout = reply_timeout
        self._poll = poll_seconds
        engine_meta = engine.register(merge_by_device(r for layout in self._layers.values() for r in layout.regions()))
        self._meta_frame = protocol.encode(
            protocol.MfMeta.from_layers(engine.session_id, self._layers, engine_metadata=engine_meta)
        )
        self._gate = SlotGate()
        self._requests: dict[str, _Request] = {}
        self._step = _Step({}, ())
        self._queue: queue.SimpleQueue[_Task | object] = queue.SimpleQueue()
        self._revive: queue.SimpleQueue[tuple[str, ...]] = queue.SimpleQueue()  # new requests
        # sender-thread state
        self._meta_sent: set[str] = set()
        self._dead: dict[str, str] = {}  # address -> why; skipped until a new request names it
        self._in_flight: dict[str, dict[int, _Sent]] = {}  # per endpoint, oldest first
        self._final_layers: dict[int, tuple[str, ...]] = {}
        # shared with the user thread
        self._lock = threading.Condition()
        self._errors: dict[str, str] = {}
        self._results: dict[str, SendResult] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._claimed_at: dict[int, float] = {}
        self.stray_replies = 0
        self.layer_seconds: deque[float] = deque(maxlen=1 << 16)  # layer_ready -> last reply

    # -- compute path --------------------------------------------------------------------

    def start(self) -> Source:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"rd2h-source-{self.rank}", daemon=True)
            self._thread.start()
        return self

    def add_request(
        self,
        ext_id: str,
        decode: DecodeEndpoint,
        *,
        main_block_ids: Sequence[int],
        indexer_block_ids: Sequence[int] | None = None,
        num_tokens: int,
    ) -> None:
        """Track a request to be pulled by ``decode``; its source blocks in prompt order."""
        topology = Topology(self.tp_size, decode.tp_size)
        main_ids = np.asarray(main_block_ids, dtype=np.int64).reshape(-1)
        index_ids = main_ids if indexer_block_ids is None else np.asarray(indexer_block_ids, dtype=np.int64)
        self._planner.track(ext_id, num_tokens)
        needed = self._planner.num_blocks(ext_id)
        if len(main_ids) < needed or len(index_ids) < needed:
            self._planner.forget(ext_id)
            raise ConfigError(
                f"request {ext_id!r}: {num_tokens} tokens need {needed} blocks, got "
                f"{len(main_ids)} main and {len(index_ids)} indexer block ids"
            )
        addresses = tuple(decode.address(d) for d in topology.decode_ranks_of(self.rank))
        self._revive.put(addresses)
        self._requests[ext_id] = _Request(
            main_ids, index_ids, addresses, topology.member_of(self.rank), topology.ratio
        )

    def schedule(self, computed_tokens: Mapping[str, int]) -> None:
        """Start a prefill step: after it, each request has this many prompt tokens cached.

        Every following ``layer_ready`` announces, per request, the blocks that became
        complete in this step (the final chunk includes its partial last block).
        """
        # check every request before recording any, so a bad one leaves the step unchanged
        chunks = {ext_id: (self._request(ext_id), self._planner.peek(ext_id, tokens))
                  for ext_id, tokens in computed_tokens.items()}
        by_address: dict[str, _Announcement] = {}
        final_ids: list[str] = []
        for ext_id, (request, chunk) in chunks.items():
            self._planner.advance(ext_id, computed_tokens[ext_id])
            read = protocol.ReadRequest(
                ext_id,
                tuple(request.main_ids[chunk.lo : chunk.hi].tolist()),
                tuple(request.indexer_ids[chunk.lo : chunk.hi].tolist()),
                chunk.lo,
                chunk.lo,
            )
            for address in request.addresses:
                ann = by_address.setdefault(address, _Announcement(request.member, request.ratio))
                ann.reads.append(read)
                if chunk.final:
                    ann.done.append(ext_id)
            if chunk.final:
                final_ids.append(ext_id)
        for ann in by_address.values():
            ann.packed = protocol.pack_read_reqs(ann.reads)
        self._step = _Step(by_address, tuple(final_ids))

    def wait_for_layer_send(self, layer_name: str, timeout: float | None = None) -> None:
        """Block until the layer's physical slots may be overwritten.

        Raises LayerFailedError if the previous owner of a slot failed layer-wide (a
        dead or refusing Decode), GateTimeout if the slots are still busy after
        ``timeout`` (default: the reply timeout plus a margin).
        """
        bound = self._reply_timeout + 5.0 if timeout is None else timeout
        self._gate.wait(self._slots(layer_name), bound)

    def layer_ready(self, layer_name: str, event: _Event | None = None) -> None:
        """The layer's KV is written (or will be once ``event`` completes): announce it."""
        layer_idx = self._index_of(layer_name)
        self._gate.claim(layer_idx, self._slots(layer_name))
        self._claimed_at[layer_idx] = time.monotonic()
        self._queue.put(_Task(layer_idx, layer_name, event, self._step))
        self._dialer.wakeup()

    def send_all(self, computed_tokens: Mapping[str, int]) -> None:
        """One step whose KV is already written for every layer: announce all layers."""
        self.schedule(computed_tokens)
        for name in self._layers:
            self.wait_for_layer_send(name)
            self.layer_ready(name)

    def take_finished(self) -> dict[str, SendResult]:
        """Requests whose final chunk was answered for every layer, since the last call."""
        with self._lock:
            taken, self._results = self._results, {}
        for ext_id in taken:
            self._requests.pop(ext_id, None)
            self._planner.forget(ext_id)
        return taken

    def wait_finished(self, ext_ids: Sequence[str], timeout: float) -> dict[str, SendResult]:
        """Block until every request in ``ext_ids`` finished sending; raise TimeoutError."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while not all(e in self._results for e in ext_ids):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = [e for e in ext_ids if e not in self._results]
                    raise TimeoutError(f"Prefill rank {self.rank}: {missing[:5]} not finished after {timeout:.1f}s")
                self._lock.wait(remaining)
            found = {e: self._results.pop(e) for e in ext_ids}
        for ext_id in found:
            self._requests.pop(ext_id, None)
            self._planner.forget(ext_id)
        return found

    def abort(self, ext_id: str) -> None:
        """Forget ``ext_id``: it is announced no more (layers already queued still go out)."""
        self._requests.pop(ext_id, None)
        self._planner.forget(ext_id)
        with self._lock:
            self._errors.pop(ext_id, None)
            self._results.pop(ext_id, None)

    def close(self) -> None:
        """Stop the sender once the queued layers are announced and answered (each bounded
        by the reply timeout), then close the dialer and the engine. Idempotent."""
        if self._thread is not None:
            self._queue.put(_STOP)
            self._dialer.wakeup()
            self._thread.join(self._reply_timeout * 2 + 5.0)
            if self._thread.is_alive():
                log.error("Prefill rank %d: sender did not stop; closing under it", self.rank)
            self._thread = None
        self._dialer.close()
        self._engine.close()

    def __enter__(self) -> Source:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, ext_id: str) -> _Request:
        try:
            return self._requests[ext_id]
        except KeyError:
            raise UnknownRequestError(f"request {ext_id!r} was not added to this Source") from None

    def _index_of(self, layer_name: str) -> int:
        try:
            return self._index[layer_name]
        except KeyError:
            raise ConfigError(f"unknown layer {layer_name!r}") from None

    def _slots(self, layer_name: str) -> list[tuple[str, int]]:
        self._index_of(layer_name)  # raises ConfigError for an unknown layer
        layout = self._layers[layer_name]
        slots = [("main", layout.main_slot)]
        if layout.indexer_slot is not None:
            slots.append(("indexer", layout.indexer_slot))
        return slots

    # -- sender thread -------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                task = self._queue.get_nowait()
            except queue.Empty:
                task = None
            if task is _STOP:
                self._drain_replies()
                return
            try:
                if task is not None:
                    self._announce(task)  # type: ignore[arg-type]
                else:
                    item = self._dialer.recv(self._poll)
                    if item is not None:
                        self._on_reply(*item)
                self._abandon_silent()
            except Exception:  # the loop must outlive any one failure, or every wait times out
                log.exception("Prefill rank %d: sender error", self.rank)

    def _announce(self, task: _Task) -> None:
        step = task.step
        last = task.layer_idx == self._last_idx
        if last and step.final_ids:
            self._final_layers[task.layer_idx] = step.final_ids
        try:
            if task.event is not None:
                task.event.synchronize()
        except Exception as exc:  # nothing was announced: fail the layer's requests, free its slots
            error = f"layer {task.layer_name!r} could not be announced: {exc}"
            log.error("Prefill rank %d: %s", self.rank, error)
            self._fail_requests((r.ext_req_id for a in step.by_address.values() for r in a.reads), error)
            if self._gate.fail_layer(task.layer_idx, error):
                self._layer_released(task.layer_idx)
            return
        while not self._revive.empty():
            for address in self._revive.get():
                self._dead.pop(address, None)
        live = {a: ann for a, ann in step.by_address.items() if a not in self._dead}
        for address in step.by_address.keys() - live.keys():
            self._fail_requests((r.ext_req_id for r in step.by_address[address].reads), self._dead[address])
        if self._gate.sent(task.layer_idx, live):
            self._layer_released(task.layer_idx)
        for address, ann in live.items():
            frame = protocol.encode_readiness(
                task.layer_idx, task.layer_name, ann.packed, ann.done if last else (), ann.member, ann.ratio
            )
            sent = _Sent(frame, tuple(r.ext_req_id for r in ann.reads), time.monotonic())
            self._in_flight.setdefault(address, {})[task.layer_idx] = sent
            try:
                if address not in self._meta_sent:
                    self._dialer.send(address, self._meta_frame)  # pipelined: ZMQ keeps the order
                    self._meta_sent.add(address)
                self._dialer.send(address, sent.frame)
            except RD2HError as exc:  # this endpoint missed the layer; the others did not
                self._settle(address, task.layer_idx, f"{address}: could not send: {exc}", layer_wide=True)

    def _on_reply(self, address: str, frame: bytes) -> None:
        try:
            reply = protocol.decode_reply(frame)
        except ProtocolError as exc:
            log.warning("Prefill rank %d: malformed reply from %s: %s", self.rank, address, exc)
            return
        if isinstance(reply, protocol.Ack):
            return
        if isinstance(reply, protocol.ReadFailed):
            if reply.needs_meta:
                self._meta_sent.discard(address)  # a restarted Decode: introduce ourselves again
                if self._resend(address, reply.layer_idx):
                    return
            error = f"{address}: {reply.error}"
            if reply.failed_ext_ids:  # isolated: the neighbours were read, the compute path goes on
                self._fail_requests(reply.failed_ext_ids, error)
                self._settle(address, reply.layer_idx, None)
            else:
                self._settle(address, reply.layer_idx, error, layer_wide=True)
        else:
            self._settle(address, reply.layer_idx, None)

    def _settle(self, address: str, layer_idx: int, error: str | None, *, layer_wide: bool = False) -> None:
        """``address`` answered (or can no longer answer) for ``layer_idx``."""
        sent = self._in_flight.get(address, {}).pop(layer_idx, None)
        if sent is None:
            self.stray_replies += 1
            return
        if layer_wide and error is not None:
            self._fail_requests(sent.ext_ids, error)
        if self._gate.replied(layer_idx, address, error if layer_wide else None):
            self._layer_released(layer_idx)

    def _resend(self, address: str, layer_idx: int) -> bool:
        """A restarted Decode asked who we are: introduce ourselves and repeat the readiness
        it refused (it read nothing). Once per layer, so a Decode that refuses our mf_meta
        fails the layer instead of looping."""
        sent = self._in_flight.get(address, {}).get(layer_idx)
        if sent is None or sent.resent:
            return False
        sent.resent = True
        self._dialer.send(address, self._meta_frame)
        self._meta_sent.add(address)
        self._dialer.send(address, sent.frame)
        return True

    def _fail_requests(self, ext_ids: Iterable[str], error: str) -> None:
        with self._lock:
            for ext_id in ext_ids:
                self._errors.setdefault(ext_id, error)

    def _layer_released(self, layer_idx: int) -> None:
        claimed = self._claimed_at.pop(layer_idx, None)
        if claimed is not None:
            self.layer_seconds.append(time.monotonic() - claimed)
        final_ids = self._final_layers.pop(layer_idx, ())
        if not final_ids:
            return
        with self._lock:
            for ext_id in final_ids:
                error = self._errors.pop(ext_id, None)
                if ext_id in self._requests:  # not aborted meanwhile
                    self._results[ext_id] = SendResult(ext_id, error)
            self._lock.notify_all()

    def _abandon_silent(self) -> None:
        """Give up on endpoints whose oldest readiness went unanswered for reply_timeout."""
        now = time.monotonic()
        for address, pending in self._in_flight.items():
            if not pending or now - next(iter(pending.values())).at <= self._reply_timeout:
                continue
            error = f"Decode {address} did not reply within {self._reply_timeout:.1f}s"
            log.error("Prefill rank %d: %s; abandoning it", self.rank, error)
            self._dead[address] = error
            self._meta_sent.discard(address)
            self._dialer.disconnect(address)
            for layer_idx in list(pending):
                self._settle(address, layer_idx, error, layer_wide=True)

    def _drain_replies(self) -> None:
        """On close: wait (bounded) for the replies still owed, so Decode finishes its reads."""
        deadline = time.monotonic() + self._reply_timeout
        while any(self._in_flight.values()) and time.monotonic() < deadline:
            item = self._dialer.recv(self._poll)
            if item is not None:
                self._on_reply(*item)
