"""Transfer-engine throughput next to memcpy, measured in the same run (``rd2h bench``).

A peer process (``rd2h.cli.peer``) holds ``layers`` layers of ``blocks`` blocks in one
registered region. This process reads each layer with one ``read_batch`` of the layer's
blocks in a random order into a pre-faulted destination, as Decode does, and copies the
same number of bytes with memcpy on one and on two threads. Ratios to memcpy are the
result; bare GB/s on a shared machine mean little.
"""

from __future__ import annotations

import ctypes
import statistics
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rd2h import plugins
from rd2h.api import host_buffer
from rd2h.interfaces import Region
from rd2h.cli.peer import PeerProcess

__all__ = ["BenchConfig", "BenchRow", "measure_engine", "measure_memcpy"]


@dataclass(frozen=True)
class BenchConfig:
    layers: int = 16
    blocks: int = 512
    block_bytes: int = 64 << 10
    repeat: int = 3
    seed: int = 0

    @property
    def layer_bytes(self) -> int:
        return self.blocks * self.block_bytes

    @property
    def total_bytes(self) -> int:
        return self.layers * self.layer_bytes


@dataclass
class BenchRow:
    name: str
    gbps: float  # median over the passes
    passes: list[float] = field(default_factory=list)
    verified: bool = True


def _median_rate(nbytes: int, run: Callable[[], None], repeat: int) -> tuple[float, list[float]]:
    rates = []
    for _ in range(repeat):
        started = time.perf_counter()
        run()
        rates.append(nbytes / (time.perf_counter() - started) / 1e9)
    return statistics.median(rates), rates


def measure_memcpy(config: BenchConfig, threads: int) -> BenchRow:
    """memmove of ``layers`` x one layer's bytes, split over ``threads`` threads."""
    src = host_buffer(config.layer_bytes)
    dst = host_buffer(config.layer_bytes)
    part = config.layer_bytes // threads
    with ThreadPoolExecutor(threads) as pool:

        def copy(i: int) -> None:
            ctypes.memmove(dst.ctypes.data + i * part, src.ctypes.data + i * part, part)

        def run() -> None:
            for _ in range(config.layers):
                list(pool.map(copy, range(threads)))

        gbps, passes = _median_rate(part * threads * config.layers, run, config.repeat)
    return BenchRow(f"memcpy, {threads} thread{'s' if threads > 1 else ''}", gbps, passes)


def measure_engine(
    name: str,
    config: BenchConfig,
    *,
    options: Mapping[str, Mapping[str, Any]] | None = None,
    env: Mapping[str, str] | None = None,
) -> BenchRow:
    """One batched read per layer through engine ``name``, from a peer process.

    ``options`` maps a role ("prefill" for the peer, "decode" for the reader) to engine
    options. The last pass is checked byte for byte against the peer's pattern.
    """
    options = options or {}
    plugins.engine_class(name)  # an unknown engine is an error here, not a dead peer process
    rng = np.random.default_rng(config.seed)
    with PeerProcess(name, sizes=[config.total_bytes], seed=config.seed,
                     options=options.get("prefill", {}), env=env) as peer:
        engine = plugins.load_engine(name, "decode", **dict(options.get("decode", {})))
        try:
            dst = host_buffer(config.layer_bytes)  # page-aligned and pre-faulted, as a real pool
            engine.register([Region(dst.ctypes.data, dst.nbytes)])
            session = engine.connect(peer.metadata)
            base = peer.regions[0][0]
            orders = [rng.permutation(config.blocks) for _ in range(config.layers)]
            local = dst.ctypes.data + np.arange(config.blocks, dtype=np.int64) * config.block_bytes
            lengths = np.full(config.blocks, config.block_bytes, dtype=np.int64)
            remotes = [(base + (layer * config.blocks + order) * config.block_bytes).astype(np.int64)
                       for layer, order in enumerate(orders)]

            def run() -> None:
                for remote in remotes:
                    engine.read_batch(session, local, remote, lengths)

            gbps, passes = _median_rate(config.total_bytes, run, config.repeat)
            last = config.layers - 1
            want = peer.expected(0).reshape(config.layers, config.blocks, config.block_bytes)[last, orders[last]]
            verified = bool(np.array_equal(dst.reshape(config.blocks, config.block_bytes), want))
        finally:
            engine.close()
    return BenchRow(f"engine {name}", gbps, passes, verified)
