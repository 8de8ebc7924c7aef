"""Cross-host engines across one veth link, next to iperf3 over the same link, in one run (root).

    python bench/cross_host.py [--engines mooncake,nixl --layers 16 --requests 8 --max-tokens 4096 --block-size 64
                                --repeat 3 --json out.json]

Two network namespaces joined by a veth pair (tests/twohost/netns.py) stand for two hosts.
iperf3 sends from the Prefill namespace to the Decode namespace (the direction KV moves) for
``--iperf-seconds``; then ``rd2h demo``'s ranks (Prefill TP 1 -> Decode TP 1, an SFA-like
layout, every byte verified) pull the workload through each engine, ``--repeat`` times,
interleaved with iperf3 runs. Reported per engine: GB/s while inside ``read_batch`` on Decode
(the engine's own rate) and end to end (first announcement to last reply), and each as a ratio
to the iperf3 figure of the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "twohost"))

from netns import DEVICE, TwoHosts, why_not  # noqa: E402

from rd2h.cli.demo.runner import run_demo  # noqa: E402
from rd2h.cli.demo.workload import DemoConfig  # noqa: E402

# Engine options: both sides, Prefill's own, Decode's own (as in tests/twohost).
OPTIONS: dict[str, Any] = {
    "mooncake": lambda h: ({"timeout": 30.0}, {"hostname": h.prefill_addr}, {"hostname": h.decode_addr}),
    "nixl": lambda h: ({"timeout": 30.0, "ucx_tls": "tcp"}, {}, {}),
}
DISTRIBUTIONS = {"mooncake": "mooncake-transfer-engine-non-cuda", "nixl": "nixl-cu12"}


def iperf3(hosts: TwoHosts, seconds: int) -> float:
    """GB/s received in the Decode namespace from one TCP stream out of the Prefill namespace."""
    server = subprocess.Popen(
        hosts.command(hosts.decode, ["iperf3", "-s", "-1", "-B", hosts.decode_addr]),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 10
        while True:  # the server is up once a client gets through; a refused client exits at once
            done = subprocess.run(
                hosts.command(hosts.prefill, ["iperf3", "-J", "-c", hosts.decode_addr, "-t", str(seconds)]),
                capture_output=True, text=True, timeout=seconds + 30,
            )  # fmt: skip
            try:  # iperf3 -J exits 0 even when it could not connect: its JSON says so
                return json.loads(done.stdout)["end"]["sum_received"]["bits_per_second"] / 8e9
            except (ValueError, KeyError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"iperf3 failed: {done.stdout[-500:]} {done.stderr[-500:]}")
    finally:
        server.kill()
        server.wait()


def engine_run(hosts: TwoHosts, engine: str, args: argparse.Namespace) -> dict[str, float]:
    both, prefill, decode = OPTIONS[engine](hosts)
    config = DemoConfig(
        prefill_tp=1, decode_tp=1, layers=args.layers, requests=args.requests, max_tokens=args.max_tokens,
        block_size=args.block_size, chunk_tokens=max(1024, args.block_size), engine=engine, engine_options=both, prefill_engine_options=prefill, decode_engine_options=decode,
        host=hosts.decode_addr, prefill_netns=hosts.prefill, decode_netns=hosts.decode, timeout=120,
        channel_options={"allow_insecure": True},  # a link between our own namespaces: no CURVE keys
    )  # fmt: skip
    result = run_demo(config)
    if not result.verified:
        raise RuntimeError(f"{engine}: the transfer did not verify: {result.problems[:3]}")
    return {"read_gbps": result.read_gbps, "end_to_end_gbps": result.gbps, "bytes": result.bytes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default="mooncake,nixl")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=64, help="tokens per block (64: 64 KiB main blocks)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--iperf-seconds", type=int, default=2, help="whole seconds (iperf3 3.12 hangs on -t 0.5)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    reason = why_not()
    if reason:
        raise SystemExit(f"cross_host: {reason}")
    engines = args.engines.split(",")
    os.environ["UCX_NET_DEVICES"] = DEVICE  # UCX: only the veth, never loopback
    runs: dict[str, list[dict[str, float]]] = {e: [] for e in engines}
    link: list[float] = []
    with TwoHosts(f"b{os.getpid() % 100000}", 250 + os.getpid() % 5) as hosts:
        for _ in range(args.repeat):  # interleaved, so drift hits every row alike
            link.append(iperf3(hosts, args.iperf_seconds))
            for engine in engines:
                runs[engine].append(engine_run(hosts, engine, args))
    iperf = statistics.median(link)
    report: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version()},
        "workload": {"layers": args.layers, "requests": args.requests, "max_tokens": args.max_tokens,
                     "block_size": args.block_size, "tp": "1->1"},
        "iperf3_gbps": {"median": iperf, "runs": link},
        "engines": {},
    }
    print(f"veth link, iperf3 (1 TCP stream): {iperf:.2f} GB/s median of {len(link)}")
    print(f"{'engine':10} {'version':14} {'read GB/s':>10} {'x iperf3':>9} {'e2e GB/s':>9} {'x iperf3':>9}")
    for engine, rows in runs.items():
        read = statistics.median(r["read_gbps"] for r in rows)
        e2e = statistics.median(r["end_to_end_gbps"] for r in rows)
        ver = version(DISTRIBUTIONS[engine]) if engine in DISTRIBUTIONS else ""
        report["engines"][engine] = {"version": ver, "read_gbps": read, "end_to_end_gbps": e2e,
                                     "read_vs_iperf3": read / iperf, "end_to_end_vs_iperf3": e2e / iperf,
                                     "runs": rows}
        print(f"{engine:10} {ver:14} {read:10.2f} {read / iperf:9.2f} {e2e:9.2f} {e2e / iperf:9.2f}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
