"""The wire codec on its hot path: one layer's read_ready_batch.

256 requests x 512 main block ids + 512 indexer block ids (262,144 ids in one ~1 MB frame),
ids drawn at random from a 128 Ki-block pool so that most need a multi-byte msgpack integer,
as in a long-running server. Run ``pytest bench/test_bench_codec.py --benchmark-enable`` to
measure; with the project's default ``--benchmark-disable`` each case runs once as a test and
still prints its figure, timed by hand.

The figure of merit is ns per block id (main and indexer ids both counted); the target for the
round trip (encode + decode with full validation) is under 100 ns. For scale, the same run
reports bare ``msgpack.packb`` + ``msgpack.unpackb`` of the same structure, with no types and no
validation: the floor any msgpack codec in Python pays.
"""

from __future__ import annotations

import platform
import time

import msgpack
import numpy as np
import pytest

from rd2h.wire.protocol import ReadReadyBatch, ReadRequest, decode_request, encode

REQUESTS = 256
BLOCKS = 512
IDS = REQUESTS * BLOCKS * 2  # main + indexer
POOL = 1 << 17


def batch() -> ReadReadyBatch:
    rng = np.random.default_rng(11)
    reqs = tuple(
        ReadRequest(
            f"cmpl-{r:08x}-0",
            tuple(rng.integers(0, POOL, BLOCKS).tolist()),
            tuple(rng.integers(0, POOL, BLOCKS).tolist()),
            main_start_block=BLOCKS * (r % 4),
            indexer_start_block=BLOCKS * (r % 4),
        )
        for r in range(REQUESTS)
    )
    return ReadReadyBatch(7, "model.layers.7.self_attn.attn", reqs, ("cmpl-00000000-0",), 1, 2)


MSG = batch()
DATA = encode(MSG)
RAW = msgpack.unpackb(DATA)


def bare_round_trip() -> object:
    return msgpack.unpackb(msgpack.packb(RAW))


CASES = {
    "round-trip": lambda: decode_request(encode(MSG)),
    "encode": lambda: encode(MSG),
    "decode": lambda: decode_request(DATA),
    "bare-msgpack-round-trip": bare_round_trip,
}


def seconds_per_call(benchmark, run) -> float:
    if benchmark.stats is not None and not getattr(benchmark, "disabled", False):
        return float(benchmark.stats.stats.min)
    times = []  # benchmarking disabled: time a few runs ourselves so the figure still prints
    for _ in range(7):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return min(times)


@pytest.mark.parametrize("case", list(CASES))
def test_bench_codec(benchmark, case):
    run = CASES[case]
    result = benchmark(run)
    if case in ("round-trip", "decode"):
        assert result == MSG
    elif case == "encode":
        assert result == DATA
    else:
        assert result == RAW
    ns = seconds_per_call(benchmark, run) * 1e9 / IDS
    benchmark.extra_info.update(
        case=case,
        requests=REQUESTS,
        ids_per_request=2 * BLOCKS,
        frame_bytes=len(DATA),
        ns_per_block_id=round(ns, 1),
        python=platform.python_version(),
        msgpack=".".join(map(str, msgpack.version)),
        machine=platform.processor() or platform.machine(),
    )
    print(f"\n{case}: {ns:.1f} ns per block id ({IDS} ids, {len(DATA)} bytes)")
