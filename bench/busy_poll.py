"""What a sleeping thread's wake-up costs here, and what the tcp channel's ``busy_poll_us`` costs.

    python bench/busy_poll.py [--rounds 3] [--messages 3000] [--layers 4352] [--json out.json]

Two parts, each interleaved round by round (the order flips every round):

- ``socket ping-pong``: ``bench/pingpong.py``'s plain TCP socket on loopback between this
  process and a child, one small msgpack message each way, both ends either **blocking** in
  ``recv`` (the kernel wakes them) or **spinning** on a non-blocking ``recv``. p50 wall time
  and CPU of this end per round trip: the difference is the wake-up (on a VM, a halted vCPU
  run again by the host).
- ``demo CPU``: ``rd2h demo`` over tcp with one-block layers through one slot, with
  ``busy_poll_us`` 0 and N (``--busy-poll-us``, 300), each at ``--layers`` and at 256 layers;
  the CPU of both processes (``RUSAGE_CHILDREN``) and wall time per extra layer, and the
  demo's ``layer_latency_p50``. Start-up cancels out in the difference.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pingpong
from end_to_end import TINY, demo


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def demo_run(layers: int, busy_poll_us: int, port: int) -> dict[str, float]:
    args = [*TINY]
    args[args.index("--layers") + 1] = str(layers)
    cpu, wall = _children_cpu(), time.monotonic()
    result = demo([*args, "--channel", "tcp", "--channel-option", f"busy_poll_us={busy_poll_us}"], port, None)
    return {"cpu_s": _children_cpu() - cpu, "wall_s": time.monotonic() - wall,
            "layer_p50_us": result["layer_latency_p50_ms"] * 1e3}


def run(rounds: int, messages: int, layers: int, busy_poll_us: int) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    port = 7300 + (os.getpid() % 400) * 8
    for n in range(rounds):
        row: dict[str, Any] = {"load": os.getloadavg()[0]}
        for spin in ((False, True) if n % 2 == 0 else (True, False)):
            row["spinning" if spin else "blocking"] = pingpong.measure_socket(messages, spin)
        for bp in ((0, busy_poll_us) if n % 2 == 0 else (busy_poll_us, 0)):
            for count in (256, layers):
                port += 2
                row[f"demo {count} bp{bp}"] = demo_run(count, bp, port)
        rows.append(row)
        print(f"round {n + 1}/{rounds} (load {row['load']:.1f}): ping-pong p50 blocking "
              f"{row['blocking']['p50_us']:.0f} us, spinning {row['spinning']['p50_us']:.0f} us", file=sys.stderr, flush=True)
    extra = layers - 256
    summary: dict[str, Any] = {"load": [r["load"] for r in rows]}
    for arm in ("blocking", "spinning"):
        summary[f"ping-pong {arm}"] = {k: statistics.median(r[arm][k] for r in rows) for k in ("p50_us", "cpu_us")}
    for bp in (0, busy_poll_us):
        per = [((r[f"demo {layers} bp{bp}"]["cpu_s"] - r[f"demo 256 bp{bp}"]["cpu_s"]) / extra * 1e6,
                (r[f"demo {layers} bp{bp}"]["wall_s"] - r[f"demo 256 bp{bp}"]["wall_s"]) / extra * 1e6,
                r[f"demo {layers} bp{bp}"]["layer_p50_us"]) for r in rows]
        summary[f"demo busy_poll_us={bp}"] = {
            "cpu_us_per_layer": statistics.median(p[0] for p in per),
            "wall_us_per_layer": statistics.median(p[1] for p in per),
            "layer_p50_us": statistics.median(p[2] for p in per),
        }
    off, on = summary["demo busy_poll_us=0"], summary[f"demo busy_poll_us={busy_poll_us}"]
    summary["cpu_on_over_off"] = on["cpu_us_per_layer"] / off["cpu_us_per_layer"]
    return {"rounds": rows, "summary": summary}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--messages", type=int, default=3000)
    parser.add_argument("--layers", type=int, default=4352)
    parser.add_argument("--busy-poll-us", type=int, default=300)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if args.layers <= 256:
        parser.error("--layers must be above 256 (the short run whose cost is taken away)")
    out = run(args.rounds, args.messages, args.layers, args.busy_poll_us)
    s = out["summary"]
    print(f"medians over {args.rounds} interleaved rounds, load {min(s['load']):.1f}-{max(s['load']):.1f}")
    for arm in ("blocking", "spinning"):
        p = s[f"ping-pong {arm}"]
        print(f"  socket ping-pong, {arm:<9} p50 {p['p50_us']:7.1f} us   CPU of one end {p['cpu_us']:7.1f} us a round trip")
    for bp in (0, args.busy_poll_us):
        d = s[f"demo busy_poll_us={bp}"]
        print(f"  demo busy_poll_us={bp:<5} CPU {d['cpu_us_per_layer']:6.0f} us/layer (both processes), "
              f"wall {d['wall_us_per_layer']:6.0f} us/layer, layer p50 {d['layer_p50_us']:6.0f} us")
    print(f"  CPU per layer, busy polling on / off: {s['cpu_on_over_off']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
