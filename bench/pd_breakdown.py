"""Where the time to first token of P/D goes, from ``bench/vllm_pd.py`` results: a table and a
stacked bar figure, both pure functions of the results (no engines, no files), so recorded
results can be redrawn and a test can inspect the figure.

    python bench/vllm_pd.py --plot-from vllm_pd.json [more.json ...] --plot pd.png

The parts of P/D's TTFT are the medians of the per-request stages the results name
(``stages``: key, label), in order; what is left of the median TTFT after them is "the rest".
Bars are on a linear axis, unlike ``rd2h bench``'s ratios, because stacked parts must add up
to the bar; the goals (issue 23: TTFT <= 1.3x one engine, total <= 1.1x) are dashed lines on the
P/D bar, at the goal times the one-engine median of the same run, and each P/D figure missing
its goal is printed in red.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# Issue 23's goals for P/D against one engine on the same workload, same run.
GOALS = {"ttft": 1.3, "total": 1.1}

# The stages vllm_pd.py measures, when the results do not name theirs: (row key, label).
DEFAULT_STAGES = (
    ("rendezvous_ms", "proxy: until Decode posted its rendezvous"),
    ("prefill_ms", "Prefill: request, queue, compute, answer"),
)
REST = "rest: the TTFT median less the stages' medians"
AFTER = "after the first token"
ONE_ENGINE_TTFT = "one engine: to the first token"

_STAGE_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:olive",
                 "tab:cyan", "gold", "navy", "lightcoral", "darkseagreen", "orchid", "peru", "steelblue")
_GOAL_COLOR = "tab:red"


@dataclass(frozen=True)
class Breakdown:
    """One run's medians (ms): P/D's TTFT in parts, both arms' TTFT and total, and the ratios."""

    title: str
    parts: list[tuple[str, float]]  # P/D's TTFT: each stage, then the rest
    overshoot_ms: float  # how far the stages' medians exceed the TTFT median (the rest is then 0)
    pd_ttft: float
    pd_total: float
    single_ttft: float
    single_total: float
    pd_ttfts: list[float]  # per request, to show the spread
    single_ttfts: list[float]

    @property
    def ratios(self) -> dict[str, float]:
        return {"ttft": self.pd_ttft / self.single_ttft, "total": self.pd_total / self.single_total}


def breakdown(result: dict[str, Any], title: str | None = None) -> Breakdown:
    """The medians of one results dict. Raises ValueError naming what is missing."""
    rows = result.get("requests")
    if not rows:
        raise ValueError("the results hold no requests (key 'requests' missing or empty)")
    for key in ("pd_ttft_ms", "pd_total_ms", "single_ttft_ms", "single_total_ms"):
        if any(not isinstance(r.get(key), (int, float)) for r in rows):
            raise ValueError(f"a request lacks a number for {key!r}")

    def median(key: str) -> float:
        values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        return statistics.median(values) if values else 0.0

    stages = [(str(k), str(label)) for k, label in result.get("stages", DEFAULT_STAGES)]
    pd_ttft = median("pd_ttft_ms")
    parts = [(label, median(key)) for key, label in stages]
    rest = pd_ttft - sum(ms for _, ms in parts)
    parts.append((REST, max(rest, 0.0)))
    settings = result.get("settings", {})
    tokens = [r["prompt_tokens"] for r in rows if isinstance(r.get("prompt_tokens"), int)]
    auto = (f"{len(rows)} requests, ~{statistics.median(tokens):.0f}-token prompts, "
            f"{settings.get('max_tokens', '?')} tokens" if tokens else f"{len(rows)} requests")
    return Breakdown(
        title=title or result.get("title") or auto, parts=parts, overshoot_ms=max(-rest, 0.0), pd_ttft=pd_ttft,
        pd_total=median("pd_total_ms"), single_ttft=median("single_ttft_ms"), single_total=median("single_total_ms"),
        pd_ttfts=[r["pd_ttft_ms"] for r in rows], single_ttfts=[r["single_ttft_ms"] for r in rows],
    )


def table(b: Breakdown) -> str:
    """The breakdown as text: each part of P/D's TTFT, then both arms and the ratios to the goals."""
    width = max(len(label) for label, _ in b.parts) + 2
    lines = [b.title, f"  {'P/D time to first token, medians':<{width}}{'ms':>8}{'share':>7}"]
    for label, ms in b.parts:
        lines.append(f"  {label:<{width}}{ms:>8.1f}{ms / b.pd_ttft:>7.0%}")
    if b.overshoot_ms:
        lines.append(f"  (the stages' medians exceed the TTFT median by {b.overshoot_ms:.1f} ms)")
    lines.append(f"  {'':<{width}}{'P/D':>8}{'one':>7}{'ratio':>7}  goal")
    for key, name, pd, one in (("ttft", "time to first token", b.pd_ttft, b.single_ttft),
                               ("total", "total", b.pd_total, b.single_total)):
        ratio = b.ratios[key]
        verdict = "met" if ratio <= GOALS[key] else "missed"
        lines.append(f"  {name:<{width}}{pd:>8.1f}{one:>7.1f}{ratio:>6.2f}x  <= {GOALS[key]:g}x {verdict}")
    return "\n".join(lines)


def figure(results: Sequence[dict[str, Any]], titles: Sequence[str | None] = ()) -> Any:
    """A panel per results dict: one engine and P/D as horizontal bars in ms, P/D's TTFT
    stacked by stage, the time after the first token hatched, each request's TTFT a tick,
    the goals dashed. Panels share the time axis. Raises ImportError without matplotlib."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    if not results:
        raise ValueError("no results to plot")
    runs = [breakdown(r, titles[i] if i < len(titles) else None) for i, r in enumerate(results)]
    labels = list(dict.fromkeys(label for b in runs for label, _ in b.parts if label != REST)) + [REST]
    colors = {label: _STAGE_COLORS[i % len(_STAGE_COLORS)] for i, label in enumerate(labels[:-1])}
    colors[REST] = "0.55"
    longest = max(max(b.pd_total, b.single_total, b.single_total * GOALS["total"]) for b in runs)
    fig = Figure(figsize=(11, 1.4 + 1.9 * len(runs)), layout="constrained")
    axes = fig.subplots(len(runs), 1, squeeze=False, sharex=True)[:, 0]
    rows = {"one engine": 1.0, "P/D via rd2h proxy": 0.0}  # P/D at the bottom, nearest its goals' labels
    for ax, b in zip(axes, runs):
        one, pd = rows["one engine"], rows["P/D via rd2h proxy"]
        ax.barh(one, b.single_ttft, height=0.55, color="0.3", gid=ONE_ENGINE_TTFT)
        ax.barh(one, b.single_total - b.single_ttft, left=b.single_ttft, height=0.55, color="0.9",
                hatch="///", edgecolor="0.5", gid=AFTER)
        left = 0.0
        for label, ms in b.parts:
            ax.barh(pd, ms, left=left, height=0.55, color=colors[label], gid=label)
            if ms >= 0.06 * longest:  # a part wide enough to hold its own number
                ax.text(left + ms / 2, pd, f"{ms:.0f}", ha="center", va="center", fontsize=8, color="white", zorder=4,
                        bbox={"facecolor": colors[label], "edgecolor": "none", "pad": 1.0})  # over a goal line
            left += ms
        ax.barh(pd, b.pd_total - b.pd_ttft, left=b.pd_ttft, height=0.55, color="0.9", hatch="///",
                edgecolor="0.5", gid=AFTER)
        for y, ticks in ((one, b.single_ttfts), (pd, b.pd_ttfts)):
            ax.plot(ticks, [y + 0.36] * len(ticks), linestyle="none", marker="|", markersize=7, color="0.15",
                    gid="request ttft")
        goals = {key: at * GOALS[key] for key, at in (("ttft", b.single_ttft), ("total", b.single_total))}
        for key, goal in goals.items():
            ax.add_line(Line2D([goal, goal], [pd - 0.42, pd + 0.42], color=_GOAL_COLOR, linestyle=(0, (4, 2)),
                               linewidth=1.6, gid=f"goal {key}", zorder=3))
            first = goal == min(goals.values())  # labels lean apart, so two close goals stay legible
            ax.text(goal, pd - 0.45, f"{'TTFT' if key == 'ttft' else 'total'} goal {GOALS[key]:g}x ",
                    color=_GOAL_COLOR, fontsize=7.5, ha="right" if first else "left", va="top")
        verdicts = [f"{name} {b.ratios[key]:.2f}x" for key, name in (("ttft", "TTFT"), ("total", "total"))]
        missed = [b.ratios[k] > GOALS[k] for k in ("ttft", "total")]
        ax.text(b.pd_total + longest * 0.01, pd, ", ".join(verdicts) + " of one engine", va="center", fontsize=8.5,
                color=_GOAL_COLOR if any(missed) else "0.2", fontweight="bold" if any(missed) else "normal",
                gid="ratios")
        ax.set_yticks(list(rows.values()), list(rows), fontsize=9)
        ax.set_ylim(-0.85, 1.55)
        ax.set_xlim(0, longest * 1.3)  # room for the ratios right of the longest bar
        ax.grid(axis="x", alpha=0.3)
        ax.set_title(b.title + (f" (stages exceed the TTFT median by {b.overshoot_ms:.0f} ms)" if b.overshoot_ms
                                else ""), fontsize=10)
        ax.tick_params(axis="x", labelbottom=True, labelsize=8.5)
    axes[-1].set_xlabel("ms, medians over requests (ticks: each request's time to first token)", fontsize=9)
    handles = [Patch(color="0.3", label=ONE_ENGINE_TTFT)]
    handles += [Patch(color=colors[label], label=label) for label in labels]
    handles += [Patch(facecolor="0.9", hatch="///", edgecolor="0.5", label=AFTER),
                Line2D([], [], color=_GOAL_COLOR, linestyle=(0, (4, 2)), linewidth=1.6,
                       label="goal: x one engine, same run (ratios in red: a goal missed)")]
    fig.legend(handles=handles, loc="outside lower center", ncol=2, fontsize=8.5, frameon=False)
    fig.suptitle("P/D through rd2h proxy against one vLLM engine: where the time to first token goes", fontsize=11)
    return fig
