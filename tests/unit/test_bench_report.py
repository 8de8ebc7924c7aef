"""The figures of ``rd2h bench`` drawn from a results table, inspected as matplotlib objects:
what a reader must see at a glance (a log axis, a panel per layout and block size, every
ratio, the goals) and that nothing hides it (legend outside the panels, labels apart)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("matplotlib")

from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from rd2h.cli.bench_plots import GOALS, ratio_figure  # noqa: E402
from rd2h.cli.bench_report import plot_report  # noqa: E402

BLOCKS = {"sfa": {64: [65536, 8192, 8192, 256], 16: [16384, 2048, 2048, 64]}, "dense": {64: [65536], 16: [16384]}}


def _cases() -> list[dict[str, Any]]:
    """Eight cases as bench.json holds them, ratios from 0.02x (Mooncake to memcpy) to 30x."""
    cases = []
    for layout, sizes in BLOCKS.items():
        for kib, block_bytes in sizes.items():
            for k, memory in enumerate(("shared", "thp")):
                bump = 0.01 * (len(cases) + 1)
                cases.append({
                    "label": f"{layout} {kib} KiB {memory}", "name": layout, "memory": memory,
                    "dest_memory": memory, "block_bytes": block_bytes,
                    "ratios": {
                        "local 1t / memcpy 2t": 0.35 + bump, "local 1t / bare pvr 1t": 1.0 + bump,
                        "local 2t / memcpy 2t": 0.45 + bump, "local 2t / bare pvr 2t": 0.9 + bump,
                        "mooncake / memcpy 2t": 0.02 + bump / 10, "nixl / memcpy 2t": 0.2 + bump,
                        "local 1t / mooncake": 20.0 + 10 * bump * (k + 1), "local 1t / nixl": 1.5 + bump,
                        "local 2t / nixl": 2.0 + bump,
                    },
                })
    return cases


def _panels(fig: Figure) -> dict[str, Any]:
    return {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}


def _bar_value(rect: Any) -> float:
    """The ratio a bar shows: bars grow from 1x, to the left for a ratio below 1."""
    x0, x1 = rect.get_x(), rect.get_x() + rect.get_width()
    return x0 if x0 < 1 - 1e-12 else x1


def test_ratio_figure_has_a_log_panel_per_layout_and_block_size_with_every_ratio() -> None:
    cases = _cases()
    fig = ratio_figure(cases)
    panels = _panels(fig)
    assert set(panels) == {f"{layout} layout, {kib} KiB blocks" for layout in BLOCKS for kib in (64, 16)}
    drawn = {}
    for title, ax in panels.items():
        assert ax.get_xscale() == "log"
        lo, hi = ax.get_xlim()
        assert lo < 0.02 and hi > 40  # the panels share one axis that holds every ratio
        for container in ax.containers:  # one bar series per memory kind
            for rect in container:
                drawn[title, container.get_label(), rect.get_gid()] = _bar_value(rect)
    expected = {(f"{c['name']} layout, {c['block_bytes'][0] // 1024} KiB blocks", c["memory"], name): value
                for c in cases for name, value in c["ratios"].items()}
    assert drawn.keys() == expected.keys()
    assert all(drawn[k] == pytest.approx(v) for k, v in expected.items())


def test_goals_are_drawn_on_the_rows_they_apply_to_and_misses_are_marked() -> None:
    fig = ratio_figure(_cases())
    for title, ax in _panels(fig).items():
        goals = {line.get_xdata()[0] for line in ax.lines if line.get_gid() == "goal"}
        expected = {1.7, 0.4} | ({0.95} if "16 KiB" in title else set())  # 0.95x bare was set for 16 KiB
        assert goals == expected
        missed = {t.get_text() for t in ax.texts if t.get_gid() == "missed"}
        # local 1t / nixl is 1.5x + a little (below 1.7x) in every case; local 1t / memcpy 2t below 0.4x
        assert len(missed) >= 2 and all(float(v) < 1.7 for v in missed)
    legend_text = " ".join(t.get_text() for t in fig.legends[0].get_texts())
    assert all(f"{g.value:g}x" in legend_text for g in GOALS)


def test_legend_and_labels_cover_no_data() -> None:
    fig = ratio_figure(_cases())
    FigureCanvasAgg(fig).draw()
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    panels = list(_panels(fig).values())
    assert all(ax.get_legend() is None for ax in panels)
    (legend,) = fig.legends
    box = legend.get_window_extent(renderer)
    assert not any(box.overlaps(ax.get_window_extent(renderer)) for ax in panels)
    for ax in panels:
        labels = [t for t in ax.get_yticklabels() if t.get_text()]
        assert min(t.get_fontsize() for t in labels) >= 8
        extents = sorted((t.get_window_extent(renderer) for t in labels), key=lambda b: b.y0)
        assert all(a.y1 <= b.y0 + 0.5 for a, b in zip(extents, extents[1:])), "row labels overlap"


def test_a_goal_only_where_its_rows_are() -> None:
    only_local = [{"label": "dense 64 KiB shared", "name": "dense", "memory": "shared", "block_bytes": [65536],
                   "ratios": {"local 1t / bare pvr 1t": 0.98, "local 1t / memcpy 2t": 0.5}}]
    fig = ratio_figure(only_local)
    (ax,) = _panels(fig).values()
    assert [line.get_xdata()[0] for line in ax.lines if line.get_gid() == "goal"] == [0.4]
    assert [t.get_gid() for t in ax.texts if t.get_gid() in ("missed", "value")] == ["value", "value"]


def test_no_ratio_to_draw_is_an_error_that_says_so() -> None:
    with pytest.raises(ValueError, match="no ratios to plot in 1 result rows"):
        ratio_figure([{"label": "sfa 64 KiB shared", "ratios": {}}])


def test_plot_report_redraws_a_recorded_bench_json(tmp_path: Path) -> None:
    cases = [dict(c, samples={"memcpy 2t": [10.0, 11.0], "local 1t": [4.0, 5.0]},
                  kinds={"memcpy 2t": "limit", "local 1t": "engine"}) for c in _cases()]
    recorded = tmp_path / "bench.json"
    recorded.write_text(json.dumps({"command": "rd2h bench", "cases": cases}))
    files = plot_report(recorded, tmp_path / "plots")
    assert [f.name for f in files] == ["throughput.png", "ratios.png"]
    assert all(f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for f in files)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match="other.json is not a readable rd2h bench report"):
        plot_report(other, tmp_path / "plots")


def test_bench_command_redraws_without_measuring(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from rd2h.cli.main import main

    cases = [dict(c, samples={"memcpy 2t": [10.0]}, kinds={"memcpy 2t": "limit"}) for c in _cases()[:2]]
    recorded = tmp_path / "bench.json"
    recorded.write_text(json.dumps({"cases": cases}))
    assert main(["bench", "--plot-from", str(recorded), "--out", str(tmp_path / "out")]) == 0
    assert capsys.readouterr().out.strip() == f"{tmp_path / 'out' / 'throughput.png'}, {tmp_path / 'out' / 'ratios.png'}"
    with pytest.raises(SystemExit, match="--plot-from: .*missing.json is not a readable rd2h bench report"):
        main(["bench", "--plot-from", str(tmp_path / "missing.json"), "--out", str(tmp_path / "out")])
