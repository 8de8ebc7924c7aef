"""memfabric (HOST_TCP) next to the local engine and memcpy, measured in one run.

    python bench/memfabric_vs_local.py [--layers 16 --blocks 512 --block-kib 64 --repeat 5 --json out.json]

The same workload for both engines (``rd2h.cli.benchmark.measure_engine``): a peer process holds
``layers`` x ``blocks`` blocks; Decode reads each layer with one batched read of its blocks in
a random order, and the last layer is checked byte for byte. memcpy of the same bytes on one
and two threads is measured in the same run; the ratios to it are the result.

memfabric needs its Ascend environment from process start. On a machine without one this
script re-runs itself under the CPU test kit (tests/kit/memfabric-cpu, TEST-ONLY), which it
builds if needed: then the figures are memfabric's host TCP path over loopback.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import socket
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KITENV = ROOT / "tests" / "kit" / "memfabric-cpu" / "kitenv.py"


def _reexec_under_kit() -> None:
    spec = importlib.util.spec_from_file_location("rd2h_kitenv", KITENV)
    if spec is None or spec.loader is None:
        raise SystemExit(f"memfabric cannot run here and the CPU test kit is missing ({KITENV})")
    kitenv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kitenv)
    env = kitenv.kit_env(sys.executable)
    env["RD2H_BENCH_UNDER_KIT"] = "1"
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=512)
    parser.add_argument("--block-kib", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)

    from rd2h_memfabric import MemFabricEngine

    available = MemFabricEngine.availability()
    if not available.ok:
        if os.environ.get("RD2H_BENCH_UNDER_KIT"):
            raise SystemExit(f"memfabric is unavailable even under the CPU kit: {available.reason}")
        _reexec_under_kit()

    import numpy as np

    from rd2h.cli.benchmark import BenchConfig, measure_engine, measure_memcpy

    config = BenchConfig(layers=args.layers, blocks=args.blocks, block_bytes=args.block_kib << 10, repeat=args.repeat)
    store = f"tcp://127.0.0.1:{_free_port()}"
    mf = {"store_url": store, "timeout": 60.0}
    rows = [
        measure_memcpy(config, 1),
        measure_memcpy(config, 2),
        measure_engine("local", config),
        measure_engine("memfabric", config, options={"prefill": mf, "decode": {**mf, "start_store": True}}),
    ]
    gbps = {row.name: row.gbps for row in rows}
    one, two = gbps["memcpy, 1 thread"], gbps["memcpy, 2 threads"]
    local, memfabric = gbps["engine local"], gbps["engine memfabric"]

    under_kit = bool(os.environ.get("RD2H_BENCH_UNDER_KIT"))
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Linux {platform.release()}, "
          f"Python {platform.python_version()}, numpy {np.__version__}, "
          f"memfabric-hybrid {_version('memfabric-hybrid')}{' (CPU test kit: HOST_TCP on loopback)' if under_kit else ''}")  # fmt: skip
    print(f"{config.layers} layers x {config.blocks} blocks x {args.block_kib} KiB = "
          f"{config.total_bytes / 2**30:.2f} GiB per pass, one read per layer, median of {config.repeat}")  # fmt: skip
    print(f"{'method':<22}{'GB/s':>7}{'/memcpy 1t':>12}{'/memcpy 2t':>12}  verified  passes (GB/s)")
    for row in rows:
        passes = " ".join(f"{p:.2f}" for p in row.passes)
        print(f"{row.name:<22}{row.gbps:>7.2f}{row.gbps / one:>12.2f}{row.gbps / two:>12.2f}  {str(row.verified):<8}  {passes}")
    print(f"memfabric / local: {memfabric / local:.2f}")
    if args.json:
        result = {
            "config": vars(args),
            "under_cpu_kit": under_kit,
            "rows": [{"name": r.name, "gbps": r.gbps, "passes": r.passes, "verified": r.verified} for r in rows],
            "ratios": {"local/memcpy1t": local / one, "memfabric/memcpy1t": memfabric / one,
                       "memfabric/local": memfabric / local},
        }  # fmt: skip
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0 if all(r.verified for r in rows) else 1


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "?"


if __name__ == "__main__":
    sys.exit(main())
