"""The demo's child processes: one per Prefill TP rank and one per Decode TP rank.

Each child rebuilds the workload from the config, reports over ``events`` (a
multiprocessing queue) and exits. A child dies with its parent (PR_SET_PDEATHSIG), so an
interrupted demo leaves no orphans.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time
import traceback
from multiprocessing import shared_memory
from typing import Any

import numpy as np

from rd2h.api import KVSink, KVSource, LayerTensors, host_buffer
from rd2h.cli.demo.workload import INDEXER, MAIN_TENSORS, SCALE, DemoConfig, TensorSpec, Workload, pattern
from rd2h.layout.chunking import ChunkPlanner
from rd2h.layout.topology import base_port
from rd2h.prefill.source import DecodeEndpoint

__all__ = ["prefill_rank", "decode_rank", "main_pool_views", "main_pool_bytes", "verify"]

_PR_SET_PDEATHSIG = 1
_CLONE_NEWNET = 0x40000000
_CLONE_NEWNS = 0x00020000
_MS_REC, _MS_SLAVE, _MNT_DETACH = 0x4000, 1 << 19, 2


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the parent's cleanup still terminates us
        pass


def enter_netns(name: str) -> None:
    """Move this process into the network namespace ``ip netns add NAME`` made (needs root),
    as ``ip netns exec`` does: the network, and a private /sys that lists its interfaces
    (libraries such as UCX pick network devices from /sys/class/net).

    Shared memory, pipes and every other mount stay as they were.
    """
    libc = ctypes.CDLL(None, use_errno=True)

    def check(ret: int, what: str) -> None:
        if ret != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"network namespace {name!r}: {what}: {os.strerror(err)}")

    with open(f"/run/netns/{name}") as ns:
        check(libc.setns(ns.fileno(), _CLONE_NEWNET), "setns")
    check(libc.unshare(_CLONE_NEWNS), "unshare the mounts")
    check(libc.mount(b"none", b"/", None, _MS_REC | _MS_SLAVE, None), "make / a slave mount")
    check(libc.umount2(b"/sys", _MNT_DETACH), "unmount /sys")
    check(libc.mount(name.encode(), b"/sys", b"sysfs", 0, None), "mount its /sys")


def _child(role: str, rank: int, events: Any, body: Any, netns: str = "") -> None:
    _die_with_parent()
    try:
        if netns:
            enter_netns(netns)  # before the engine or channel opens a socket
        events.put(("result", role, rank, body()))
    except BaseException:
        events.put(("error", role, rank, traceback.format_exc()))
        raise SystemExit(1) from None


def main_pool_views(buf: memoryview, config: DemoConfig, pool_blocks: int) -> list[list[np.ndarray]]:
    """Per layer, per main tensor, a (blocks, block_bytes) view into the TP-shared pool."""
    views, offset = [], 0
    for _ in range(config.layers):
        layer = []
        for spec in MAIN_TENSORS:
            nbytes = pool_blocks * config.block_bytes(spec)
            layer.append(np.frombuffer(buf, np.uint8, nbytes, offset).reshape(pool_blocks, -1))
            offset += nbytes
        views.append(layer)
    return views


def main_pool_bytes(config: DemoConfig, pool_blocks: int) -> int:
    return config.layers * pool_blocks * sum(config.block_bytes(s) for s in MAIN_TENSORS)


# -- Prefill --------------------------------------------------------------------------------


def prefill_rank(config: DemoConfig, rank: int, events: Any, go: Any) -> None:
    _child("prefill", rank, events, lambda: _prefill(config, rank, events, go), config.prefill_netns)


def _prefill(config: DemoConfig, rank: int, events: Any, go: Any) -> dict[str, Any]:
    work = Workload.build(config)
    specs = (*MAIN_TENSORS, INDEXER, SCALE)
    slots = [
        [host_buffer((work.src_pool_blocks, config.block_bytes(s))) for s in specs]
        for _ in range(config.slots)
    ]
    layers = {
        config.layer_name(layer): LayerTensors(main=slot[:2], indexer=slot[2], scale=slot[3])
        for layer, slot in ((layer, slots[layer % config.slots]) for layer in range(config.layers))
    }
    endpoint = DecodeEndpoint(config.host, base_port(config.kv_port, 0, config.decode_tp), config.decode_tp)
    planner = ChunkPlanner(config.block_size)
    with KVSource(
        layers, block_size=config.block_size, rank=rank, tp_size=config.prefill_tp,
        engine=config.engine, engine_options=config.options_for("prefill"), reply_timeout=config.timeout,
        channel=config.channel, channel_options=dict(config.channel_options),
    ) as source:
        for req in work.requests:
            source.add_request(req.ext_id, endpoint, main_block_ids=req.src_blocks, num_tokens=req.num_tokens)
            planner.track(req.ext_id, req.num_tokens)
        events.put(("ready", "prefill", rank, None))
        go.wait()
        started = time.monotonic()
        last_ready = started
        progress = _Progress(events, rank) if rank == 0 else None
        for step in work.steps():
            chunks = {ext_id: planner.advance(ext_id, tokens) for ext_id, tokens in step.items()}
            source.schedule(step)
            for layer in range(config.layers):
                name = config.layer_name(layer)
                source.wait_for_layer_send(name)
                if config.compute_ms:  # a device computing the layer: the host thread only waits
                    time.sleep(config.compute_ms / 1e3)
                slot = slots[layer % config.slots]
                for req in work.requests:
                    chunk = chunks.get(req.ext_id)
                    if chunk is None or chunk.count == 0:
                        continue
                    positions = np.arange(chunk.lo, chunk.hi)
                    ids = req.src_blocks[chunk.lo : chunk.hi]
                    for t, spec in enumerate(specs):
                        slot[t][ids] = pattern(layer, t, req.index, positions, config.block_bytes(spec))
                source.layer_ready(name)
                last_ready = time.monotonic()
                if progress is not None:
                    progress.advance(last_ready)
        if progress is not None:
            progress.flush()
        results = source.wait_finished([r.ext_id for r in work.requests], config.timeout)
        finished = time.monotonic()
        failed = {e: r.error for e, r in results.items() if not r.ok}
        return {
            "started": started,
            "finished": finished,
            "exposed_seconds": finished - last_ready,
            "layer_seconds": list(source.layer_seconds),
            "failed": failed,
        }


class _Progress:
    """Layers announced, reported to the parent at most every ``every`` seconds: a message
    per layer wakes the queue's feeder thread and the parent, which on 2 cores took CPU
    from the very transfers the demo measures."""

    def __init__(self, events: Any, rank: int, every: float = 0.1) -> None:
        self._events, self._rank, self._every = events, rank, every
        self._pending, self._sent_at = 0, 0.0

    def advance(self, now: float) -> None:
        self._pending += 1
        if now - self._sent_at >= self._every:
            self.flush(now)

    def flush(self, now: float | None = None) -> None:
        if self._pending:
            self._events.put(("progress", "prefill", self._rank, self._pending))
            self._pending = 0
            self._sent_at = time.monotonic() if now is None else now


# -- Decode ---------------------------------------------------------------------------------


def decode_rank(config: DemoConfig, rank: int, shm_name: str, events: Any, go: Any) -> None:
    _child("decode", rank, events, lambda: _decode(config, rank, shm_name, events, go), config.decode_netns)


def _decode(config: DemoConfig, rank: int, shm_name: str, events: Any, go: Any) -> dict[str, Any]:
    shm = shared_memory.SharedMemory(shm_name)
    try:
        return _decode_into(config, rank, shm.buf, events, go)
    finally:
        try:
            shm.close()  # on success every view into it died with _decode_into's frame
        except BufferError:  # a traceback holds views: the mapping goes with the process
            pass


def _decode_into(config: DemoConfig, rank: int, pool: memoryview, events: Any, go: Any) -> dict[str, Any]:
    work = Workload.build(config)
    main = main_pool_views(pool, config, work.dst_pool_blocks)
    local = [  # rank-local: page-aligned and pre-faulted
        [host_buffer((work.dst_pool_blocks, config.block_bytes(s))) for s in (INDEXER, SCALE)]
        for _ in range(config.layers)
    ]
    for view in [v for layer in main for v in layer]:
        view.fill(0)  # pre-fault our mapping of the shared pool: first-touch faults halve the bandwidth
    layers = {
        config.layer_name(i): LayerTensors(main=main[i], indexer=local[i][0], scale=local[i][1])
        for i in range(config.layers)
    }
    with KVSink(
        layers, rank=rank, tp_size=config.decode_tp, host=config.host, kv_port=config.kv_port,
        engine=config.engine, engine_options=config.options_for("decode", len(os.sched_getaffinity(0))), channel=config.channel, channel_options=dict(config.channel_options),
    ) as sink:
        for req in work.requests:
            sink.expect(req.ext_id, main_blocks=req.dst_blocks)
        events.put(("ready", "decode", rank, None))
        go.wait()
        outcomes = sink.wait([r.ext_id for r in work.requests], config.timeout)
        finished = time.monotonic()
        failed = {e: f"{o.state.value}: {o.error}" for e, o in outcomes.items() if not o.ok}
        counters = sink.counters
    return {
        "finished": finished,
        "bytes": counters.bytes_read,
        "read_seconds": [s.read_seconds for s in counters.stats],
        "handle_seconds": [s.handle_seconds for s in counters.stats],
        "failed": failed,
        "mismatches": verify(work, local, (INDEXER, SCALE), len(MAIN_TENSORS)),
    }


def verify(work: Workload, per_layer: list[list[np.ndarray]], specs: tuple[TensorSpec, ...], first: int) -> list[str]:
    """Every destination block holds its source pattern and every other block is still zero.

    ``per_layer[layer][i]`` is the destination of tensor ``first + i`` (numbered as Prefill
    writes them: main tensors, indexer, scale).
    """
    config, problems = work.config, []
    used = np.zeros(work.dst_pool_blocks, bool)
    for req in work.requests:
        used[req.dst_blocks] = True
    for layer, tensors in enumerate(per_layer):
        for offset, (spec, arr) in enumerate(zip(specs, tensors)):
            for req in work.requests:
                want = pattern(layer, first + offset, req.index, np.arange(req.num_blocks), config.block_bytes(spec))
                if not np.array_equal(arr[req.dst_blocks], want):
                    problems.append(f"layer {layer} {spec.name} of {req.ext_id} differs")
            if arr[~used].any():
                problems.append(f"layer {layer} {spec.name}: a block outside every destination was written")
    return problems
