"""The control path through each channel, against bare ping-pongs, interleaved in one run.

    python bench/control_channel.py [--rounds 5] [--messages 2000] [--layers 256] [--baseline DIR] [--json out.json]
    python bench/trace_layer.py --channel tcp          # where a tiny layer's time goes, hop by hop

Each round runs these arms, in an order rotated from round to round (so a drift in the
machine's load does not always favour the same arm):

- ``zmq ping-pong``: a bare pyzmq DEALER/ROUTER ping-pong of one msgpack message each way
  (``bench/pingpong.py``), the figure the issue's goal is stated against;
- ``socket ping-pong``: the same over a plain blocking TCP socket, 4-byte length prefixes;
- ``channel zmq`` / ``channel tcp``: the same messages through an rd2h channel's dialer and
  listener (``plugins.load_channel``), the listener's loop in a child process: what the channel
  adds to the bare transport;
- ``layer zmq`` / ``layer tcp``: a tiny layer's round trip through rd2h, ``rd2h demo --json
  --prefill-tp 1 --decode-tp 1 --layers 256 --requests 1 --max-tokens 1 --block-size 1 --slots
  1 --channel NAME`` (``layer_latency_p50_ms``: announced on Prefill -> Decode read and replied
  -> the slot released on Prefill);
- ``layer tcp busy``: the same over tcp with ``--channel-option busy_poll_us=N`` (``--busy-poll-us``,
  300 by default): both ends poll awake for N us after each frame instead of sleeping at once.

With ``--baseline DIR`` (an older checkout: ``git worktree add --detach DIR COMMIT``) the two
tiny-layer arms also run from it (``layer zmq @base``, ``layer tcp @base``), in the same rotation.
Ratios are taken within a round (each p50 over the zmq ping-pong's p50 of that round, and over
the plain socket ping-pong's), then the median over rounds is reported, with the range. Each
round records the machine's load average when it starts (``load``), since on a shared 2-core
machine it moves every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pingpong
from end_to_end import TINY, demo

CHANNELS = ("zmq", "tcp")


def _serve_channel(name: str, port: int) -> None:
    from rd2h import plugins

    with plugins.load_channel(name).listen(f"tcp://127.0.0.1:{port}") as listener:
        print("ready", flush=True)
        while True:
            item = listener.recv(1.0)
            if item is None:
                continue
            peer, payload = item
            message = msgpack.unpackb(payload)
            if message[0] == b"exit":
                break
            listener.send(peer, msgpack.packb([b"read_done", message[1]]))


def measure_channel(name: str, messages: int) -> dict[str, float]:
    """Round trips through channel ``name``'s dialer (here) and listener (a child process)."""
    from rd2h import plugins

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve-channel", name, str(port)], stdout=subprocess.PIPE, text=True
    )
    address = f"tcp://127.0.0.1:{port}"
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        with plugins.load_channel(name).dialer() as dialer:
            times = np.empty(messages)
            for i in range(-100, messages):
                started = time.perf_counter()
                dialer.send(address, msgpack.packb([*pingpong._READY[:1], i, *pingpong._READY[2:]]))
                got = dialer.recv(10.0)
                if got is None:
                    raise AssertionError(f"no reply for message {i} through {name}")
                reply = msgpack.unpackb(got[1])
                if reply[1] != i:
                    raise AssertionError(f"reply for {reply[1]}, expected {i}")
                if i >= 0:
                    times[i] = time.perf_counter() - started
            dialer.send(address, msgpack.packb([b"exit"]))
    finally:
        server.wait(timeout=10)
    return pingpong._percentiles(times, messages)


def _layer(
    channel: str, port: int, layers: int, checkout: str | None = None, options: tuple[str, ...] = ()
) -> dict[str, float]:
    args = [*TINY]
    args[args.index("--layers") + 1] = str(layers)
    result = demo([*args, "--channel", channel, *(a for o in options for a in ("--channel-option", o))], port, checkout)
    return {"p50_us": result["layer_latency_p50_ms"] * 1e3}


def run_rounds(
    rounds: int, messages: int, layers: int, baseline: str | None = None, busy_poll_us: int = 300
) -> list[dict[str, dict[str, float]]]:
    arms: list[tuple[str, Any]] = [
        ("zmq ping-pong", lambda port: pingpong.measure(messages)),
        ("socket ping-pong", lambda port: pingpong.measure_socket(messages)),
        *((f"channel {c}", lambda port, c=c: measure_channel(c, messages)) for c in CHANNELS),
        *((f"layer {c}", lambda port, c=c: _layer(c, port, layers)) for c in CHANNELS),
    ]
    if busy_poll_us:
        arms.append(("layer tcp busy", lambda port: _layer("tcp", port, layers, options=(f"busy_poll_us={busy_poll_us}",))))
    if baseline:
        arms += [(f"layer {c} @base", lambda port, c=c: _layer(c, port, layers, baseline)) for c in CHANNELS]
    results = []
    port = 7500 + (os.getpid() % 500) * 4
    for n in range(rounds):
        row: dict[str, dict[str, float]] = {"load": {"average": os.getloadavg()[0]}}
        shift = n % len(arms)
        for label, arm in arms[shift:] + arms[:shift]:
            port += 2
            row[label] = arm(port)
        results.append(row)
        arms_us = ", ".join(f"{k} {v['p50_us']:.0f}" for k, v in row.items() if k != "load")
        print(f"round {n + 1}/{rounds} (load {row['load']['average']:.1f}): {arms_us} us p50",
              file=sys.stderr, flush=True)
    return results


def summarize(rows: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per arm: median p50 over rounds, and its ratio to the same round's zmq ping-pong."""
    out: dict[str, dict[str, float]] = {}
    loads = [r["load"]["average"] for r in rows if "load" in r]
    if loads:
        out["load"] = {"min": min(loads), "median": statistics.median(loads), "max": max(loads)}
    for label in (k for k in rows[0] if k != "load"):
        p50s = [r[label]["p50_us"] for r in rows]
        ratios = [r[label]["p50_us"] / r["zmq ping-pong"]["p50_us"] for r in rows]
        over_socket = [r[label]["p50_us"] / r["socket ping-pong"]["p50_us"] for r in rows]
        over_zmq_channel = over_base = None
        if label.startswith("layer "):
            over_zmq_channel = statistics.median(r[label]["p50_us"] / r["layer zmq"]["p50_us"] for r in rows)
        if label.startswith("layer ") and f"{label} @base" in rows[0]:
            over_base = statistics.median(r[label]["p50_us"] / r[f"{label} @base"]["p50_us"] for r in rows)
        out[label] = {
            "p50_us": statistics.median(p50s), "p50_min_us": min(p50s), "p50_max_us": max(p50s),
            "over_zmq_pingpong": statistics.median(ratios), "over_min": min(ratios), "over_max": max(ratios),
            "over_socket_pingpong": statistics.median(over_socket),
            "over_socket_min": min(over_socket), "over_socket_max": max(over_socket),
            **({"over_layer_zmq": over_zmq_channel} if over_zmq_channel is not None else {}),
            **({"over_baseline": over_base} if over_base is not None else {}),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--messages", type=int, default=2000, help="round trips per ping-pong arm")
    parser.add_argument("--layers", type=int, default=256, help="layers per tiny-layer demo")
    parser.add_argument("--baseline", help="an older checkout whose tiny-layer demos run as well")
    parser.add_argument("--busy-poll-us", type=int, default=300, help="the tcp channel's busy_poll_us in the "
                        "'layer tcp busy' arm (0: no such arm)")
    parser.add_argument("--json")
    parser.add_argument("--serve-channel", nargs=2, metavar=("NAME", "PORT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_channel:
        _serve_channel(args.serve_channel[0], int(args.serve_channel[1]))
        return 0
    rows = run_rounds(args.rounds, args.messages, args.layers, args.baseline, args.busy_poll_us)
    summary = summarize(rows)
    print(f"medians over {args.rounds} interleaved rounds (ratios: p50 / the same round's ping-pong p50)")
    if "load" in summary:
        load = summary["load"]
        print(f"  load average at the rounds' start: {load['min']:.1f}-{load['max']:.1f} (median {load['median']:.1f})")
    print(f"  {'arm':<18}{'p50 us':>8}{'range':>14}{'/ zmq':>8}{'range':>14}{'/ socket':>9}{'range':>14}")
    for label, s in summary.items():
        if label == "load":
            continue
        print(f"  {label:<18}{s['p50_us']:>8.0f}{s['p50_min_us']:>7.0f}-{s['p50_max_us']:<6.0f}"
              f"{s['over_zmq_pingpong']:>8.2f}{s['over_min']:>7.2f}-{s['over_max']:<6.2f}"
              f"{s['over_socket_pingpong']:>9.2f}{s['over_socket_min']:>7.2f}-{s['over_socket_max']:<6.2f}")
    for label in (lbl for lbl in summary if lbl.startswith("layer ") and lbl != "layer zmq" and "@" not in lbl):
        print(f"  {label} / layer zmq (same round), median: {summary[label]['over_layer_zmq']:.2f}")
    for label in (f"layer {c}" for c in CHANNELS if "over_baseline" in summary[f"layer {c}"]):
        print(f"  {label} / {label} @base (same round), median: {summary[label]['over_baseline']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rounds": rows, "summary": summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
