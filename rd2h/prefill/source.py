"""Prefill runtime: layer events -> readiness -> replies -> storage-slot gates.

One :class:`Source` serves one Prefill TP rank. The compute path drives it:

    source.add_request("req-1", endpoint, main_block_ids=[...], num_tokens=40)
    source.schedule({"req-1": computed_tokens})      # a prefill step: which blocks are new
    for layer in layers:
        source.wait_for_layer_send(layer)             # before overwriting the layer's slots
        ...write the layer's KV...
        source.layer_ready(layer, event)              # announce (or queue until the event)
    source.take_finished()                            # requests that ended, each once

The source is a thin loop: every request and endpoint lives in a pure :class:`~rd2h.prefill.send_tracker.SendTracker`,
the storage slots in a :class:`~rd2h.prefill.gate.SlotGate`. A background sender (owned by the source) waits for each
layer's event, asks the tracker what to send, sends it, and feeds every reply back; a layer written without an event is
announced on the caller's thread when the dialer allows it (``Dialer.concurrent_send``), and a caller waiting for its
slots reads the replies itself (:mod:`rd2h.prefill.reply_turn`). Whichever thread records frames in the tracker
writes them in the same turn, so they reach the dialer in the tracker's order (:mod:`rd2h.prefill.send_order`). A
Decode endpoint that does not reply within ``reply_timeout`` (on the injectable ``clock``) is abandoned: its slots are
released and the requests it held fail with ReplyTimeout. Failures belong to the requests they hit: the compute path
is never handed another request's error. Endpoints no request uses are closed and forgotten after a bound
(``endpoint_idle_seconds``, ``max_endpoints``). Warnings about what a Decode sends are limited per Decode and reason,
with counts (:mod:`rd2h.quiet_log`).

Blocking calls bound how long the caller's thread blocks in real time; protocol timeouts and
outcome times use ``clock``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

from rd2h.clock import Clock, monotonic
from rd2h.errors import ChannelError, ConfigError, RD2HError, WaitTimeout
from rd2h.interfaces import Dialer, TransferEngine
from rd2h.layout.layers import LayerLayout
from rd2h.layout.regions import merge_by_device
from rd2h.outcome import Outcome
from rd2h.prefill.gate import SlotGate, slot_keys
from rd2h.prefill.reply_turn import ReplyTurn
from rd2h.prefill.send_order import SendOrder
from rd2h.prefill.send_tracker import Effects, SendTracker, Step
from rd2h.quiet_log import QuietLog
from rd2h.wire import protocol
from rd2h.wire.endpoint import DecodeEndpoint

__all__ = ["DecodeEndpoint", "Source"]

log = logging.getLogger("rd2h.prefill.source")


class _Event(Protocol):
    def synchronize(self) -> Any: ...


@dataclass(frozen=True, slots=True)
class _Task:
    layer_idx: int
    layer_name: str
    event: _Event | None
    step: Step
    queued: float


_STOP = object()
_SLOW_SECONDS = 1.0  # a layer that waits longer for the sender thread is logged
_IGNORED = {  # what the tracker absorbed (its counter) -> what the warning says
    "malformed": "dropped a malformed reply",
    "stray": "dropped a reply that answers no readiness in flight (late, duplicate or unknown)",
    "stale": "dropped a reply to readiness abandoned before the Decode was revived",
    "unknown_failed_ids": "ignored failed request ids its readiness did not name",
}


def _block_bytes(layout: LayerLayout) -> tuple[int, int]:
    """Bytes per block of the layer's main group and of its indexer group (indexer + scale)."""
    main = sum(t.block_bytes for t in layout.main)
    indexer = sum(t.block_bytes for t in (layout.indexer, layout.scale) if t is not None)
    return main, indexer


class Source:
    """The Prefill runtime of one TP rank.

    ``layers`` maps every logical layer name, in layer order, to its source layout; logical layers that reuse a
    physical buffer share its base addresses, and the slot gate keys on those. ``block_size`` is tokens per main
    block, ``indexer_block_size`` per indexer block (None: the same). The engine, dialer and sender thread belong to
    the source. ``inline_announce``: a layer whose KV is written (``layer_ready`` without an event) is announced on
    the calling thread when the dialer allows concurrent sends and no earlier layer is queued; False sends
    everything from the sender thread. ``caller_reads_replies``: ``wait_for_layer_send`` reads Decode's replies on
    the calling thread (with ``concurrent_send``; :mod:`rd2h.prefill.reply_turn`); False: the sender's only.
    ``reuse_slots``: logical layers share physical buffers, so a layer waits for its slots (``wait_for_layer_send``)
    until every Decode endpoint answered the layer that used them last. False where every block stays the request's
    until it is finished (vLLM's paged cache): nothing waits, and a layer may be announced again (next step, other
    requests) while Decode still reads the previous one. A Decode endpoint that no live request names and that owes
    no reply is unused: its connection is closed and its record forgotten once unused for ``endpoint_idle_seconds``,
    or, while more than ``max_endpoints`` are known, least recently used first once unused for ``reply_timeout``;
    named again, it is dialled again. ``pp_rank``/``pp_size``: the pipeline stage whose layers ``layers`` are (its
    ``mf_meta`` says so, and Decode then takes them as that stage's share of the model). ``model_layers``: each
    layer's index in the model, in ``layers``' order, which a Decode run with pipeline parallel needs (each layer
    goes to the Decode stage holding it).
    Raises ConfigError on bad arguments.
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
        indexer_block_size: int | None = None,
        last_layer: str | None = None,
        reply_timeout: float = 30.0,
        poll_seconds: float = 0.05,
        inline_announce: bool = True,
        caller_reads_replies: bool = True,
        reuse_slots: bool = True,
        clock: Clock = monotonic,
        endpoint_idle_seconds: float = 300.0,
        max_endpoints: int = 256,
        pp_rank: int = 0,
        pp_size: int = 1,
        model_layers: Sequence[int] | None = None,
    ) -> None:
        if not layers:
            raise ConfigError("a Source needs at least one layer")
        if not 0 <= rank < tp_size:
            raise ConfigError(f"rank {rank} outside 0..{tp_size - 1}")
        self.rank, self.tp_size = rank, tp_size
        self._engine, self._dialer, self._clock = engine, dialer, clock
        self._layers = dict(layers)
        self._index = {name: i for i, name in enumerate(self._layers)}
        self._slot_keys = {name: slot_keys(layout) for name, layout in self._layers.items()}  # per layer, once
        last = last_layer if last_layer is not None else next(reversed(self._layers))
        if last not in self._index:
            raise ConfigError(f"last_layer {last!r} is not one of the layers")
        self._reply_timeout = reply_timeout
        self._poll = poll_seconds
        engine_meta = engine.register(merge_by_device(r for layout in self._layers.values() for r in layout.regions()))
        meta_frame = protocol.encode(
            protocol.MfMeta.from_layers(
                engine.session_id, self._layers, engine_metadata=engine_meta, pp_rank=pp_rank, pp_size=pp_size
            )
        )
        self._tracker = SendTracker(
            rank=rank, tp_size=tp_size, meta_frame=meta_frame,
            layer_block_bytes=[_block_bytes(layout) for layout in self._layers.values()],
            last_layer=self._index[last], block_size=block_size, indexer_block_size=indexer_block_size,
            reply_timeout=reply_timeout, endpoint_idle_seconds=endpoint_idle_seconds, max_endpoints=max_endpoints,
            model_layers=model_layers,
        )
        self._quiet = QuietLog(log, clock=clock)  # per Decode and reason: a peer cannot flood the log
        self._lock = threading.Condition()  # guards the tracker; notified when requests settle
        self._gate: SlotGate | None = SlotGate() if reuse_slots else None
        self._step, _ = self._tracker.schedule({}, clock())
        self._sends = SendOrder(  # what a tracker call records is written in the same turn, in its order
            rank=rank, dialer=dialer, tracker=self._tracker, lock=self._lock, clock=clock, quiet=self._quiet,
            meta_frame=meta_frame, released=self._release_slots,
        )
        self._feed = self._sends.feed
        self._queue: queue.SimpleQueue[_Task | object] = queue.SimpleQueue()
        self._inline = inline_announce and dialer.concurrent_send
        self._turn = ReplyTurn(dialer, idle_seconds=poll_seconds)
        self._caller_reads = caller_reads_replies and dialer.concurrent_send and self._gate is not None
        self._order = threading.Lock()  # guards _queued: layers queued and not yet announced
        self._queued = 0
        self._thread: threading.Thread | None = None
        self._claimed_at: dict[int, float] = {}
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
        main_block_ids: Sequence[int] = (),
        indexer_block_ids: Sequence[int] | None = None,
        num_tokens: int,
        first_block: int = 0,
    ) -> None:
        """Track a request to be pulled by ``decode``.

        Block ids are the request's block table in prompt order from position 0; they may be partial or empty now and
        grow by :meth:`extend`. ``indexer_block_ids`` None: the indexer uses the main ids. ``first_block`` main blocks
        are a prefix Decode holds already: announcing starts there. Raises DuplicateRequestError if ``ext_id`` is
        tracked or its outcome not yet taken (the live request is untouched), ConfigError / TopologyError / PortError
        on bad arguments.
        """
        with self._lock:
            self._tracker.add_request(
                ext_id, decode, main_block_ids=main_block_ids, indexer_block_ids=indexer_block_ids,
                num_tokens=num_tokens, first_block=first_block, now=self._clock(),
            )

    def extend(self, ext_id: str, *, main_block_ids: Sequence[int] = (), indexer_block_ids: Sequence[int] = ()) -> None:
        """Append source block ids learnt in a later step. Ignored for a request that ended;
        raises UnknownRequestError for an id never added, ConfigError for bad ids."""
        with self._lock:
            self._tracker.extend(ext_id, main_block_ids=main_block_ids, indexer_block_ids=indexer_block_ids)

    def schedule(self, computed_tokens: Mapping[str, int]) -> dict[str, RD2HError]:
        """Start a prefill step: after it, each request has this many prompt tokens cached.

        Every following ``layer_ready`` announces, per request, the blocks that became
        complete in this step (the final chunk includes its partial last block). Never
        raises for one request: returns ``{ext_id: error}`` for ids that are not tracked
        (UnknownRequestError), no longer announced (StateError), or cannot be announced
        (ConfigError: bad tokens, missing block ids; such a request is failed).
        """
        with self._lock:
            self._step, problems = self._tracker.schedule(computed_tokens, self._clock())
            self._lock.notify_all()
        if problems:
            self._turn.wake()  # a failed request's notice goes out from the sender thread
        for ext_id, error in problems.items():
            log.warning("Prefill rank %d: request %r not scheduled: %s", self.rank, ext_id, error)
        return problems

    def wait_for_layer_send(self, layer_name: str, timeout: float | None = None) -> None:
        """Block until the layer's physical slots may be overwritten.

        Raises GateTimeout if the slots are still busy after ``timeout`` seconds (default:
        the reply timeout plus a margin), ConfigError for an unknown layer.
        """
        if self._gate is None:  # no slot is reused: nothing to wait for
            self._index_of(layer_name)
            return
        bound = self._reply_timeout + 5.0 if timeout is None else timeout
        slots = self._slots(layer_name)  # raises ConfigError for an unknown layer
        if not self._caller_reads:
            self._gate.wait(slots, bound)
            return
        deadline = time.monotonic() + bound
        gate = self._gate
        while not gate.free(slots):  # the replies wake this thread, not the sender's; bounded by the
            left = deadline - time.monotonic()  # poll: a slot the sender thread freed (expiry) is seen
            if left <= 0:
                gate.wait(slots, 0)  # raises GateTimeout naming the busy slots
            self._turn.caller_turn(min(left, self._poll), self._on_reply, partial(gate.free, slots))

    def layer_ready(self, layer_name: str, event: _Event | None = None) -> None:
        """The layer's KV is written (or will be once ``event`` completes): announce it.

        Raises ConfigError for an unknown layer, StateError if its slots are still busy
        (``wait_for_layer_send`` first)."""
        layer_idx = self._index_of(layer_name)
        if self._gate is not None:
            self._gate.claim(layer_idx, self._slot_keys[layer_name])
            self._claimed_at[layer_idx] = self._clock()
        with self._order:
            # Announce here when nothing is left to wait for: the KV is written (no event)
            # and no earlier layer waits in the queue (layers go out in order). A hand-off to
            # the sender thread and the wakeup back cost more than the announce itself.
            inline = self._inline and event is None and self._queued == 0
            if not inline:
                self._queued += 1
                self._queue.put(_Task(layer_idx, layer_name, event, self._step, time.monotonic()))
        if inline:
            try:
                self._announce(layer_idx, layer_name, self._step)
            except Exception:  # as on the sender thread: the compute path never gets a peer's error
                log.exception("Prefill rank %d: error announcing layer %r", self.rank, layer_name)
        else:
            self._turn.wake()

    def send_all(self, computed_tokens: Mapping[str, int]) -> dict[str, RD2HError]:
        """One step whose KV is already written for every layer: announce all layers.
        Returns what ``schedule`` returned."""
        problems = self.schedule(computed_tokens)
        for name in self._layers:
            self.wait_for_layer_send(name)
            self.layer_ready(name)
        return problems

    def take_finished(self) -> dict[str, Outcome]:
        """Every request that ended since the last call (DONE, FAILED or ABORTED), consumed."""
        with self._lock:
            return self._tracker.take()

    def wait_finished(self, ext_ids: Sequence[str], timeout: float) -> dict[str, Outcome]:
        """Block until every request in ``ext_ids`` ended; return their outcomes, consumed.

        Raises UnknownRequestError at once for an id never added (or already taken), WaitTimeout (a TimeoutError)
        naming the pending ids after ``timeout`` seconds; nothing is consumed then.
        """
        ids = list(ext_ids)
        deadline = time.monotonic() + timeout
        self._turn.give_back()  # the replies that settle them are read by the sender thread
        with self._lock:
            while (found := self._tracker.collect(ids)) is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    pending = self._tracker.unsettled(ids)
                    raise WaitTimeout(
                        f"Prefill rank {self.rank}: {len(pending)} requests not finished after "
                        f"{timeout:g} s: {pending[:5]}"
                    )
                self._lock.wait(remaining)
        return found

    def wait_any(self, timeout: float) -> bool:
        """Block until some request ended and is not taken, ``timeout`` seconds at most;
        whether one did. Consumes nothing."""
        self._turn.give_back()
        with self._lock:
            return self._lock.wait_for(lambda: self._tracker.settled() > 0, timeout)

    def abort(self, ext_id: str) -> bool:
        """Give up on ``ext_id``: it is announced no more and reported ABORTED once no
        Decode endpoint may still be reading its blocks (a request that already failed
        stays FAILED). False, and nothing reported, for an id that is not live."""
        with self._lock:
            found = self._tracker.abort(ext_id, self._clock())
            self._lock.notify_all()
        if found:
            self._turn.wake()  # its notice goes out from the sender thread
        return found

    @property
    def stray_replies(self) -> int:
        """Replies that matched no readiness in flight: late, duplicate or unknown."""
        with self._lock:
            return self._tracker.counters["stray"]

    @property
    def endpoints(self) -> int:
        """Decode endpoints this rank keeps a record (and a connection) for."""
        with self._lock:
            return self._tracker.endpoints()

    @property
    def counters(self) -> dict[str, int]:
        """Remote input absorbed: stray replies, malformed frames, unknown failed ids, acks."""
        with self._lock:
            return dict(self._tracker.counters)

    def close(self) -> None:
        """Stop the sender once the queued layers are announced and answered (each bounded
        by the reply timeout), then close the dialer and the engine. Idempotent."""
        self._turn.give_back()
        if self._thread is not None:
            self._queue.put(_STOP)
            self._turn.wake()
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

    def _index_of(self, layer_name: str) -> int:
        try:
            return self._index[layer_name]
        except KeyError:
            raise ConfigError(f"unknown layer {layer_name!r}") from None

    def _slots(self, layer_name: str) -> tuple[tuple[str, int], ...]:
        keys = self._slot_keys.get(layer_name)
        if keys is None:
            raise ConfigError(f"unknown layer {layer_name!r}")
        return keys

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
                    try:
                        self._announce(task.layer_idx, task.layer_name, task.step, task)  # type: ignore[union-attr]
                    finally:
                        with self._order:
                            self._queued -= 1
                else:
                    self._turn.sender_turn(self._poll, self._on_reply)
                self._connections_lost()
                self._expire()
                self._quiet.flush()  # counts of warnings whose interval ended
            except Exception:  # the loop must outlive any one failure, or every wait times out
                log.exception("Prefill rank %d: sender error", self.rank)

    def _on_reply(self, address: str, frame: bytes) -> None:
        ignored = self._feed(self._tracker.on_reply, address, frame).ignored
        if ignored:
            self._quiet.warning(
                ignored, address, "Prefill rank %d: %s from Decode %s (%d so far)",
                self.rank, _IGNORED[ignored], address, self._tracker.counters[ignored],
            )  # fmt: skip

    def _announce(self, layer_idx: int, layer_name: str, step: Step, task: _Task | None = None) -> None:
        """Announce a layer: on the caller's thread (no ``task``), or a queued ``task`` on the sender's."""
        try:
            if task is not None:
                if (waited := time.monotonic() - task.queued) > _SLOW_SECONDS:
                    log.warning(
                        "Prefill rank %d: layer %r waited %.1f s to be announced", self.rank, layer_name, waited
                    )
                if task.event is not None:
                    task.event.synchronize()
        except Exception as exc:
            self._unannounced(layer_idx, layer_name, step, exc)
            return
        with self._sends.turn:  # recorded and written in one turn: see rd2h.prefill.send_order
            try:
                with self._lock:  # raises before it changes anything
                    endpoints, effects = self._tracker.announce(step, layer_idx, layer_name, self._clock())
            except Exception as exc:
                self._unannounced(layer_idx, layer_name, step, exc)
                return
            self._slots_sent(layer_idx, endpoints)
            self._sends.carry_out(effects)

    def _unannounced(self, layer_idx: int, layer_name: str, step: Step, exc: Exception) -> None:
        """Nothing was announced: fail the step's requests, free the slots."""
        log.error("Prefill rank %d: layer %r could not be announced: %s", self.rank, layer_name, exc)
        with self._lock:
            self._tracker.layer_unsent(step, layer_name, exc, self._clock())
            self._lock.notify_all()
        self._slots_sent(layer_idx, ())

    def _release_slots(self, effects: Effects) -> None:
        if self._gate is not None:
            for layer_idx, address in effects.released:
                self._released(self._gate.replied(layer_idx, address), layer_idx)

    def _expire(self) -> None:
        effects = self._feed(self._tracker.expire)
        for address in effects.disconnects:
            self._quiet.error(
                "silent", address, "Prefill rank %d: Decode %s did not reply within %.1f s; abandoning it",
                self.rank, address, self._reply_timeout,
            )  # fmt: skip

    def _connections_lost(self) -> None:
        """Connections the dialer dropped with frames waiting (``Dialer.take_failures``): nothing in flight there is
        answered, so its requests fail now, not at reply_timeout (the dialer woke the sender to say so)."""
        for address, why in self._dialer.take_failures().items():
            self._quiet.error("send failed", address, "Prefill rank %d: %s", self.rank, why)
            self._feed(self._tracker.connection_lost, address, ChannelError(why))

    def _slots_sent(self, layer_idx: int, endpoints: Sequence[str]) -> None:
        if self._gate is not None:
            self._released(self._gate.sent(layer_idx, endpoints), layer_idx)

    def _released(self, released: bool, layer_idx: int) -> None:
        claimed = self._claimed_at.pop(layer_idx, None) if released else None
        if claimed is not None:
            self.layer_seconds.append(self._clock() - claimed)

    def _drain_replies(self) -> None:
        """On close: wait (bounded) for the replies still owed, so Decode finishes its reads."""
        deadline = time.monotonic() + self._reply_timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not self._tracker.has_in_flight():
                    return
            self._turn.sender_turn(self._poll, self._on_reply)
            self._connections_lost()
            self._expire()
