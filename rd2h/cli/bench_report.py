"""How ``rd2h bench`` shows its results: a progress bar, a table, JSON and PNG plots.

rich and matplotlib come with the ``bench`` extra (``pip install 'rd2h[bench]'``); without
them the progress is a line per case and the plots are left out with a note saying so.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, TextIO

from rd2h.cli.benchmark import CaseResult

__all__ = ["format_case", "headline_ratios", "machine", "plot_cases", "plot_report", "plot_rows", "progress_bar",
           "write_results"]

_DISTRIBUTIONS = ("rd2h", "numpy", "pyzmq", "rd2h-local", "rd2h-mooncake", "mooncake-transfer-engine-non-cuda",
                  "rd2h-nixl", "nixl-cu12", "nixl", "rd2h-memfabric", "memfabric-hybrid", "matplotlib")


def machine() -> dict[str, Any]:
    """CPU model, cores, kernel, transparent huge page modes and the versions that matter."""
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    thp = {}
    for name in ("enabled", "shmem_enabled", "defrag"):
        try:
            text = Path(f"/sys/kernel/mm/transparent_hugepage/{name}").read_text()
            thp[name] = text.split("[", 1)[1].split("]", 1)[0]
        except (OSError, IndexError):
            thp[name] = "?"
    versions = {}
    for dist in _DISTRIBUTIONS:
        try:
            versions[dist] = version(dist)
        except PackageNotFoundError:
            pass
    return {
        "cpu": cpu,
        "nproc": len(os.sched_getaffinity(0)),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "transparent_hugepage": thp,
        "versions": versions,
    }


def progress_bar(total: int, stream: TextIO | None = None) -> tuple[AbstractContextManager[Any], Callable[[str], None]]:
    """A context that shows the bar (on stderr by default) and a callback that advances it
    by one timed pass."""
    stream = stream if stream is not None else sys.stderr
    try:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )
    except ImportError:
        done = [0]

        def step(name: str) -> None:
            done[0] += 1
            if done[0] * 10 // total > (done[0] - 1) * 10 // total:
                stream.write(f"  {done[0]}/{total} passes timed ({name})\n")
                stream.flush()

        return nullcontext(), step
    from rich.console import Console

    bar = Progress(TextColumn("{task.description:<28}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                   console=Console(file=stream), transient=True)
    task = bar.add_task("rd2h bench", total=total)
    return bar, lambda name: bar.update(task, advance=1, description=name)


def _reference(result: CaseResult, method: str) -> str | None:
    """The limit a method is held against: the bare syscall with as many threads for
    local-engine methods, else two-thread memcpy."""
    threads = method.rsplit(" ", 1)[-1]
    bare = f"bare pvr {threads}"
    if method.startswith("local ") and bare in result.samples:
        return bare
    return "memcpy 2t" if "memcpy 2t" in result.samples and method != "memcpy 2t" else None


def headline_ratios(result: CaseResult) -> dict[str, float]:
    """Same-pass ratios: each engine to memcpy 2t and to the bare syscall, and local to the others."""
    out: dict[str, float] = {}
    names = list(result.samples)
    for m in names:
        if result.kinds[m] != "engine" and not m.startswith("bare"):
            continue
        if "memcpy 2t" in names:
            out[f"{m} / memcpy 2t"] = result.ratio(m, "memcpy 2t")
        ref = _reference(result, m)
        if ref and ref.startswith("bare") and m != ref:
            out[f"{m} / {ref}"] = result.ratio(m, ref)
    for t in ("1t", "2t"):
        local = f"local {t}"
        if local not in names:
            continue
        for other in names:
            if result.kinds[other] == "engine" and not other.startswith("local"):
                out[f"{local} / {other}"] = result.ratio(local, other)
    return out


def format_case(result: CaseResult, repeat: int) -> str:
    c = result.case
    lines = [(f"{c['label']}: {c['layers']} layers x {c['descriptors_per_layer']} descriptors "
             f"({c['layer_bytes'] / 2**20:.1f} MiB a layer, {c['total_bytes'] / 2**30:.2f} GiB a pass), "
             f"median of {repeat} interleaved passes")]
    lines.append(f"  {'method':<16}{'GB/s':>7}  passes")
    for m, values in result.samples.items():
        lines.append(f"  {m:<16}{result.median(m):>7.2f}  " + " ".join(f"{v:.2f}" for v in values))
    for name, value in headline_ratios(result).items():
        lines.append(f"  {name:<32}{value:>6.2f}")
    for name, why in result.skipped.items():
        lines.append(f"  skipped {name}: {why}")
    return "\n".join(lines)


def write_results(out: Path, report: dict[str, Any]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "bench.json"
    path.write_text(json.dumps(report, indent=2))
    return path


def plot_cases(out: Path, results: Sequence[CaseResult]) -> list[Path]:
    """``throughput.png`` and ``ratios.png`` of measured cases (see ``plot_rows``)."""
    return plot_rows(out, [dict(r.to_json(), ratios=headline_ratios(r)) for r in results])


def plot_rows(out: Path, cases: Sequence[dict[str, Any]]) -> list[Path]:
    """``throughput.png`` (GB/s by method, one panel a case) and ``ratios.png`` (each engine
    to its limit, log axis, one panel per layout and block size, goals drawn) from result rows
    as ``bench.json`` holds them. Returns the files written; none without matplotlib."""
    try:
        from rd2h.cli.bench_plots import ratio_figure, throughput_figure
    except ImportError:
        return []
    out.mkdir(parents=True, exist_ok=True)
    files = []
    for name, draw in (("throughput.png", throughput_figure), ("ratios.png", ratio_figure)):
        fig = draw(cases)
        fig.savefig(out / name, dpi=110)
        files.append(out / name)
    return files


def plot_report(report_file: Path, out: Path) -> list[Path]:
    """Redraw the plots of a recorded ``bench.json`` into ``out``, measuring nothing.

    Raises ValueError naming the file when it is not a bench report."""
    try:
        report = json.loads(report_file.read_text())
        cases = report["cases"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{report_file} is not a readable rd2h bench report (bench.json): {exc!r}") from exc
    if not isinstance(cases, list) or not all(isinstance(c, dict) and "samples" in c for c in cases):
        raise ValueError(f"{report_file}: 'cases' is not a list of measured cases")
    return plot_rows(out, cases)
