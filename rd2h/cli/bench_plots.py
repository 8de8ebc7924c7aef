"""The figures of ``rd2h bench``, drawn from its results table (the ``cases`` of ``bench.json``).

Pure functions from rows to a matplotlib ``Figure``: no pyplot state, no files, no timing, so
a recorded ``bench.json`` can be redrawn (``rd2h bench --plot-from``) and a test can inspect
what is drawn. matplotlib comes with the ``bench`` extra; without it importing this module
raises ImportError (``bench_report`` catches it and leaves the plots out).

The ratio figure is read at a glance: a log axis (the ratios span 0.01x to 40x, and the ones
that matter sit between 0.3x and 2x), one panel per layout and block size with one bar per
memory kind, bars drawn from parity (1x) so the side a bar grows to says which method is
faster, and each goal as a dashed line across the rows it applies to.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

__all__ = ["FAMILIES", "GOALS", "Goal", "panel_key", "ratio_figure", "throughput_figure"]


@dataclass(frozen=True)
class Goal:
    """A ratio ``numerator... / reference...`` should reach ``value`` (at the main block sizes
    ``blocks_kib``, or at every size when empty); ``why`` names the goal."""

    numerator: str
    reference: str
    value: float
    why: str
    blocks_kib: tuple[int, ...] = ()

    def applies(self, ratio: str, block_kib: int) -> bool:
        numerator, _, reference = ratio.partition(" / ")
        return (numerator.startswith(self.numerator) and reference.startswith(self.reference)
                and (not self.blocks_kib or block_kib in self.blocks_kib))


# The targets of docs/performance.md ("The targets, where each stands") that a bench ratio
# measures, as they were set. The 0.4x memcpy goal is the demo's read (issue 23): the
# standalone engine bounds that read, so a case where the engine alone is below it is one
# where the demo cannot reach it.
GOALS = (
    Goal("local 2t", "bare pvr 2t", 0.95, "local 2t at 16 KiB / bare syscall", (16,)),
    Goal("local", "nixl", 1.7, "local / tuned NIXL"),
    Goal("local", "memcpy 2t", 0.4, "the demo's read / memcpy 2t"),
)

# Rows are grouped by what they are measured against, in this order; others follow.
FAMILIES = ("bare pvr", "nixl", "mooncake", "memcpy 2t")

_SERIES_COLORS = ("tab:blue", "tab:orange", "tab:purple", "tab:brown", "tab:olive", "tab:cyan")
_GOAL_STYLE = {"color": "tab:red", "linestyle": (0, (4, 2)), "linewidth": 1.6}
_FAMILY_GAP = 0.7  # blank rows between families: room for a goal's label


def panel_key(case: dict[str, Any]) -> tuple[str, int]:
    """(layout, main block KiB) of a result row: the panel it is drawn in."""
    name = case.get("name") or str(case.get("label", "?")).split(" ", 1)[0]
    block = case.get("block_bytes") or [0]
    return str(name), int(block[0]) // 1024


def _series(case: dict[str, Any]) -> str:
    memory = str(case.get("memory", "?"))
    dest = case.get("dest_memory")
    return f"{memory} -> {dest}" if dest and dest != memory else memory


def _family(ratio: str) -> int:
    reference = ratio.partition(" / ")[2]
    return next((i for i, f in enumerate(FAMILIES) if reference.startswith(f)), len(FAMILIES))


def _ordered(names: Iterable[str]) -> list[str]:
    seen = list(dict.fromkeys(names))
    return sorted(seen, key=lambda n: (_family(n), seen.index(n)))  # stable within a family


def _row_positions(rows: list[str]) -> list[float]:
    """y of each row, top to bottom, with a gap where the family changes."""
    ys, y = [], 0.0
    for i, row in enumerate(rows):
        if i and _family(row) != _family(rows[i - 1]):
            y += _FAMILY_GAP
        ys.append(y)
        y += 1.0
    return ys


def _ticks(lo: float, hi: float) -> list[float]:
    ticks = [m * 10.0**k for k in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1) for m in (1, 3)]
    return [t for t in ticks if lo <= t <= hi]


def _times(v: float, _pos: object = None) -> str:
    return f"{v:g}x"


def _value_text(v: float) -> str:
    return f"{v:.0f}" if v >= 10 else f"{v:.2f}" if v >= 0.1 else f"{v:.3f}"


def _goal_runs(rows: list[str], ys: list[float], goal: Goal, block_kib: int) -> list[tuple[float, float, bool]]:
    """The y spans (top, bottom) of consecutive rows a goal applies to, and whether its label
    goes above the span: where a family gap is, so it meets no value printed in the next row."""
    runs: list[list[int]] = []
    for i, row in enumerate(rows):
        if goal.applies(row, block_kib):
            if runs and runs[-1][1] == i - 1:
                runs[-1][1] = i
            else:
                runs.append([i, i])

    def gap_before(i: int) -> bool:
        return i == 0 or _family(rows[i]) != _family(rows[i - 1])

    return [(ys[i] - 0.5, ys[j] + 0.5, gap_before(i) or not (j + 1 == len(rows) or gap_before(j + 1)))
            for i, j in runs]


def ratio_figure(cases: Sequence[dict[str, Any]], goals: Sequence[Goal] = GOALS) -> Figure:
    """Every same-pass ratio of ``cases`` (bench.json rows, each with ``ratios``), one panel per
    layout and block size, one bar per memory kind, on one log axis shared by the panels.

    Raises ValueError when no row has a ratio (nothing to draw)."""
    panels: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for case in cases:
        if case.get("ratios"):
            panels.setdefault(panel_key(case), []).append(case)
    if not panels:
        raise ValueError(f"no ratios to plot in {len(cases)} result rows")
    series = list(dict.fromkeys(_series(c) for group in panels.values() for c in group))
    colors = {s: _SERIES_COLORS[i % len(_SERIES_COLORS)] for i, s in enumerate(series)}
    values = [v for group in panels.values() for c in group for v in c["ratios"].values() if v > 0]
    shown = [g for g in goals if any(g.applies(r, k[1]) for k, group in panels.items() for c in group for r in c["ratios"])]
    lo = min([*values, *(g.value for g in shown), 1.0]) / 2.2  # room for the value printed beyond each bar end
    hi = max([*values, *(g.value for g in shown), 1.0]) * 2.2

    blocks = list(dict.fromkeys(k[1] for k in panels))
    cols = max(1, min(len(blocks), 3)) if len(panels) > 1 else 1
    grid_rows = -(-len(panels) // cols)
    rows_by_panel = {k: _ordered(r for c in group for r in c["ratios"]) for k, group in panels.items()}
    tallest = max(len(r) + _FAMILY_GAP * len(FAMILIES) for r in rows_by_panel.values())
    fig = Figure(figsize=(7.2 * cols, 1.0 + grid_rows * (0.6 + 0.23 * tallest * max(2, len(series)))),
                 layout="constrained")
    axes = fig.subplots(grid_rows, cols, squeeze=False, sharex=True)
    for ax, (key, group) in zip(axes.flat, panels.items()):
        rows = rows_by_panel[key]
        ys = _row_positions(rows)
        height = 0.84 / len(series)
        for j, s in enumerate(series):
            mine = [c for c in group if _series(c) == s]
            ratios = {r: v for c in mine for r, v in c["ratios"].items() if v > 0}
            drawn = [(y - 0.42 + height * (j + 0.5), ratios[r], r) for r, y in zip(rows, ys) if r in ratios]
            if not drawn:
                continue
            bars = ax.barh([d[0] for d in drawn], [abs(v - 1.0) for _, v, _ in drawn],
                           left=[min(v, 1.0) for _, v, _ in drawn], height=height * 0.9, color=colors[s], label=s)
            for bar, (y, v, r) in zip(bars, drawn):
                bar.set_gid(r)  # the ratio's name, for whoever inspects the figure
                missed = any(g.applies(r, key[1]) and v < g.value for g in shown)
                # over the goal line, on a white ground: a value must stay readable where it meets one
                ax.text(v * 1.06 if v >= 1 else v / 1.06, y, _value_text(v), ha="left" if v >= 1 else "right",
                        va="center", fontsize=7.5, color=_GOAL_STYLE["color"] if missed else "0.2",
                        fontweight="bold" if missed else "normal", zorder=4, gid="missed" if missed else "value",
                        bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.3, "alpha": 0.85})
        ax.axvline(1.0, color="0.2", linewidth=0.9, gid="parity")
        for goal in shown:
            for top, bottom, above in _goal_runs(rows, ys, goal, key[1]):
                ax.add_line(Line2D([goal.value, goal.value], [top - 0.1, bottom + 0.1], gid="goal", zorder=3,
                                   **_GOAL_STYLE))
                low = goal.value < 1  # on the side its bars grow to, clear of a goal above 1x
                ax.text(goal.value / 1.04 if low else goal.value * 1.04, top - 0.1 if above else bottom + 0.1,
                        f"goal {goal.value:g}x", color=_GOAL_STYLE["color"], fontsize=7.5,
                        ha="right" if low else "left", va="bottom" if above else "top", gid="goal-label")
        ax.set_yticks(ys, rows, fontsize=8.5)
        ax.set_ylim(ys[-1] + 0.7, -0.5 - _FAMILY_GAP)
        ax.set_xscale("log")
        ax.set_xlim(lo, hi)
        ax.xaxis.set_major_locator(FixedLocator(_ticks(lo, hi)))
        ax.xaxis.set_major_formatter(FuncFormatter(_times))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.grid(axis="x", alpha=0.3)
        ax.tick_params(axis="x", labelsize=8.5, labelbottom=True)
        ax.set_title(f"{key[0]} layout, {key[1]} KiB blocks", fontsize=10.5)
        ax.set_xlabel("same-pass ratio, median over passes (log)", fontsize=8.5)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    handles: list[Any] = [Patch(color=colors[s], label=f"{s} memory") for s in series]
    handles.append(Line2D([], [], color="0.2", linewidth=0.9, label="parity: 1x"))
    if shown:
        handles.append(Line2D([], [], label="goal (a value in red misses it): "
                              + "; ".join(f"{g.why} {g.value:g}x" for g in shown), **_GOAL_STYLE))
    fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 4), fontsize=8.5, frameon=False)
    fig.suptitle("rd2h bench: each method against its limit, measured in the same passes "
                 "(bars grow from 1x; right: the first method is faster)", fontsize=11)
    return fig


def throughput_figure(cases: Sequence[dict[str, Any]]) -> Figure:
    """GB/s (median over passes) by method, one panel a case: limits grey, local blue, other engines orange."""
    if not cases:
        raise ValueError("no result rows to plot")
    cols = min(4, len(cases))
    rows = -(-len(cases) // cols)
    fig = Figure(figsize=(4.2 * cols, 3.4 * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax, case in zip(axes.flat, cases):
        names = list(case["samples"])
        kinds = case.get("kinds", {})
        colors = ["0.6" if kinds.get(n) == "limit" else "tab:blue" if n.startswith("local") else "tab:orange"
                  for n in names]
        ax.barh(names, [statistics.median(case["samples"][n]) for n in names], color=colors)
        ax.set_title(case.get("label", "?"), fontsize=9)
        ax.set_xlabel("GB/s (median)")
        ax.invert_yaxis()
        ax.tick_params(labelsize=8)
    for ax in list(axes.flat)[len(cases):]:
        ax.set_visible(False)
    return fig
