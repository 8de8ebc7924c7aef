"""memfabric (HOST_TCP) next to the local engine and memcpy, measured in one run.

    python bench/memfabric_vs_local.py [--layers 16 --blocks 512 --block-kib 64 --repeat 5 --json out.json]

The same workload for both engines (``rd2h.cli.benchmark.measure_case``): a source process holds
``layers`` x ``blocks`` blocks; Decode reads each layer with one batched read of its blocks in
a random order, checked byte for byte before timing. memcpy of the same bytes on one and two
threads is measured in the same run, interleaved; the ratios to it are the result.

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

    from rd2h.cli.bench_report import headline_ratios
    from rd2h.cli.benchmark import Case, EngineSpec, Layout, measure_case

    layout = Layout("dense", args.layers, args.blocks, (args.block_kib << 10,))
    mf = {"store_url": f"tcp://127.0.0.1:{_free_port()}", "timeout": 60.0}
    engines = [EngineSpec("local", threads=(1,)), EngineSpec("memfabric", mf, decode_options={"start_store": True})]
    result = measure_case(Case(layout, "thp"), engines, threads=(1, 2), repeat=args.repeat)
    if result.skipped:
        raise SystemExit(f"not measured: {result.skipped}")
    ratios = headline_ratios(result)
    ratios["memfabric / local 1t"] = result.ratio("memfabric", "local 1t")

    under_kit = bool(os.environ.get("RD2H_BENCH_UNDER_KIT"))
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Linux {platform.release()}, "
          f"Python {platform.python_version()}, numpy {np.__version__}, "
          f"memfabric-hybrid {_version('memfabric-hybrid')}{' (CPU test kit: HOST_TCP on loopback)' if under_kit else ''}")  # fmt: skip
    print(f"{layout.layers} layers x {layout.blocks} blocks x {args.block_kib} KiB = "
          f"{layout.total_bytes / 2**30:.2f} GiB per pass, one read per layer, median of {args.repeat} interleaved passes")  # fmt: skip
    print(f"{'method':<22}{'GB/s':>7}  passes (GB/s)")
    for name, passes in result.samples.items():
        print(f"{name:<22}{result.median(name):>7.2f}  " + " ".join(f"{p:.2f}" for p in passes))
    for name, value in ratios.items():
        print(f"{name:<30}{value:>6.2f}")
    if args.json:
        report = {"config": vars(args), "under_cpu_kit": under_kit, "case": result.to_json(), "ratios": ratios}
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "?"


if __name__ == "__main__":
    sys.exit(main())
