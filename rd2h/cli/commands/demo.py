"""``rd2h demo``: a disaggregated deployment on this machine, verified byte for byte."""

from __future__ import annotations

import argparse
import json
from typing import Any


def engine_option(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "demo",
        help="run Prefill and Decode ranks as processes here and verify every byte",
        description="Start a disaggregated deployment on this machine (Prefill and Decode TP ranks as "
        "separate processes, a DeepSeek-V3.2-like SFA layout), pull every layer, verify every "
        "destination byte and print a summary. Exits non-zero if anything did not verify.",
    )
    parser.add_argument("--prefill-tp", type=int, default=4, help="Prefill TP size (default 4)")
    parser.add_argument("--decode-tp", type=int, default=2, help="Decode TP size (default 2)")
    parser.add_argument("--layers", type=int, default=16, help="logical layers (default 16)")
    parser.add_argument("--requests", type=int, default=8, help="requests (default 8)")
    parser.add_argument("--max-tokens", type=int, default=2048, help="longest prompt (default 2048)")
    parser.add_argument("--block-size", type=int, default=64, help="tokens per block (default 64)")
    parser.add_argument("--chunk-tokens", type=int, default=1024, help="chunked prefill: tokens per step")
    parser.add_argument("--slots", type=int, default=2, help="physical Prefill buffers reused across layers")
    parser.add_argument("--engine", default="local", help="transfer engine (see `rd2h backends`)")
    parser.add_argument("--engine-option", type=engine_option, action="append", default=[],
                        metavar="KEY=VALUE", help="an engine option (repeatable)")
    parser.add_argument("--prefill-option", type=engine_option, action="append", default=[],
                        metavar="KEY=VALUE", help="an engine option for Prefill ranks only, over --engine-option")
    parser.add_argument("--decode-option", type=engine_option, action="append", default=[],
                        metavar="KEY=VALUE", help="an engine option for Decode ranks only, over --engine-option")
    parser.add_argument("--channel", default="zmq", help="control channel (see `rd2h backends`): zmq (default) or tcp")
    parser.add_argument("--channel-option", type=engine_option, action="append", default=[],
                        metavar="KEY=VALUE", help="a control-channel option (repeatable), e.g. allow_insecure=true")
    parser.add_argument("--host", default="127.0.0.1", help="address Decode binds and Prefill dials")
    parser.add_argument("--prefill-netns", default="", metavar="NAME",
                        help="run Prefill ranks in this network namespace (`ip netns`; needs root)")
    parser.add_argument("--decode-netns", default="", metavar="NAME",
                        help="run Decode ranks in this network namespace (`ip netns`; needs root)")
    parser.add_argument("--kv-port", type=int, default=5600, help="Decode base port (default 5600)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds before a stuck run fails")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return parser


def run(args: argparse.Namespace) -> int:
    from rd2h.cli.demo.report import Progress, format_result
    from rd2h.cli.demo.runner import run_demo
    from rd2h.cli.demo.workload import DemoConfig
    from rd2h.cli.json_stdout import write_json

    config = DemoConfig(
        prefill_tp=args.prefill_tp, decode_tp=args.decode_tp, layers=args.layers, requests=args.requests,
        max_tokens=args.max_tokens, block_size=args.block_size, chunk_tokens=args.chunk_tokens,
        slots=args.slots, engine=args.engine, engine_options=dict(args.engine_option),
        kv_port=args.kv_port, seed=args.seed, timeout=args.timeout, host=args.host,
        prefill_netns=args.prefill_netns, decode_netns=args.decode_netns,
        prefill_engine_options=dict(args.prefill_option), decode_engine_options=dict(args.decode_option),
        channel=args.channel, channel_options=dict(args.channel_option),
    )
    result = run_demo(config, progress=None if args.json else Progress())
    if args.json:
        write_json(args.json_out, result.to_json())
    else:
        print(format_result(result))
    return 0 if result.verified else 1
