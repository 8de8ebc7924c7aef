"""pytest-benchmark view of bench/local_engine.py (smaller: 8 layers x 512 x 64 KiB).

    pytest bench/test_bench_local.py --benchmark-enable     # timed, grouped for comparison
    pytest bench/test_bench_local.py                        # once, as a correctness test

The methods share one source process and one destination; see local_engine.py.
"""

from __future__ import annotations

import pytest

from local_engine import Setup, bare_pvr, engine_reads, memcpy

LAYERS, BLOCKS, BLOCK_LEN = 8, 512, 64 << 10


@pytest.fixture(scope="module")
def setup():
    s = Setup(LAYERS, BLOCKS, BLOCK_LEN)
    yield s
    s.close()


def _bench(benchmark, fn, setup: Setup, check: bool) -> None:
    benchmark.group = f"local engine: {LAYERS} layers x {BLOCKS} x {BLOCK_LEN >> 10} KiB"
    benchmark.extra_info["bytes"] = setup.total
    setup.dest[:] = 0
    benchmark.pedantic(fn, rounds=5, iterations=1, warmup_rounds=1)
    if check:
        setup.verify()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("method", [engine_reads, bare_pvr, memcpy], ids=["engine", "bare-pvr", "memcpy"])
def test_read_layers(benchmark, setup, method, threads):
    run, close = method(setup, threads)
    try:
        _bench(benchmark, run, setup, check=method is not memcpy)
    finally:
        close()
