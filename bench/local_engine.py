"""Local engine throughput next to its limits, measured in one run.

    python bench/local_engine.py [--layers 64 --blocks 512 --block-kib 64 --repeat 5 --json out.json]

A child process holds the source: ``layers`` contiguous layer tensors of ``blocks`` blocks
(default 64 x 512 x 64 KiB = 2 GiB), pre-faulted. Per layer, Decode reads the layer's
blocks in a random order into a pre-faulted destination, one call per layer, by:

- ``bare pvr``: one ``process_vm_readv`` with all the layer's iovecs (prebuilt, no rd2h code);
  with 2 threads, two calls of half the iovecs each in two threads;
- ``engine``: ``LocalEngine.read_batch`` with the same descriptors (validation, region
  checks and iovec building included);
- ``memcpy``: ``ctypes.memmove`` of each layer's bytes inside this process, 1 and 2 threads.

Methods are interleaved and each figure is the median of ``repeat`` passes. Ratios, not
bare times, are the result: engine / bare (the engine's overhead) and engine / memcpy.
Needs about 3x the source size in memory (source, destination, memcpy source).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from rd2h.api import host_buffer  # page-aligned and pre-faulted

I64 = np.int64


def _serve(size: int) -> None:
    """Child: hold ``size`` bytes of source, registered with a prefill engine, until stdin ends."""
    from rd2h_local import LocalEngine

    from rd2h.interfaces import Region

    memory = mmap.mmap(-1, size)
    src = np.frombuffer(memory, dtype=np.uint64)
    src[:] = np.arange(len(src), dtype=np.uint64)  # faults every page in; checkable pattern
    with LocalEngine("prefill") as engine:
        meta = engine.register([Region(src.ctypes.data, size)])
        print(json.dumps({"addr": src.ctypes.data, "metadata": meta.hex()}), flush=True)
        sys.stdin.read()


class Source:
    """The child process that holds the source."""

    def __init__(self, size: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--serve", str(size)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        assert self.proc.stdout is not None
        hello = json.loads(self.proc.stdout.readline())
        self.addr: int = hello["addr"]
        self.metadata = bytes.fromhex(hello["metadata"])
        self.pid = self.proc.pid

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


class Setup:
    """Source, destination and per-layer descriptors shared by every method."""

    def __init__(self, layers: int, blocks: int, block_len: int, seed: int = 0) -> None:
        self.layers, self.blocks, self.block_len = layers, blocks, block_len
        self.layer_bytes = blocks * block_len
        self.total = layers * self.layer_bytes
        self.source = Source(self.total)
        self.dest = host_buffer(self.total)
        self.dest_addr = self.dest.ctypes.data
        rng = np.random.default_rng(seed)
        self.local, self.remote = [], []
        offsets = np.arange(blocks, dtype=I64) * block_len
        for layer in range(layers):
            base = layer * self.layer_bytes
            self.local.append(self.dest_addr + base + offsets)
            self.remote.append(self.source.addr + base + rng.permutation(offsets))
        self.lengths = np.full(blocks, block_len, dtype=I64)
        self._memcpy_src: np.ndarray | None = None

    def memcpy_src(self) -> np.ndarray:
        if self._memcpy_src is None:
            self._memcpy_src = host_buffer(self.total)
        return self._memcpy_src

    def verify(self) -> None:
        """The destination holds what the source pattern says (after any read method)."""
        words = self.dest.view(np.uint64).reshape(self.layers, self.blocks, -1)
        per_block = self.block_len // 8
        for layer in (0, self.layers - 1):
            src_ids = (self.remote[layer] - self.source.addr) // self.block_len
            expected = src_ids[:, None] * per_block + np.arange(per_block)
            if not np.array_equal(words[layer], expected.astype(np.uint64)):
                raise AssertionError(f"layer {layer}: destination does not match the source")

    def close(self) -> None:
        self.source.close()


Method = tuple[Callable[[], None], Callable[[], None]]  # (run one pass, close)


def _nothing() -> None:
    pass


def bare_pvr(setup: Setup, threads: int) -> Method:
    from rd2h_local import _sys

    _sys._load()
    fn = _sys.process_vm_readv
    pid = setup.source.pid
    parts = []  # per layer, per thread: (local iov, remote iov, count, bytes)
    for loc, rem in zip(setup.local, setup.remote):
        layer = []
        for idx in np.array_split(np.arange(setup.blocks), threads):
            lv = np.stack([loc[idx], setup.lengths[idx]], axis=1).astype(np.uint64)
            rv = np.stack([rem[idx], setup.lengths[idx]], axis=1).astype(np.uint64)
            layer.append((lv, rv, len(idx), int(setup.lengths[idx].sum())))
        parts.append(layer)

    def one(lv: np.ndarray, rv: np.ndarray, n: int, want: int) -> None:
        if fn(pid, lv.ctypes.data, n, rv.ctypes.data, n, 0) != want:
            raise OSError(ctypes.get_errno(), "process_vm_readv")

    if threads == 1:
        return lambda: [one(*layer[0]) for layer in parts] and None, _nothing

    pool = ThreadPoolExecutor(threads - 1)

    def run() -> None:
        for layer in parts:
            futures = [pool.submit(one, *p) for p in layer[1:]]
            one(*layer[0])
            for f in futures:
                f.result()

    return run, pool.shutdown


def engine_reads(setup: Setup, threads: int) -> Method:
    from rd2h_local import LocalEngine

    from rd2h.interfaces import Region

    engine = LocalEngine("decode", threads=threads)
    engine.register([Region(setup.dest_addr, setup.total)])
    session = engine.connect(setup.source.metadata)

    def run() -> None:
        for loc, rem in zip(setup.local, setup.remote):
            engine.read_batch(session, loc, rem, setup.lengths)

    return run, engine.close


def memcpy(setup: Setup, threads: int) -> Method:
    src = setup.memcpy_src().ctypes.data
    dst, step = setup.dest_addr, setup.layer_bytes
    if threads == 1:
        return lambda: [ctypes.memmove(dst + i * step, src + i * step, step) for i in range(setup.layers)] and None, _nothing
    pool = ThreadPoolExecutor(threads - 1)
    share = step // threads

    def run() -> None:
        for i in range(setup.layers):
            base = i * step
            futures = [pool.submit(ctypes.memmove, dst + base + t * share, src + base + t * share, share) for t in range(1, threads)]
            ctypes.memmove(dst + base, src + base, share)
            for f in futures:
                f.result()

    return run, pool.shutdown


def measure(setup: Setup, repeat: int, threads: tuple[int, ...] = (1, 2)) -> dict[str, float]:
    """Median GB/s per method; methods interleaved pass by pass."""
    made: dict[str, Method] = {}
    for t in threads:
        made[f"bare pvr {t}t"] = bare_pvr(setup, t)
        made[f"engine {t}t"] = engine_reads(setup, t)
    try:
        for name, (run, _) in made.items():  # each read method must be right before it is timed
            setup.dest[:] = 0
            run()
            setup.verify()
        for t in threads:
            made[f"memcpy {t}t"] = memcpy(setup, t)
        samples: dict[str, list[float]] = {name: [] for name in made}
        for _ in range(repeat):
            for name, (run, _) in made.items():
                start = time.perf_counter()
                run()
                samples[name].append(setup.total / (time.perf_counter() - start) / 1e9)
    finally:
        for _, close in made.values():
            close()
    return {name: statistics.median(v) for name, v in samples.items()}


def threshold_sweep(setup: Setup, repeat: int) -> dict[int, tuple[float, float]]:
    """GB/s of one ``read_batch`` of N blocks, 1 thread vs 2 threads, by batch size:
    where splitting starts to pay is what ``parallel_threshold_bytes`` should be."""
    from rd2h_local import LocalEngine

    from rd2h.interfaces import Region

    engines = [LocalEngine("decode", threads=t, parallel_threshold_bytes=0) for t in (1, 2)]
    try:
        sessions = []
        for e in engines:
            e.register([Region(setup.dest_addr, setup.total)])
            sessions.append(e.connect(setup.source.metadata))
        out = {}
        n = 1
        while n <= setup.blocks:
            loc, rem, ln = setup.local[0][:n], setup.remote[0][:n], setup.lengths[:n]
            rates = []
            for e, s in zip(engines, sessions):
                times = []
                for _ in range(max(repeat, 5) * max(1, 64 // n)):
                    start = time.perf_counter()
                    e.read_batch(s, loc, rem, ln)
                    times.append(time.perf_counter() - start)
                rates.append(n * setup.block_len / statistics.median(times) / 1e9)
            out[n * setup.block_len] = (rates[0], rates[1])
            n *= 2
        return out
    finally:
        for e in engines:
            e.close()


def machine() -> dict[str, str]:
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "cpu": cpu,
        "cores": str(os.cpu_count()),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "numpy": np.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=512)
    parser.add_argument("--block-kib", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--sweep", action="store_true", help="also time one read_batch by size, 1 vs 2 threads")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        _serve(args.serve)
        return 0
    setup = Setup(args.layers, args.blocks, args.block_kib << 10)
    try:
        gbps = measure(setup, args.repeat)
        sweep = threshold_sweep(setup, args.repeat) if args.sweep else {}
    finally:
        setup.close()
    info = machine()
    print(f"{info['cpu']}, {info['cores']} cores, Linux {info['kernel']}, Python {info['python']}, numpy {info['numpy']}")
    print(f"{args.layers} layers x {args.blocks} blocks x {args.block_kib} KiB = {setup.total / 2**30:.2f} GiB per pass, "
          f"one read per layer, median of {args.repeat}")  # fmt: skip
    print(f"{'method':<14}{'GB/s':>8}")
    for name, v in gbps.items():
        print(f"{name:<14}{v:>8.2f}")
    ratios = {
        "engine/bare 1t": gbps["engine 1t"] / gbps["bare pvr 1t"],
        "engine/bare 2t": gbps["engine 2t"] / gbps["bare pvr 2t"],
        "engine 2t/memcpy 2t": gbps["engine 2t"] / gbps["memcpy 2t"],
        "engine 1t/memcpy 1t": gbps["engine 1t"] / gbps["memcpy 1t"],
    }
    for name, v in ratios.items():
        print(f"{name:<22}{v:>6.2f}")
    if sweep:
        print(f"\none read_batch by size (threshold 0): {'bytes':>10}{'1t GB/s':>9}{'2t GB/s':>9}")
        for size, (one, two) in sweep.items():
            print(f"{'':<36}{size:>10}{one:>9.2f}{two:>9.2f}")
    if args.json:
        result = {"machine": info, "config": vars(args), "gbps": gbps, "ratios": ratios, "sweep": sweep}
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
