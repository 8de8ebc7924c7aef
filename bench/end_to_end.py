"""``rd2h demo`` against its limits, measured in one run, interleaved round by round.

    python bench/end_to_end.py [--rounds 3] [--baseline /path/to/old/checkout] [--channel tcp] [--json out.json]

Each round runs, in this order:

- the tiny-layer control path: ``rd2h demo --json --prefill-tp 1 --decode-tp 1 --layers 256
  --requests 1 --max-tokens 1 --block-size 1 --slots 1`` (layer latency p50) and a bare pyzmq
  DEALER/ROUTER ping-pong of one msgpack message each way (``bench/pingpong.py``): ratio p50/p50;
- the big read: ``rd2h demo --json --prefill-tp 1 --decode-tp 1 --layers 32 --requests 32
  --max-tokens 8192`` (``read_gbps``: bytes over the busiest Decode rank's time in read_batch),
  and the standalone local engine (``rd2h.cli.benchmark``) on the same kinds of memory as the
  demo (private huge-page Prefill pools read into a shared main pool), an SFA layout with the
  demo's bytes per layer, beside two-thread memcpy of the same bytes.

With ``--baseline`` every demo also runs from that checkout (``git worktree add --detach DIR
COMMIT``; its ``rd2h``, ``rd2h_local`` and ``rd2h_zmq`` come first on PYTHONPATH) right after
the current tree's, so before/after ratios come from the same run. Ratios are taken within a
round, then the median over rounds is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pingpong

TINY = ["--layers", "256", "--requests", "1", "--max-tokens", "1", "--block-size", "1", "--slots", "1"]
BIG = ["--layers", "32", "--requests", "32", "--max-tokens", "8192"]


def demo(args: list[str], port: int, checkout: str | None) -> dict[str, Any]:
    env = dict(os.environ)
    if checkout:
        root = Path(checkout)
        env["PYTHONPATH"] = os.pathsep.join(str(root / p) for p in ("", "backends/local", "backends/zmq", "backends/tcp"))
    cmd = [sys.executable, "-m", "rd2h.cli", "demo", "--json", "--prefill-tp", "1", "--decode-tp", "1",
           "--kv-port", str(port), *args]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, timeout=600, cwd="/")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"demo failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    result = json.loads(lines[-1])
    if not result["verified"]:
        raise SystemExit(f"demo did not verify: {result['problems'][:5]}")
    return result


def standalone(layer_mib: float, repeat: int) -> dict[str, float]:
    from rd2h.cli.benchmark import Case, EngineSpec, make_layout, measure_case

    case = Case(make_layout("sfa", 64, layer_mib, layers=12), "thp", dest_memory="shared")
    r = measure_case(case, [EngineSpec("local", threads=(1, 2))], threads=(1, 2), repeat=repeat)
    return {m: r.median(m) for m in r.samples}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", help="an older checkout to run the demos from as well")
    parser.add_argument("--skip-big", action="store_true", help="only the tiny-layer control path")
    parser.add_argument("--channel", default="zmq", help="control channel of the demos (a baseline needs it too)")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    trees = {"now": None, **({"baseline": args.baseline} if args.baseline else {})}
    rounds: list[dict[str, Any]] = []
    port = 7300
    channel = [] if args.channel == "zmq" else ["--channel", args.channel]
    for n in range(args.rounds):
        row: dict[str, Any] = {"pingpong": pingpong.measure(2000)}
        for label, tree in trees.items():
            port += 2
            row[f"tiny {label}"] = demo([*TINY, *channel], port, tree)
        if not args.skip_big:
            for label, tree in trees.items():
                port += 2
                row[f"big {label}"] = demo([*BIG, *channel], port, tree)
            big = row["big now"]
            row["standalone"] = standalone(big["bytes"] / (big["layers"] * big["steps"]) / 2**20, 3)
        rounds.append(row)
        print(f"round {n + 1}/{args.rounds} done", file=sys.stderr, flush=True)

    def med(f: Any) -> float:
        return statistics.median(f(r) for r in rounds)

    ratios: dict[str, float] = {}
    for label in trees:
        ratios[f"tiny {label}: layer p50 / ping-pong p50"] = med(
            lambda r, k=f"tiny {label}": r[k]["layer_latency_p50_ms"] * 1e3 / r["pingpong"]["p50_us"])
        if not args.skip_big:
            ratios[f"big {label}: read_gbps / memcpy 2t"] = med(
                lambda r, k=f"big {label}": r[k]["read_gbps"] / r["standalone"]["memcpy 2t"])
            for t in ("1t", "2t"):
                ratios[f"big {label}: read_gbps / standalone local {t}"] = med(
                    lambda r, k=f"big {label}", t=t: r[k]["read_gbps"] / r["standalone"][f"local {t}"])
    if args.baseline:
        ratios["tiny: layer p50 baseline / now"] = med(
            lambda r: r["tiny baseline"]["layer_latency_p50_ms"] / r["tiny now"]["layer_latency_p50_ms"])
        if not args.skip_big:
            ratios["big: read_gbps now / baseline"] = med(lambda r: r["big now"]["read_gbps"] / r["big baseline"]["read_gbps"])
            ratios["big: wall time baseline / now"] = med(lambda r: r["big baseline"]["seconds"] / r["big now"]["seconds"])

    figures = {
        "ping-pong p50 us": med(lambda r: r["pingpong"]["p50_us"]),
        **{f"tiny {label} layer p50 us": med(lambda r, k=f"tiny {label}": r[k]["layer_latency_p50_ms"] * 1e3)
           for label in trees},
    }
    if not args.skip_big:
        figures.update({f"big {label} read GB/s": med(lambda r, k=f"big {label}": r[k]["read_gbps"]) for label in trees})
        figures.update({f"big {label} end-to-end GB/s": med(lambda r, k=f"big {label}": r[k]["gbps"]) for label in trees})
        figures.update({f"big {label} Decode overhead p50 us/layer": med(
            lambda r, k=f"big {label}": r[k].get("layer_overhead_p50_ms", float("nan")) * 1e3) for label in trees})
        figures.update({f"standalone {m} GB/s": med(lambda r, m=m: r["standalone"][m]) for m in rounds[0]["standalone"]})
    print(f"medians over {args.rounds} interleaved rounds")
    for name, value in figures.items():
        print(f"  {name:<44}{value:>9.2f}")
    for name, value in ratios.items():
        print(f"  {name:<44}{value:>9.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rounds": rounds, "figures": figures, "ratios": ratios}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
