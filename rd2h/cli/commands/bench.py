"""``rd2h bench``: every installed transfer engine against memcpy and the bare syscall,
interleaved in one run, on an SFA and a dense layout; JSON and plots in a results folder."""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from rd2h import plugins
from rd2h.cli.commands.demo import engine_option
from rd2h.cli.json_stdout import write_json

_SHORT = {"layer_mib": 2.0, "repeat": 3}
_FULL = {"layer_mib": 8.0, "repeat": 5}


def _csv(kind: type) -> Any:
    return lambda text: [kind(v) for v in text.split(",") if v]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "bench",
        help="measure transfer engines against memcpy and process_vm_readv on this machine",
        description="Read every layer of a DeepSeek-V3.2-like SFA layout (61 layers, four tensors) and of "
        "a dense one from source processes, with one batched read per layer, through every installed "
        "engine, beside memcpy of the same bytes and a bare process_vm_readv loop, methods interleaved "
        "pass by pass. Prints medians and same-pass ratios; writes bench.json and PNG plots to --out. "
        "The defaults take about a minute; --full gives the published figures.",
    )
    parser.add_argument("--engine", action="append", default=[],
                        help="engine to measure (repeatable; default: every installed engine that can run here)")
    parser.add_argument("--engine-option", type=engine_option, action="append", default=[], metavar="[ENGINE.]KEY=VALUE",
                        help="an engine option, for every engine or, prefixed by its name, one (repeatable)")
    parser.add_argument("--layout", type=_csv(str), default=["sfa", "dense"], help="comma-separated: sfa,dense")
    parser.add_argument("--block-kib", type=_csv(int), default=[64, 16], help="main block sizes in KiB (64,16)")
    parser.add_argument("--memory", type=_csv(str), default=["shared", "thp"],
                        help="memory kinds of source and destination: shared (MAP_SHARED, 4 KiB pages), "
                        "thp (private, MADV_HUGEPAGE)")
    parser.add_argument("--threads", type=_csv(int), default=[1, 2], help="thread counts for memcpy, bare and local")
    parser.add_argument("--layers", type=int, default=61)
    parser.add_argument("--layer-mib", type=float, help=f"bytes per layer (default {_SHORT['layer_mib']:g}; --full {_FULL['layer_mib']:g})")
    parser.add_argument("--repeat", type=int, help=f"timed passes per method (default {_SHORT['repeat']}; --full {_FULL['repeat']})")
    parser.add_argument("--full", action="store_true", help="the sizes of docs/performance.md")
    parser.add_argument("--memfabric-kit", action="store_true",
                        help="re-run under memfabric's CPU test kit (tests/kit/memfabric-cpu, a source checkout) "
                        "so memfabric is measured on a machine without Ascend")
    parser.add_argument("--out", type=Path, default=Path("rd2h-bench-results"), help="results folder")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--plot-from", type=Path, metavar="BENCH_JSON",
                        help="measure nothing: redraw the plots of a recorded bench.json into --out")
    parser.add_argument("--json", action="store_true", help="print the JSON report instead of tables")
    return parser


def _engine_specs(names: list[str], options: list[tuple[str, object]], threads: list[int]) -> list[Any]:
    from rd2h.cli.benchmark import EngineSpec

    specs = []
    for name in names:
        mine: dict[str, Any] = {}
        for key, value in options:
            engine, dot, rest = key.partition(".")
            if not dot:
                mine[key] = value
            elif engine == name:
                mine[rest] = value
        spec = EngineSpec(name, mine, tuple(threads) if name == "local" and "threads" not in mine else ())
        if name == "memfabric":  # Decode hosts the config store; a fresh port a case
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                store = f"tcp://127.0.0.1:{s.getsockname()[1]}"
            spec.options = {"store_url": store, "timeout": 60.0, **mine}
            spec.decode_options = {"start_store": True}
        specs.append(spec)
    return specs


def _reexec_under_kit() -> None:
    import importlib.util

    import rd2h

    kit = Path("tests") / "kit" / "memfabric-cpu" / "kitenv.py"
    roots = (Path(rd2h.__file__).resolve().parents[1], Path.cwd())  # an editable install, or here
    path = next((root / kit for root in roots if (root / kit).exists()), roots[0] / kit)
    spec = importlib.util.spec_from_file_location("rd2h_kitenv", path)
    if spec is None or spec.loader is None or not path.exists():
        raise SystemExit(f"--memfabric-kit needs a source checkout: {path} is missing")
    kitenv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kitenv)
    env = kitenv.kit_env(sys.executable)
    env["RD2H_BENCH_UNDER_KIT"] = "1"
    argv = [a for a in sys.argv[1:] if a != "--memfabric-kit"]
    os.execve(sys.executable, [sys.executable, "-m", "rd2h.cli", *argv], env)


def run(args: argparse.Namespace) -> int:
    if args.plot_from is not None:
        from rd2h.cli.bench_report import plot_report

        try:
            plots = plot_report(args.plot_from, args.out)
        except ValueError as exc:
            raise SystemExit(f"rd2h bench --plot-from: {exc}") from exc
        print(", ".join(map(str, plots)) or "no plots: matplotlib is missing (pip install 'rd2h[bench]')")
        return 0 if plots else 1
    if args.memfabric_kit and not os.environ.get("RD2H_BENCH_UNDER_KIT"):
        _reexec_under_kit()
    from rd2h.cli.bench_report import (
        format_case,
        headline_ratios,
        machine,
        plot_cases,
        progress_bar,
        write_results,
    )
    from rd2h.cli.benchmark import Case, available_engines, make_layout, measure_case

    sizes = _FULL if args.full else _SHORT
    layer_mib = args.layer_mib if args.layer_mib is not None else sizes["layer_mib"]
    repeat = args.repeat if args.repeat is not None else sizes["repeat"]
    engines = args.engine or available_engines()
    for name in args.engine:  # an unknown name is a usage error, not a case skipped 16 times
        plugins.engine_class(name)  # BackendNotFoundError, listing what is installed
    cases = [Case(make_layout(layout, kib, layer_mib, args.layers), memory)
             for layout in args.layout for kib in args.block_kib for memory in args.memory]
    per_case = 2 * len(args.threads) + sum(len(list(s.methods())) for s in _engine_specs(engines, args.engine_option, args.threads))
    per_case += len(args.threads) if "local" in engines else 0
    started = time.monotonic()
    results = []
    bar, step = progress_bar(len(cases) * per_case * repeat)
    with bar:
        for case in cases:
            specs = _engine_specs(engines, args.engine_option, args.threads)
            results.append(measure_case(case, specs, threads=args.threads, repeat=repeat, progress=step))
    report = {
        "command": "rd2h " + " ".join(sys.argv[1:]),
        "machine": machine(),
        "under_memfabric_kit": bool(os.environ.get("RD2H_BENCH_UNDER_KIT")),
        "settings": {"engines": engines, "layer_mib": layer_mib, "repeat": repeat, "threads": args.threads,
                     "engine_options": [list(o) for o in args.engine_option]},
        "seconds": time.monotonic() - started,
        "cases": [dict(r.to_json(), ratios=headline_ratios(r)) for r in results],
    }
    path = write_results(args.out, report)
    plots = [] if args.no_plots else plot_cases(args.out, results)
    if args.json:
        write_json(args.json_out, report)
    else:
        m = report["machine"]
        print(f"rd2h bench on {m['cpu']}, {m['nproc']} CPUs, Linux {m['kernel']}, THP {m['transparent_hugepage']}")
        for r in results:
            print()
            print(format_case(r, repeat))
        print(f"\nresults: {path}" + "".join(f", {p}" for p in plots))
        if not plots and not args.no_plots:
            print("no plots: matplotlib is missing (pip install 'rd2h[bench]')")
    return 0
