"""Where Decode and Prefill spend their time per layer in ``rd2h demo``: py-spy over every process.

    python bench/profile_demo.py [--top 12] [--json out.json] -- --layers 2048 --requests 1 \\
        --max-tokens 1 --block-size 1 --slots 1            # the control path of a tiny layer
    python bench/profile_demo.py -- --layers 32 --requests 32 --max-tokens 8192   # big layers

Runs ``rd2h demo --json --prefill-tp 1 --decode-tp 1 ARGS`` under ``py-spy record
--subprocesses`` (CPU samples only: a thread blocked in a syscall or a wait is not counted),
sorts the samples by role (the Decode process, the Prefill process) and thread (the sink's,
the source's, the Prefill main thread that computes the layers), and prints the inclusive
time of the busiest functions in microseconds per layer (layers x prefill steps). With
``--pythonpath`` the demo runs from another checkout (``git worktree``) for a before/after.
Needs py-spy (the ``bench`` extra) and the right to ptrace children (root, or Yama off).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

_PROCESS = re.compile(r'process (\d+):"([^"]*)"')
_THREAD = re.compile(r"thread \((\d+)\)(?::\s*(.*))?")
_FRAME = re.compile(r"^(.*) \((.*?):(\d+)\)$")
_WAITS = {"Poller.poll", "Condition.wait", "Event.wait", "select", "Queue.get", "poll", "sleep",
          "_wait_for_tstate_lock", "Connection._poll", "wait", "_wait_readable"}
# the innermost Python frame of a thread blocked in a C-level poll it calls directly
_IDLE_LEAVES = {"Witness._run"}


def parse(raw: str) -> dict[tuple[str, str], collections.Counter[str]]:
    """Inclusive samples per function, by (role, thread name), from py-spy's raw output."""
    stacks: list[tuple[str, str, list[str], int]] = []  # (pid, thread, frames, count)
    for line in raw.splitlines():
        body, _, count = line.rpartition(" ")
        if not body or not count.isdigit():
            continue
        pids = _PROCESS.findall(body)  # a child's stack starts with its parents' names
        pid = pids[-1][0] if pids else ""
        thread, frames = "?", []
        for part in _PROCESS.sub("", body).split(";"):
            if not part:
                continue
            if (m := _THREAD.fullmatch(part)) is not None:
                thread = m.group(2) or "thread"
            elif (m := _FRAME.match(part)) is not None:
                frames.append(f"{m.group(1)} ({Path(m.group(2)).name})")
            else:
                frames.append(part)
        stacks.append((pid, thread, frames, int(count)))
    roles: dict[str, str] = {}
    for pid, _, frames, _ in stacks:
        for f in frames:
            if f.startswith(("_decode_into ", "Sink.")):
                roles[pid] = "decode"
            elif f.startswith("_prefill ") and roles.get(pid) != "decode":
                roles[pid] = "prefill"
    out: dict[tuple[str, str], collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for pid, thread, frames, count in stacks:
        role = roles.get(pid, "launcher")
        counter = out[role, re.sub(r"-\d+$", "", thread)]
        if any(f.split(" ", 1)[0] in _WAITS for f in frames) or (frames and frames[-1].split(" ", 1)[0] in _IDLE_LEAVES):
            counter["<waiting>"] += count  # py-spy counts some blocking calls as busy
            continue
        counter["<busy>"] += count
        for f in dict.fromkeys(frames):  # inclusive: a recursive frame counts once
            counter[f] += count
    return out


def run(demo_args: list[str], rate: int, pythonpath: str | None) -> tuple[dict, str]:
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "raw.txt"
        cmd = [py_spy, "record", "--subprocesses", "--threads", "--rate", str(rate), "--format", "raw",
               "-o", str(raw), "--", sys.executable, "-m", "rd2h.cli", "demo", "--json",
               "--prefill-tp", "1", "--decode-tp", "1", *demo_args]
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, cwd=tmp, timeout=900)
        if proc.returncode != 0 or not raw.exists():
            raise SystemExit(f"py-spy or the demo failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        return json.loads(lines[-1]), raw.read_text()


def report(result: dict, profile: dict, rate: int, top: int) -> dict[str, dict[str, float]]:
    """µs per layer of the ``top`` busiest functions in each (role, thread)."""
    layers = result["layers"] * result["steps"]
    table: dict[str, dict[str, float]] = {}
    for (role, thread), counter in sorted(profile.items()):
        if role == "launcher":
            continue
        per_layer = {name: n / rate / layers * 1e6 for name, n in counter.most_common(top + 2)}
        table[f"{role} / {thread}"] = per_layer
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=int, default=1000, help="samples a second")
    parser.add_argument("--top", type=int, default=14)
    parser.add_argument("--pythonpath", help="run the demo from another checkout (PYTHONPATH for it)")
    parser.add_argument("--json", help="also write the profile here")
    parser.add_argument("demo_args", nargs="*", help="arguments for rd2h demo (after --)")
    args = parser.parse_args(argv)
    result, raw = run(args.demo_args or ["--layers", "2048", "--requests", "1", "--max-tokens", "1",
                                         "--block-size", "1", "--slots", "1"], args.rate, args.pythonpath)
    table = report(result, parse(raw), args.rate, args.top)
    print(f"rd2h demo {' '.join(args.demo_args)}: {result['layers']} layers x {result['steps']} step(s), "
          f"layer p50 {result['layer_latency_p50_ms'] * 1e3:.0f} us, read {result['read_gbps']:.2f} GB/s "
          f"(under py-spy at {args.rate} Hz: slower than a plain run)")
    for where, rows in table.items():
        print(f"\n{where}: CPU us per layer (inclusive)")
        for name, us in rows.items():
            print(f"  {us:>9.1f}  {name}")
    if args.json:
        Path(args.json).write_text(json.dumps({"demo": result, "profile_us_per_layer": table}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
