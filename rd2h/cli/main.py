"""The ``rd2h`` command line.

Each subcommand is a module in ``rd2h.cli.commands`` with two functions::

    def add_parser(subparsers) -> argparse.ArgumentParser   # adds and returns its parser
    def run(args: argparse.Namespace) -> int                  # the exit status

and is listed once in ``COMMANDS``. Command modules are imported to build the parser, so
they import anything heavy inside ``run``.

A command with ``--json`` finds ``args.json_out``: the only stream that reaches stdout (see
``rd2h.cli.json_stdout``). An ``RD2HError`` escaping a command prints one line, ``rd2h: error: ...``, and exits 2;
``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from rd2h import __version__
from rd2h.cli.json_stdout import reserve_stdout_for_json
from rd2h.errors import RD2HError

__all__ = ["COMMANDS", "build_parser", "main"]

#: module names under rd2h.cli.commands, in the order ``rd2h --help`` lists them
COMMANDS: tuple[str, ...] = ("demo", "bench", "probe", "backends", "proxy")

EXIT_ERROR = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rd2h", description="Layer-by-layer pull of LLM KV cache from Prefill to Decode."
    )
    parser.add_argument("--version", action="version", version=f"rd2h {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    subparsers = parser.add_subparsers(title="commands", dest="command", metavar="COMMAND")
    for name in COMMANDS:
        module = importlib.import_module(f"rd2h.cli.commands.{name}")
        sub = module.add_parser(subparsers)
        # also accepted after the command; SUPPRESS keeps a value given before it
        sub.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        sub.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_ERROR
    if getattr(args, "json", False):
        args.json_out = reserve_stdout_for_json()
    try:
        return int(args._run(args))
    except RD2HError as exc:
        if args.debug:
            raise
        message = " ".join(str(exc).split()) or type(exc).__name__
        print(f"rd2h: error: {message}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
