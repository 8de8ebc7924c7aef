"""``rd2h backends``: the installed transfer engines and control channels, and whether each
can run on this machine (and if not, why and what to install)."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rd2h.plugins import BackendInfo

HEADERS = ("KIND", "NAME", "DISTRIBUTION", "VERSION", "AVAILABLE", "WHY NOT")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "backends",
        help="list installed transfer engines and control channels",
        description="List the installed transfer engines and control channels, and whether each can run here.",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    return parser


def run(args: argparse.Namespace) -> int:
    from rd2h.cli.json_stdout import write_json
    from rd2h.plugins import list_backends

    backends = list_backends()
    if args.json:
        write_json(args.json_out, [dataclasses.asdict(b) for b in backends], indent=2)
    elif not backends:
        print("no backends installed; the defaults are: pip install rd2h-zmq rd2h-local")
    else:
        print(format_table(backends))
    return 0


def format_table(backends: Sequence[BackendInfo]) -> str:
    rows = [HEADERS] + [
        (b.kind, b.name, b.distribution, b.version, "yes" if b.available else "no", b.reason) for b in backends
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEADERS) - 1)]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[-1] for row in rows]
    return "\n".join(line.rstrip() for line in lines)
