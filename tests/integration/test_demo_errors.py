"""Demo: a Decode rank that fails reports its real reason, not a BufferError."""

from __future__ import annotations

import gc
import multiprocessing as mp
from multiprocessing import shared_memory

from rd2h.cli.demo import ranks
from rd2h.cli.demo.workload import DemoConfig, Workload


def _run_decode(config: DemoConfig, name: str) -> str:
    ctx = mp.get_context("spawn")
    events, go = ctx.Queue(), ctx.Event()
    go.set()
    try:
        ranks._decode(config, 0, name, events, go)
    except BaseException as exc:  # noqa: BLE001 - what the child's traceback would end with
        return type(exc).__name__
    return "no error"


def test_decode_rank_failure_reason_is_not_masked(kv_port: int) -> None:
    config = DemoConfig(prefill_tp=1, decode_tp=1, layers=2, requests=1, max_tokens=64,
                        block_size=16, chunk_tokens=64, slots=1, kv_port=kv_port, timeout=0.5)
    work = Workload.build(config)
    pool = shared_memory.SharedMemory(create=True, size=ranks.main_pool_bytes(config, work.dst_pool_blocks))
    try:
        # No Prefill runs, so sink.wait times out; the child reports the traceback's last
        # line, which should name the TimeoutError, not the shm close in _decode's finally.
        raised = _run_decode(config, pool.name)
        gc.collect()
    finally:
        pool.close()
        pool.unlink()
    assert raised in ("TimeoutError", "WaitTimeout"), f"the rank's failure surfaced as {raised}"
