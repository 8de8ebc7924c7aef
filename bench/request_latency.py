"""Time for one small request to end on each side, for this tree and (optionally) a baseline.

    python bench/request_latency.py [--requests 400] [--layers 4] [--baseline DIR] [--json out.json]

One process, a ``KVSource`` and a ``KVSink`` on loopback (zmq, local engine), one request of
one block at a time: the clock starts when Prefill announces its layers (``send_all``) and
stops when the outcome is there, on Prefill (``wait_finished``) and on Decode (``wait``).
Since rd2h protocol 4, Decode reports DONE only after Prefill's ``settled``, one more message
after the reply to the last layer; this measures what that costs. With ``--baseline`` (a
checkout made with ``git worktree add --detach DIR COMMIT``) the same workload runs from
that checkout in a child process right after this tree's, round by round, and the ratio of
the medians per round is reported (median over rounds).
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

HERE = Path(__file__).resolve().parent


def measure(requests: int, layers: int) -> dict[str, float]:
    """Median and p99 microseconds per request, on Prefill and on Decode."""
    import numpy as np

    from rd2h.api import KVSink, KVSource, LayerTensors

    def tensors(fill: bool) -> LayerTensors:
        rng = np.random.default_rng(0)
        main = rng.integers(1, 255, (8, 4096), dtype=np.uint8) if fill else np.zeros((8, 4096), np.uint8)
        return LayerTensors(main=[main])

    src = {f"l{i}": tensors(True) for i in range(layers)}
    dst = {f"l{i}": tensors(False) for i in range(layers)}
    prefill_us, decode_us = [], []
    with socket.socket() as probe:  # a free port for the one Decode rank
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with KVSink(dst, kv_port=port) as sink, KVSource(src, block_size=16) as source:
        for i in range(requests + 20):  # the first 20 warm up
            ext_id = f"r{i}"
            sink.expect(ext_id, main_blocks=[i % 8])
            source.add_request(ext_id, sink.endpoint, main_block_ids=[(i + 3) % 8], num_tokens=16)
            started = time.perf_counter()
            source.send_all({ext_id: 16})
            prefill = source.wait_finished([ext_id], 10)[ext_id]
            on_prefill = time.perf_counter()
            decode = sink.wait([ext_id], 10)[ext_id]
            on_decode = time.perf_counter()
            assert prefill.ok and decode.ok, (prefill, decode)
            if i >= 20:
                prefill_us.append((on_prefill - started) * 1e6)
                decode_us.append((on_decode - started) * 1e6)
    return {
        "prefill_p50_us": statistics.median(prefill_us),
        "decode_p50_us": statistics.median(decode_us),
        "prefill_p99_us": float(np.percentile(prefill_us, 99)),
        "decode_p99_us": float(np.percentile(decode_us, 99)),
    }


def _run(tree: Path | None, requests: int, layers: int) -> dict[str, float]:
    """The workload in a child process, importing rd2h from ``tree`` (None: this tree)."""
    env = dict(os.environ)
    if tree is not None:
        paths = [tree, tree / "backends" / "local", tree / "backends" / "zmq"]
        env["PYTHONPATH"] = os.pathsep.join([str(p) for p in paths] + [env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--child", "--requests", str(requests), "--layers", str(layers)],
        env=env, capture_output=True, text=True, timeout=600, check=True, cwd=str(tree or HERE.parent),
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", type=Path, help="a checkout of an earlier commit to compare with")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.requests, args.layers)))
        return 0
    rounds: list[dict[str, Any]] = []
    for n in range(args.rounds):
        result: dict[str, Any] = {"current": _run(None, args.requests, args.layers)}
        if args.baseline is not None:
            result["baseline"] = _run(args.baseline.resolve(), args.requests, args.layers)
        rounds.append(result)
        line = ", ".join(f"{k}: Prefill {v['prefill_p50_us']:.0f} us, Decode {v['decode_p50_us']:.0f} us" for k, v in result.items())
        print(f"round {n + 1}/{args.rounds}: {line}", file=sys.stderr)
    summary: dict[str, Any] = {"rounds": rounds, "requests": args.requests, "layers": args.layers}
    print(f"{'':10} {'Prefill p50':>12} {'Decode p50':>12} {'Decode p99':>12}")
    for name in rounds[0]:
        p = statistics.median(r[name]["prefill_p50_us"] for r in rounds)
        d = statistics.median(r[name]["decode_p50_us"] for r in rounds)
        d99 = statistics.median(r[name]["decode_p99_us"] for r in rounds)
        summary[name] = {"prefill_p50_us": p, "decode_p50_us": d, "decode_p99_us": d99}
        print(f"{name:10} {p:10.0f} us {d:10.0f} us {d99:10.0f} us")
    if args.baseline is not None:
        for side in ("prefill", "decode"):
            ratio = statistics.median(r["current"][f"{side}_p50_us"] / r["baseline"][f"{side}_p50_us"] for r in rounds)
            summary[f"{side}_ratio"] = ratio
            print(f"{side}: current / baseline = {ratio:.2f} (median of per-round ratios)")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
