"""``rd2h proxy``: the OpenAI-compatible front for Prefill and Decode vLLM engines, with the
metaserver Decode posts its rendezvous to (``docs/vllm.md``). Needs ``rd2h[proxy]``."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from rd2h.errors import ConfigError


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "proxy",
        help="serve the OpenAI API in front of Prefill and Decode vLLM engines",
        description=(
            "Serve /v1/completions and /v1/chat/completions in front of vLLM engines running "
            "RD2HConnector. Each request goes to a Decode engine first; once Decode posted where its "
            "KV must go (to this proxy's metaserver, /v1/rd2h/rendezvous), the request goes to a "
            "Prefill engine with max_tokens=1. Several engines of each kind are used round robin."
        ),
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    parser.add_argument(
        "--prefill", action="append", required=True, metavar="URL",
        help="a Prefill engine's base URL, e.g. http://10.0.0.1:8100 (repeat for several)",
    )
    parser.add_argument(
        "--decode", action="append", required=True, metavar="URL",
        help="a Decode engine's base URL, e.g. http://10.0.0.2:8200 (repeat for several)",
    )
    parser.add_argument(
        "--secret-file", default=None, metavar="FILE",
        help="the secret shared with the engines, which signs both legs and authenticates the rendezvous "
        "(default: $RD2H_SECRET). Decode engines post to this proxy's /v1/rd2h/rendezvous, set as their "
        "kv_connector_extra_config 'metaserver'",
    )
    parser.add_argument(
        "--rendezvous-timeout", type=float, default=60.0, metavar="S",
        help="fail a request whose Decode did not post its rendezvous within S seconds (default: %(default)s)",
    )
    parser.add_argument(
        "--request-timeout", type=float, default=600.0, metavar="S",
        help="bound on each engine call, in seconds (default: %(default)s)",
    )
    parser.add_argument(
        "--retries", type=int, default=3,
        help="retries of an engine call that could not connect, each on the next instance (default: %(default)s)",
    )
    parser.add_argument(
        "--backoff", type=float, default=0.2, metavar="S",
        help="first delay between retries, doubled each time (default: %(default)s)",
    )
    parser.add_argument(
        "--log-level", default="info", choices=("debug", "info", "warning", "error"),
        help="log level; info logs one line per request with its timings (default: %(default)s)",
    )
    return parser


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from rd2h.proxy import ProxyConfig, create_app
    except ImportError as exc:
        raise ConfigError(f"rd2h proxy needs its extra: pip install 'rd2h[proxy]' ({exc})") from None
    from rd2h.vllm.vouch import load_secret

    config = ProxyConfig(
        prefill=args.prefill, decode=args.decode, secret=load_secret(args.secret_file),
        rendezvous_timeout=args.rendezvous_timeout, request_timeout=args.request_timeout,
        retries=args.retries, backoff=args.backoff,
    )
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    uvicorn.run(create_app(config), host=args.host, port=args.port, log_level=args.log_level)
    return 0
