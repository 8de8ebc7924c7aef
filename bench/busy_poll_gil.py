"""What the tcp channel's ``busy_poll_us`` costs a compute thread of the same process.

    python bench/busy_poll_gil.py [--rounds 4] [--gap-us 500] [--busy-poll-us 300] [--json out.json]

The standalone API runs Decode's channel loop as a thread of the user's process, where a model
may compute. A polling thread holds the GIL between its polls, so what it costs that process is
not its own CPU (``bench/busy_poll.py``) but the compute thread's slowdown. Here a child process
plays Prefill: it sends a small frame every ``--gap-us`` (layers announced as a forward pass
computes them) and waits for the reply, as Prefill waits for READ_DONE. In this process a
listener thread answers each frame, and a compute thread times a fixed piece of work:

- ``python``: a pure-Python loop (holds the GIL: it competes with the polling thread for it);
- ``numpy``: matrix products (release the GIL: they compete only for a core).

Each round times both workloads with ``busy_poll_us`` 0 and N (the order flips every round), and
alone with no frames flowing (the floor). The ratio polled / not polled is the cost; ratios,
not times, because the machine's load moves both arms of a round together.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import threading
import time
from typing import Any

import numpy as np

from rd2h import plugins

WORK = {"python": 8_000_000, "numpy": 300}  # loop iterations / 256x256 products: ~0.1-0.3 s each


def _compute(kind: str, scale: float) -> float:
    started = time.perf_counter()
    if kind == "python":
        total = 0
        for i in range(int(WORK["python"] * scale)):
            total += i & 7
    else:
        a = np.ones((256, 256), dtype=np.float32)
        for _ in range(max(1, int(WORK["numpy"] * scale))):
            a = (a @ a) * (1.0 / 256)
    return time.perf_counter() - started


def _prefill(address: str, gap_us: int, busy_poll_us: int, stop: Any) -> None:
    """The child: a frame every ``gap_us``, each waiting for its reply, until ``stop`` is set."""
    dialer = plugins.load_channel("tcp", busy_poll_us=busy_poll_us).dialer()
    try:
        while not stop.is_set():
            dialer.send(address, b"readiness")
            dialer.recv(5.0)
            time.sleep(gap_us / 1e6)  # the next layer's compute (a bench's pacing, not a synchronisation)
    finally:
        dialer.close()


def _answer(listener: Any, flowing: threading.Event, done: threading.Event, answered: list[int]) -> None:
    while not done.is_set():
        got = listener.recv(0.05)
        if got is not None:
            listener.send(got[0], b"read_done")
            answered[0] += 1
            flowing.set()


def measure(kind: str, busy_poll_us: int, gap_us: int, scale: float) -> tuple[float, int]:
    """Seconds the compute thread took while frames flowed, and the frames answered meanwhile."""
    answered = [0]
    listener = plugins.load_channel("tcp", busy_poll_us=busy_poll_us).listen("tcp://127.0.0.1:0")
    flowing, done, stop = threading.Event(), threading.Event(), multiprocessing.Event()
    answering = threading.Thread(target=_answer, args=(listener, flowing, done, answered), daemon=True)
    answering.start()
    child = multiprocessing.Process(target=_prefill, args=(listener.address, gap_us, busy_poll_us, stop))
    child.start()
    try:
        if not flowing.wait(30.0):
            raise RuntimeError("no frame from the child in 30 s")
        before = answered[0]
        seconds = _compute(kind, scale)
        return seconds, answered[0] - before
    finally:
        stop.set()
        child.join(10)
        done.set()
        answering.join(10)
        listener.close()


def run(rounds: int, gap_us: int, busy_poll_us: int, scale: float = 1.0) -> dict[str, Any]:
    rows = []
    for n in range(rounds):
        row: dict[str, Any] = {"load": os.getloadavg()[0]}
        for kind in ("python", "numpy"):
            row[f"{kind} alone"] = _compute(kind, scale)
            for bp in ((0, busy_poll_us) if n % 2 == 0 else (busy_poll_us, 0)):
                row[f"{kind} bp{bp}"], row[f"{kind} bp{bp} frames"] = measure(kind, bp, gap_us, scale)
        rows.append(row)
        print(f"round {n + 1}/{rounds}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items() if "frames" not in k),
              flush=True)
    summary = {}
    for kind in ("python", "numpy"):
        ratios = [r[f"{kind} bp{busy_poll_us}"] / r[f"{kind} bp0"] for r in rows]
        summary[kind] = {"polled_over_not": round(statistics.median(ratios), 3),
                         "range": [round(min(ratios), 3), round(max(ratios), 3)],
                         "frames_while_computing": min(r[f"{kind} bp{bp} frames"]
                                                       for r in rows for bp in (0, busy_poll_us)),
                         "not_polled_over_alone": round(statistics.median(r[f"{kind} bp0"] / r[f"{kind} alone"]
                                                                          for r in rows), 3)}  # fmt: skip
    return {"rounds": rows, "summary": summary, "gap_us": gap_us, "busy_poll_us": busy_poll_us}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--gap-us", type=int, default=500)
    parser.add_argument("--busy-poll-us", type=int, default=300)
    parser.add_argument("--scale", type=float, default=1.0, help="the compute work, as a share of the default")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    result = run(args.rounds, args.gap_us, args.busy_poll_us, args.scale)
    print(f"compute thread's time, busy_poll_us={args.busy_poll_us} over 0, frames every {args.gap_us} us "
          "(median of rounds, range):")
    for kind, s in result["summary"].items():
        print(f"  {kind:7s} {s['polled_over_not']:.2f}x ({s['range'][0]:.2f}-{s['range'][1]:.2f}); "
              f"frames flowing, not polled, over alone: {s['not_polled_over_alone']:.2f}x")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
