"""A mapping path for same-host pulls, measured against the local engine and memcpy (issue 11's stretch).

    python bench/mapping_path.py [--layout sfa --block-kib 64 --layer-mib 8 --layers 24 --repeat 5]

The Prefill pool lives in a memfd (shmem) of a source process; Decode opens it once through
``/proc/PID/fd/N``, maps it (``MAP_POPULATE``) and copies every layer in user space with numpy
gathers (``np.take(..., out=)``, which releases the GIL) on 1 and 2 threads. Beside it, in the
same passes: the local engine reading the same memfd-backed pool (``process_vm_readv``) and
memcpy of the same bytes. No rd2h engine implements the path yet: this says what it would buy.
memfd memory is shmem, so its pages are 4 KiB unless ``shmem_enabled`` allows huge ones.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from rd2h.cli.bench_source import fill_pattern, pool
from rd2h.cli.benchmark import (
    Descriptors,
    Layout,
    engine_method,
    make_layout,
    memcpy_method,
)


def _serve(size: int) -> None:
    """Child: a patterned memfd pool registered with a Prefill local engine, until stdin ends."""
    import base64

    from rd2h.interfaces import Region
    from rd2h.plugins import load_engine

    fd = os.memfd_create("rd2h-pool")
    os.ftruncate(fd, size)
    memory = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    buf = np.frombuffer(memory, dtype=np.uint8)
    fill_pattern(buf)
    engine = load_engine("local", "prefill")
    meta = engine.register([Region(buf.ctypes.data, size)])
    print(json.dumps({"pid": os.getpid(), "fd": fd, "addr": buf.ctypes.data,
                      "metadata": base64.b64encode(meta).decode()}), flush=True)
    sys.stdin.read()
    engine.close()


class _Source:
    def __init__(self, size: int) -> None:
        import base64

        self.proc = subprocess.Popen([sys.executable, __file__, "--serve", str(size)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self.proc.stdout is not None
        hello = json.loads(self.proc.stdout.readline())
        self.pid, self.addr = hello["pid"], hello["addr"]
        self.metadata = base64.b64decode(hello["metadata"])
        self.path = f"/proc/{self.pid}/fd/{hello['fd']}"

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def mapped_copy(layout: Layout, desc: Descriptors, src: np.ndarray, dest: np.ndarray, threads: int
                ) -> tuple[Callable[[], None], Callable[[], None]]:
    """Per layer and tensor, gather the source blocks into the (consecutive) destination blocks."""
    jobs = []  # per layer: (source view, block ids, destination view) per tensor and thread
    for layer in range(layout.layers):
        parts = []
        for t, b in enumerate(layout.block_bytes):
            n = layout.blocks
            rem = desc.remote[layer][t * n:(t + 1) * n]
            base = int(rem.min())  # the tensor's first block in the pool
            view = src[base:base + n * b].reshape(n, b)
            ids = (rem - base) // b
            out = dest[int(desc.local[layer][t * n]):][: n * b].reshape(n, b)
            for part in np.array_split(np.arange(n), threads):
                if len(part):
                    parts.append((view, ids[part], out[part[0]:part[-1] + 1]))
        jobs.append(parts)

    def share(items: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> None:
        for view, ids, out in items:
            np.take(view, ids, axis=0, out=out)

    if threads == 1:
        return lambda: [share(parts) for parts in jobs] and None, lambda: None
    workers = ThreadPoolExecutor(threads - 1)

    def run() -> None:
        for parts in jobs:
            shares = [parts[i::threads] for i in range(threads)]
            futures = [workers.submit(share, s) for s in shares[1:]]
            share(shares[0])
            for f in futures:
                f.result()

    return run, workers.shutdown


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layout", default="sfa")
    parser.add_argument("--block-kib", type=int, default=64)
    parser.add_argument("--layer-mib", type=float, default=8)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        _serve(args.serve)
        return 0
    layout = make_layout(args.layout, args.block_kib, args.layer_mib, args.layers)
    desc = Descriptors(layout)
    source = _Source(layout.total_bytes)
    closers: list[Callable[[], None]] = []
    try:
        with open(source.path, "rb+") as f:  # the Prefill pool, mapped once
            mapped = np.frombuffer(mmap.mmap(f.fileno(), layout.total_bytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE),
                                   dtype=np.uint8)
        dest = pool(layout.total_bytes, "thp")
        methods: dict[str, Callable[[], None]] = {}
        for t in (1, 2):
            run, close = mapped_copy(layout, desc, mapped, dest, t)
            methods[f"mapped copy {t}t"], _ = run, closers.append(close)
        for t in (1, 2):
            m = engine_method(f"local {t}t", "local", {"threads": t}, desc, source, dest)
            methods[m.name], _ = m.run, closers.append(m.close)
        local_src = pool(layout.total_bytes, "thp")
        fill_pattern(local_src)
        m = memcpy_method(layout, local_src, dest, 2)
        methods[m.name], _ = m.run, closers.append(m.close)
        for name, run in methods.items():
            dest[:] = 0
            run()
            if not name.startswith("memcpy"):
                desc.check(dest, (0, layout.layers - 1))
        samples: dict[str, list[float]] = {name: [] for name in methods}
        names = list(methods)
        for p in range(args.repeat):
            for name in names[p % len(names):] + names[:p % len(names)]:
                started = time.perf_counter()
                methods[name]()
                samples[name].append(layout.total_bytes / (time.perf_counter() - started) / 1e9)
    finally:
        for close in closers:
            close()
        source.close()
    print(f"{layout.name} {args.block_kib} KiB, {layout.layers} layers x {layout.descriptors} descriptors "
          f"({layout.layer_bytes / 2**20:.1f} MiB), memfd source, median of {args.repeat} interleaved passes")
    for name, values in samples.items():
        print(f"  {name:<16}{statistics.median(values):>7.2f} GB/s")
    ratios = {f"{n} / memcpy 2t": statistics.median(a / b for a, b in zip(samples[n], samples["memcpy 2t"]))
              for n in names if n != "memcpy 2t"}
    ratios["mapped copy 2t / local 2t"] = statistics.median(
        a / b for a, b in zip(samples["mapped copy 2t"], samples["local 2t"]))
    for name, value in ratios.items():
        print(f"  {name:<30}{value:>6.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"samples": samples, "ratios": ratios}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
