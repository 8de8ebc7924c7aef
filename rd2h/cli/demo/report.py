"""How a demo run is shown: a progress line while it runs, a table when it ends."""

from __future__ import annotations

import sys
from typing import TextIO

from rd2h.cli.demo.runner import DemoResult

__all__ = ["Progress", "format_result"]

_MAX_PROBLEMS = 10


class Progress:
    """A one-line progress bar on a terminal; a line per quarter elsewhere (logs, CI)."""

    def __init__(self, stream: TextIO = sys.stderr, width: int = 30) -> None:
        self.stream, self.width = stream, width
        self.tty = stream.isatty()
        self._quarter = 0

    def __call__(self, done: int, total: int) -> None:
        if self.tty:
            filled = self.width * done // max(total, 1)
            bar = "#" * filled + "." * (self.width - filled)
            self.stream.write(f"\r  [{bar}] {done}/{total} layers announced")
            if done >= total:
                self.stream.write("\n")
        elif 4 * done // max(total, 1) > self._quarter:
            self._quarter = 4 * done // max(total, 1)
            self.stream.write(f"  {done}/{total} layers announced\n")
        self.stream.flush()


def _size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.1f} {unit}" if unit != "B" else f"{int(nbytes)} B"
        nbytes /= 1024
    raise AssertionError("unreachable")


def format_result(r: DemoResult) -> str:
    rows = [
        ("verified", "yes: every destination byte matches its source, other blocks untouched"
         if r.verified else f"NO: {len(r.problems)} problem(s)"),
        ("bytes moved", f"{_size(r.bytes)} ({r.bytes} B)"),
        ("wall time", f"{r.seconds:.3f} s (first layer announced -> last request complete)"),
        ("throughput", f"{r.gbps:.2f} GB/s end to end"),
        ("read time", f"{r.read_seconds:.3f} s in read_batch on the busiest Decode rank "
                      f"({r.read_gbps:.2f} GB/s while reading)"),
        ("layer latency", f"p50 {r.layer_latency_p50_ms:.1f} ms   p99 {r.layer_latency_p99_ms:.1f} ms"
         " (layer announced -> every Decode rank replied)"),
        ("exposed transfer", f"{r.exposed_ms:.1f} ms after the last layer was computed"),
        ("layer overhead", f"p50 {r.layer_overhead_p50_ms * 1e3:.0f} us per layer on Decode besides read_batch"),
    ]
    title = (f"rd2h demo: Prefill TP {r.prefill_tp} -> Decode TP {r.decode_tp}, {r.layers} layers, "
             f"{r.requests} requests, {r.steps} prefill step(s), engine {r.engine}")
    width = max(len(k) for k, _ in rows)
    lines = [title, "-" * len(title)] + [f"  {k:<{width}}  {v}" for k, v in rows]
    for problem in r.problems[:_MAX_PROBLEMS]:
        lines.append(f"  ! {problem}")
    if len(r.problems) > _MAX_PROBLEMS:
        lines.append(f"  ! ... and {len(r.problems) - _MAX_PROBLEMS} more")
    return "\n".join(lines)
