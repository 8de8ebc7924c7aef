"""``rd2h probe``: registration and reads between two real endpoints of one transfer engine."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from rd2h.cli.commands.demo import engine_option
from rd2h.cli.json_stdout import write_json


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "probe",
        help="check that an engine registers and reads between two processes here",
        description="Start a source process (role prefill) holding three patterned, registered regions and "
        "read from it here (role decode), with no rd2h scheduling involved. Checks: registration, connect, "
        "a single read, a batched read, a read outside the registered regions (must be refused), bandwidth, "
        "and a read after the source is killed (must fail). Every engine call is bounded by --timeout. "
        "Exits 0 if every check passes, 1 if one fails, 2 for bad arguments or an engine that cannot run here.",
    )
    parser.add_argument("--engine", default="local", help="transfer engine (see `rd2h backends`; default local)")
    parser.add_argument("--engine-option", type=engine_option, action="append", default=[],
                        metavar="KEY=VALUE", help="an option for both ends (repeatable)")
    parser.add_argument("--prefill-option", type=engine_option, action="append", default=[],
                        metavar="KEY=VALUE", help="an option for the source end only; overrides --engine-option")
    parser.add_argument("--decode-option", type=engine_option, action="append", default=[],
                        metavar="KEY=VALUE", help="an option for the reading end only; overrides --engine-option")
    parser.add_argument("--size-mib", type=int, default=64, help="source size and bandwidth read (default 64)")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds any one engine call may take (default 30)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of one line per check")
    return parser


def run(args: argparse.Namespace) -> int:
    from rd2h.cli.probe import CHECKS, CheckResult, ProbeConfig, run_probe

    shared = dict(args.engine_option)
    config = ProbeConfig(
        engine=args.engine, prefill_options={**shared, **dict(args.prefill_option)},
        decode_options={**shared, **dict(args.decode_option)}, size_mib=args.size_mib, timeout=args.timeout,
    )  # fmt: skip

    def show(result: CheckResult) -> None:
        if result.name == CHECKS[0]:  # here, not earlier: an engine that cannot run prints only the error
            print(f"rd2h probe: engine {config.engine}, {config.size_mib} MiB source in 3 regions, "
                  f"{config.timeout:g} s per engine call")
        print(f"  {'PASS' if result.ok else 'FAIL'}  {result.name:<13} {result.seconds:6.2f} s  {result.detail}",
              flush=True)

    report = run_probe(config, progress=None if args.json else show)
    if args.json:
        write_json(args.json_out, report.to_json())
    else:
        print(f"bandwidth: {'not measured' if report.gbps is None else f'{report.gbps:.2f} GB/s'}")
        failed = sum(not c.ok for c in report.checks)
        print(f"all {len(CHECKS)} checks passed" if report.ok else f"{failed} of {len(CHECKS)} checks failed")
    status = 0 if report.ok else 1
    if report.stuck:
        # The stuck call sits in the engine and cannot be stopped; interpreter shutdown (or the
        # engine's own exit handlers) could wait for it forever, so leave without them.
        print(f"rd2h probe: still running inside the engine: {', '.join(report.stuck)}; exiting without it",
              file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status
