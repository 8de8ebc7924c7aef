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
            "Serve /v1/completions, /v1/chat/completions and /v1/models in front of vLLM engines running "
            "RD2HConnector. Each request goes to a Decode engine first; once Decode posted where its "
            "KV must go (to this proxy's internal listener, /v1/rd2h/rendezvous), the request goes to a "
            "Prefill engine with max_tokens=1. Of several engines of a kind, the one with the fewest "
            "outstanding requests among those in rotation gets it: an engine is in rotation once its health "
            "check answers and a warm-up request (one tiny P/D request through each Prefill/Decode pair) went "
            "through it, so a client's first request is served like the second. /health answers 200, and the "
            "log says 'rd2h proxy ready', once a Prefill and a Decode are in rotation. The internal listener "
            "also serves /metrics (Prometheus) and /v1/rd2h/requests (operator token). SIGTERM drains."
        ),
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    parser.add_argument(
        "--rendezvous-host", default="127.0.0.1",
        help="address of the internal listener the Decode engines post their rendezvous to; on a "
        "network the engines reach and clients do not (default: %(default)s)",
    )
    parser.add_argument(
        "--rendezvous-port", type=int, default=None,
        help="port of the internal listener; the Decode engines' 'metaserver' is "
        "http://HOST:PORT/v1/rd2h/rendezvous (default: --port + 1)",
    )
    parser.add_argument(
        "--prefill-at-once", action="store_true",
        help="experimental: send each request to Prefill at the same time as to Decode; Prefill fetches where "
        "the KV goes from the internal listener (--internal-url) once every rendezvous is in (default: Prefill "
        "gets the request once every rendezvous is in)",
    )
    parser.add_argument(
        "--first-token-from-prefill", action="store_true",
        help="experimental: the client's first token is the one Prefill samples (Prefill gets the request at "
        "once, as with --prefill-at-once), Decode continues from the prompt and that token; greedy "
        "/v1/completions of one prompt only, anything else takes the normal flow (counted by reason in "
        "rd2h_proxy_first_token_fallbacks_total)",
    )
    parser.add_argument(
        "--internal-url", default=None, metavar="URL",
        help="with --prefill-at-once or --first-token-from-prefill: the internal listener's base URL as the "
        "engines reach it (default: http://RENDEZVOUS_HOST:RENDEZVOUS_PORT, a wildcard host replaced by this "
        "host's name)",
    )
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
        "(default: $RD2H_SECRET)",
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
        "--connect-timeout", type=float, default=5.0, metavar="S",
        help="bound on connecting to an engine; past it the next instance is tried (default: %(default)s)",
    )
    parser.add_argument(
        "--health-interval", type=float, default=2.0, metavar="S",
        help="seconds between health checks of every engine; one that fails is out of rotation until "
        "one answers and it is warmed up again (0: no checks, no warm-up: every engine is in rotation from "
        "the start) (default: %(default)s)",
    )
    parser.add_argument(
        "--no-warmup", dest="warmup", action="store_false",
        help="put an engine in rotation as soon as its health check answers, without a warm-up request "
        "through it (its first client request then pays the Prefill/Decode handshakes)",
    )
    parser.add_argument(
        "--warmup-timeout", type=float, default=120.0, metavar="S",
        help="bound on one warm-up request; a pair that fails is tried again after a backoff (default: %(default)s)",
    )
    parser.add_argument(
        "--max-body-bytes", type=int, default=16 << 20, metavar="N",
        help="a client body past N bytes is refused with 413 (default: %(default)s)",
    )
    parser.add_argument(
        "--header-timeout", type=float, default=10.0, metavar="S",
        help="a connection must send its request headers, and then its body, within S seconds (default: %(default)s)",
    )
    parser.add_argument(
        "--max-connections", type=int, default=2048, metavar="N",
        help="connections past N are answered 503 (default: %(default)s)",
    )
    parser.add_argument(
        "--drain-timeout", type=float, default=60.0, metavar="S",
        help="on SIGTERM, wait up to S seconds for requests in flight (default: %(default)s)",
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


def targets_url(args: argparse.Namespace, rendezvous_port: int, path: str, *, flag: str = "prefill_at_once",
                ) -> str | None:
    """Where Prefill fetches its targets with ``--prefill-at-once`` (or the option ``flag`` names:
    the internal listener as the engines reach it: ``--internal-url``, or the rendezvous host, a
    wildcard replaced by this host's name); None without it. ConfigError: ``--internal-url``
    without either option, which would do nothing."""
    if args.internal_url is not None and not (args.prefill_at_once or args.first_token_from_prefill):
        raise ConfigError("--internal-url is used only with --prefill-at-once or --first-token-from-prefill")
    if not getattr(args, flag):
        return None
    host = args.rendezvous_host
    if host in ("0.0.0.0", "::", ""):
        import socket

        host = socket.getfqdn()
    host = f"[{host}]" if ":" in host else host  # an IPv6 address
    return (args.internal_url or f"http://{host}:{rendezvous_port}").rstrip("/") + path


def run(args: argparse.Namespace) -> int:
    if not args.warmup_timeout > 0:
        raise ConfigError(f"--warmup-timeout must be more than 0 seconds, got {args.warmup_timeout:g}")
    try:
        import asyncio

        from rd2h.proxy import ProxyConfig
        from rd2h.proxy.early import TARGETS_PATH
        from rd2h.proxy.server import Listen, serve
    except ImportError as exc:
        raise ConfigError(f"rd2h proxy needs its extra: pip install 'rd2h[proxy]' ({exc})") from None
    from rd2h.vllm.vouch import load_secret

    rendezvous_port = args.port + 1 if args.rendezvous_port is None else args.rendezvous_port
    if (args.rendezvous_host, rendezvous_port) == (args.host, args.port):
        raise ConfigError("the rendezvous listener needs its own port (--rendezvous-port)")
    config = ProxyConfig(
        prefill=args.prefill, decode=args.decode, secret=load_secret(args.secret_file),
        rendezvous_timeout=args.rendezvous_timeout, request_timeout=args.request_timeout,
        connect_timeout=args.connect_timeout, retries=args.retries, backoff=args.backoff,
        max_body_bytes=args.max_body_bytes, health_interval=args.health_interval, body_timeout=args.header_timeout,
        warmup=args.warmup, warmup_timeout=args.warmup_timeout,
        targets_url=targets_url(args, rendezvous_port, TARGETS_PATH),
        first_token_url=targets_url(args, rendezvous_port, TARGETS_PATH, flag="first_token_from_prefill"),
    )
    listen = Listen(
        host=args.host, port=args.port, rendezvous_host=args.rendezvous_host, rendezvous_port=rendezvous_port,
        header_timeout=args.header_timeout, max_connections=args.max_connections, drain_timeout=args.drain_timeout,
        log_level=args.log_level,
    )
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(serve(config, listen))
    return 0
