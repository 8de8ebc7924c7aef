"""Exposed transfer time with simulated per-layer compute: how much of the pull hides behind Prefill.

    python bench/exposed.py [--compute-ms 0,0.5,1,2,4] [--rounds 3] [--out DIR]

Runs ``rd2h demo`` (Prefill TP 1 -> Decode TP 1, local engine, SFA layers) with Prefill
sleeping ``compute_ms`` per layer and step after its slot is free, as a device computing the
layer would leave the host thread waiting. Reported per compute time: the exposed transfer
(last layer computed -> every request complete), the read time per layer on Decode, and the
wall time against the compute alone. When compute per layer exceeds the read per layer, the
exposed time should shrink to about one layer's read. Points run interleaved round by round;
medians are shown. Writes ``exposed.json`` and ``exposed.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from rd2h.cli.demo.runner import run_demo
from rd2h.cli.demo.workload import DemoConfig


def one(compute_ms: float, port: int, layers: int, requests: int, max_tokens: int) -> dict[str, Any]:
    config = DemoConfig(prefill_tp=1, decode_tp=1, layers=layers, requests=requests, max_tokens=max_tokens,
                        kv_port=port, compute_ms=compute_ms)
    r = run_demo(config)
    if not r.verified:
        raise AssertionError(f"demo did not verify: {r.problems[:5]}")
    layer_steps = r.layers * r.steps
    return {"compute_ms": compute_ms, "exposed_ms": r.exposed_ms, "read_ms_per_layer": r.read_seconds / layer_steps * 1e3,
            "wall_ms": r.seconds * 1e3, "compute_total_ms": compute_ms * layer_steps, "layer_steps": layer_steps,
            "layer_p50_ms": r.layer_latency_p50_ms}


def plot(out: Path, rows: list[dict[str, Any]]) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    x = [r["compute_ms"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot(x, [r["exposed_ms"] for r in rows], "o-", label="exposed transfer (ms)")
    ax.plot(x, [r["read_ms_per_layer"] for r in rows], "s--", label="read per layer (ms)")
    ax.set_xlabel("simulated compute per layer (ms)")
    ax.set_ylabel("ms")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = out / "exposed.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compute-ms", default="0,0.5,1,2,4")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--out", type=Path, default=Path("rd2h-bench-results"))
    args = parser.parse_args(argv)
    points = [float(v) for v in args.compute_ms.split(",") if v]
    samples: dict[float, list[dict[str, Any]]] = {p: [] for p in points}
    port = 7700
    for n in range(args.rounds):
        for p in points:
            port += 2
            samples[p].append(one(p, port, args.layers, args.requests, args.max_tokens))
        print(f"round {n + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    rows = []
    for p, runs in samples.items():
        rows.append({k: statistics.median(r[k] for r in runs) for k in runs[0]})
    print(f"{'compute/layer':>14}{'exposed':>10}{'read/layer':>12}{'wall':>10}{'compute':>10}  (ms, medians of {args.rounds})")
    for r in rows:
        print(f"{r['compute_ms']:>14.1f}{r['exposed_ms']:>10.2f}{r['read_ms_per_layer']:>12.2f}"
              f"{r['wall_ms']:>10.1f}{r['compute_total_ms']:>10.1f}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "exposed.json").write_text(json.dumps({"rows": rows, "samples": {str(k): v for k, v in samples.items()}}, indent=2))
    png = plot(args.out, rows)
    print(f"wrote {args.out / 'exposed.json'}" + (f", {png}" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
