"""``rd2h bench``: transfer-engine throughput beside memcpy measured in the same run."""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
from typing import Any

from rd2h.cli.commands.demo import engine_option


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "bench",
        help="measure transfer engines against memcpy on this machine",
        description="Read LAYERS x BLOCKS x BLOCK-KIB from a peer process with one batched read per "
        "layer, through each engine given, and report GB/s beside memcpy (1 and 2 threads) "
        "measured in the same run.",
    )
    parser.add_argument("--engine", action="append", default=[], help="engine to measure (repeatable; default local)")
    parser.add_argument("--engine-option", type=engine_option, action="append", default=[],
                        metavar="KEY=VALUE", help="an option for every engine measured (repeatable)")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=512)
    parser.add_argument("--block-kib", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3, help="passes per method; the median is shown")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return parser


def run(args: argparse.Namespace) -> int:
    from rd2h.cli.benchmark import BenchConfig, measure_engine, measure_memcpy

    config = BenchConfig(args.layers, args.blocks, args.block_kib << 10, args.repeat)
    options = dict(args.engine_option)
    rows = []
    for name in args.engine or ["local"]:
        print(f"  measuring engine {name} ...", file=sys.stderr, flush=True)
        rows.append(measure_engine(name, config, options={"prefill": options, "decode": options}))
    print("  measuring memcpy ...", file=sys.stderr, flush=True)
    limits = [measure_memcpy(config, 1), measure_memcpy(config, 2)]
    limit = max(r.gbps for r in limits)
    if args.json:
        report = {
            "config": dataclasses.asdict(config),
            "machine": {"cpus": _cpus(), "python": platform.python_version(), "system": platform.platform()},
            "rows": [dict(dataclasses.asdict(r), ratio_to_memcpy=r.gbps / limit) for r in rows + limits],
        }
        json.dump(report, sys.stdout)
        sys.stdout.write("\n")
    else:
        size = config.total_bytes / (1 << 30)
        print(f"rd2h bench: {config.layers} layers x {config.blocks} blocks x {config.block_bytes >> 10} KiB "
              f"({size:.2f} GiB), one read_batch per layer, median of {config.repeat}; {_cpus()} CPUs")
        print(f"  {'method':<24} {'GB/s':>7} {'x best memcpy':>14}  verified")
        for r in rows + limits:
            print(f"  {r.name:<24} {r.gbps:>7.2f} {r.gbps / limit:>14.2f}  {'yes' if r.verified else 'NO'}")
    return 0 if all(r.verified for r in rows) else 1


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0))
