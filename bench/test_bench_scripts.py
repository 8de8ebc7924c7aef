"""The bench/ scripts run once at a tiny size, as correctness tests: each completes, checks
what it moved (the demo verifies every byte; the byte-rate scripts check before timing) and
writes its JSON (and plot). No timing is asserted: figures come from the scripts themselves.

    python bench/end_to_end.py --baseline DIR   # and the others: see each docstring
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import decode_cpu
import end_to_end
import exposed
import memory_kinds
import pd_breakdown
import pingpong
import profile_demo
import pytest
import request_latency
import scaling


def test_pingpong_round_trips() -> None:
    result = pingpong.measure(50)
    assert result["rounds"] == 50 and 0 < result["p50_us"] <= result["p99_us"]


def test_request_latency_reports_both_sides(tmp_path: Path) -> None:
    out = tmp_path / "latency.json"
    assert request_latency.main(["--requests", "5", "--layers", "2", "--rounds", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert 0 < report["current"]["prefill_p50_us"] and 0 < report["current"]["decode_p50_us"]


def test_decode_cpu_reads_every_layer(tmp_path: Path) -> None:
    out = tmp_path / "decode_cpu.json"
    assert decode_cpu.main(["--layers", "4", "--requests", "3", "--blocks", "2", "--rounds", "2", "--json", str(out)]) == 0
    row = json.loads(out.read_text())["now"]
    assert 0 < row["overhead_us"] <= row["handle_us"]


def test_end_to_end_tiny_layers(tmp_path: Path) -> None:
    out = tmp_path / "e2e.json"
    assert end_to_end.main(["--rounds", "1", "--skip-big", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["ratios"]) == {"tiny now: layer p50 / ping-pong p50"}
    (row,) = report["rounds"]
    assert row["tiny now"]["verified"] and row["tiny now"]["layers"] == 256


def test_memory_kinds_names_every_ratio(tmp_path: Path) -> None:
    out = tmp_path / "memory.json"
    assert memory_kinds.main(["--layers", "2", "--layer-mib", "0.5", "--repeat", "1", "--json", str(out)]) == 0
    ratios = json.loads(out.read_text())["ratios"]
    assert len(ratios) == 8 and all(v > 0 for v in ratios.values())


def test_scaling_points_and_plot(tmp_path: Path) -> None:
    row = scaling.point(blocks=256, requests=4, ratio=2, layers=3)
    assert row["blocks"] == 256 and row["wall_ns_per_block"] > 0 and row["handle_ns_per_block"] > 0
    png = scaling.plot(tmp_path, {"blocks": [row], "requests": [row], "ratio": [row]})
    assert png is not None and png.stat().st_size > 0
    fig = scaling.figure({"blocks": [row], "requests": [row], "ratio": [row]})
    for ax in fig.axes:  # log y: control (tens of ns) stays readable beside wall (hundreds)
        assert ax.get_yscale() == "log" and ax.get_xscale() == "log" and ax.get_legend() is None
        assert {line.get_gid() for line in ax.lines} == {"wall_ns_per_block", "handle_ns_per_block",
                                                          "control_ns_per_block"}
    assert len(fig.legends) == 1


def test_exposed_with_simulated_compute(tmp_path: Path) -> None:
    assert exposed.main(["--rounds", "1", "--compute-ms", "0,1", "--layers", "4", "--requests", "2",
                         "--max-tokens", "256", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "exposed.json").read_text())["rows"]
    assert [r["compute_ms"] for r in rows] == [0.0, 1.0]
    assert rows[1]["wall_ms"] >= rows[1]["compute_total_ms"]  # the simulated compute did run
    assert (tmp_path / "exposed.png").exists()


def test_profile_parser_sorts_samples_by_role_and_thread() -> None:
    sink = 'process 1:"python -m rd2h.cli demo";process 2:"python -c spawn; spawn_main()";thread (5): rd2h-sink-0;'
    prefill = 'process 1:"python -m rd2h.cli demo";process 3:"python -c spawn";thread (6): MainThread;'
    raw = "\n".join([
        sink + "Sink._run (rd2h/decode/sink.py:1);Sink._on_ready (rd2h/decode/sink.py:2) 7",
        sink + "Sink._run (rd2h/decode/sink.py:1);Poller.poll (zmq/poll.py:3) 5",
        prefill + "_prefill (rd2h/cli/demo/ranks.py:9);Source.layer_ready (rd2h/prefill/source.py:4) 3",
    ])
    profile = profile_demo.parse(raw)
    busy = profile["decode", "rd2h-sink"]
    assert busy["<busy>"] == 7 and busy["<waiting>"] == 5 and busy["Sink._on_ready (sink.py)"] == 7
    assert profile["prefill", "MainThread"]["Source.layer_ready (source.py)"] == 3


@pytest.mark.skipif(shutil.which("py-spy") is None and not (Path(__import__("sys").executable).with_name("py-spy")).exists(),
                    reason="py-spy (the bench extra) is not installed")
def test_profile_demo_runs_under_py_spy(tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    try:
        code = profile_demo.main(["--json", str(out), "--rate", "200", "--", "--layers", "64", "--requests", "1",
                                  "--max-tokens", "1", "--block-size", "1", "--slots", "1", "--kv-port", "7790"])
    except SystemExit as exc:  # py-spy cannot attach here (no ptrace right): nothing to profile
        if "Permission" in str(exc) or "ptrace" in str(exc).lower():
            pytest.skip(f"py-spy cannot attach: {str(exc)[-200:]}")
        raise
    assert code == 0
    report = json.loads(out.read_text())
    assert report["demo"]["verified"]
    assert any(k.startswith("decode") for k in report["profile_us_per_layer"])


def test_trace_layer_times_every_hop() -> None:
    import trace_layer

    steps = trace_layer.trace(layers=40, port=7795)
    # warm layers (after the first tenth) go down the step's lane: no planning of their own
    assert {"D sink: lane >", "D sink: read <", "P source: gate released >", "whole cycle"} <= set(steps)
    assert "D sink: plan <" not in steps
    assert steps["whole cycle"] > 0


def test_mapping_path_copies_right(tmp_path: Path) -> None:
    import mapping_path

    out = tmp_path / "mapping.json"
    assert mapping_path.main(["--layers", "2", "--layer-mib", "0.5", "--repeat", "1", "--json", str(out)]) == 0
    assert set(json.loads(out.read_text())["ratios"]) >= {"mapped copy 2t / memcpy 2t", "mapped copy 2t / local 2t"}


def _pd_results(pd_ttft: list[float], stages: tuple[float, float] = (7.0, 22.0)) -> dict[str, Any]:
    """Results as vllm_pd.py writes them, with the medians docs/vllm.md recorded (TTFT 75 ms
    through the proxy against 42, total 87 against 80, rendezvous 7, Prefill 22)."""
    rows = [{"pd_ttft_ms": t, "pd_total_ms": t + 12.0, "single_ttft_ms": 42.0 + i, "single_total_ms": 80.0 + i,
             "rendezvous_ms": stages[0], "prefill_ms": stages[1], "prompt_tokens": 455}
            for i, t in enumerate(pd_ttft)]
    return {"settings": {"max_tokens": 32}, "stages": [list(s) for s in pd_breakdown.DEFAULT_STAGES],
            "requests": rows}


def test_pd_breakdown_adds_up_to_the_median_ttft() -> None:
    b = pd_breakdown.breakdown(_pd_results([70.0, 75.0, 90.0]))
    assert [label for label, _ in b.parts] == [*(s[1] for s in pd_breakdown.DEFAULT_STAGES), pd_breakdown.REST]
    assert [ms for _, ms in b.parts] == [7.0, 22.0, 46.0] and b.overshoot_ms == 0
    assert b.ratios == {"ttft": 75.0 / 43.0, "total": 87.0 / 81.0}
    text = pd_breakdown.table(b)
    assert "1.74x  <= 1.3x missed" in text and "1.07x  <= 1.1x met" in text
    over = pd_breakdown.breakdown(_pd_results([20.0, 25.0, 30.0]))  # stages' medians beyond the TTFT's
    assert over.parts[-1] == (pd_breakdown.REST, 0.0) and over.overshoot_ms == 4.0
    with pytest.raises(ValueError, match="'single_ttft_ms'"):
        pd_breakdown.breakdown({"requests": [{"pd_ttft_ms": 1, "pd_total_ms": 2, "single_total_ms": 3}]})


def test_pd_breakdown_figure_stacks_every_stage_with_the_goals_and_the_legend_outside() -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    runs = [_pd_results([70.0, 75.0, 90.0]), _pd_results([250.0, 300.0, 310.0], stages=(60.0, 130.0))]
    fig = pd_breakdown.figure(runs, titles=["docs/vllm.md", "issue 23"])
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in panels] == ["docs/vllm.md", "issue 23"]
    assert panels[0].get_shared_x_axes().joined(panels[0], panels[1])  # runs compare on one time axis
    for ax, run in zip(panels, runs):
        b = pd_breakdown.breakdown(run)
        bars = {(p.get_gid(), p.get_y() + p.get_height() / 2): p for p in ax.patches}
        pd_row = [p for (gid, y), p in sorted(bars.items(), key=lambda kv: kv[1].get_x()) if y == 0.0]
        # the P/D bar: each stage, the rest, then the time after the first token, end to end
        assert [p.get_gid() for p in pd_row] == [label for label, _ in b.parts] + [pd_breakdown.AFTER]
        assert all(a.get_x() + a.get_width() == pytest.approx(n.get_x()) for a, n in zip(pd_row, pd_row[1:]))
        assert pd_row[-2].get_x() + pd_row[-2].get_width() == pytest.approx(b.pd_ttft)
        assert pd_row[-1].get_x() + pd_row[-1].get_width() == pytest.approx(b.pd_total)
        one = bars[pd_breakdown.ONE_ENGINE_TTFT, 1.0]
        assert one.get_width() == pytest.approx(b.single_ttft)
        goals = {line.get_gid(): line.get_xdata()[0] for line in ax.lines if str(line.get_gid()).startswith("goal")}
        assert goals == pytest.approx({"goal ttft": 1.3 * b.single_ttft, "goal total": 1.1 * b.single_total})
        (ratios,) = [t for t in ax.texts if t.get_gid() == "ratios"]
        assert ratios.get_text() == f"TTFT {b.ratios['ttft']:.2f}x, total {b.ratios['total']:.2f}x of one engine"
        assert ax.get_legend() is None
    FigureCanvasAgg(fig).draw()
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    (legend,) = fig.legends
    assert not any(legend.get_window_extent(renderer).overlaps(ax.get_window_extent(renderer)) for ax in panels)


def test_vllm_pd_redraws_recorded_results_without_an_engine(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import vllm_pd

    recorded = tmp_path / "vllm_pd.json"
    recorded.write_text(json.dumps(_pd_results([70.0, 75.0, 90.0])))
    assert vllm_pd.main(["--plot-from", str(recorded)]) == 0
    assert (tmp_path / "vllm_pd.png").read_bytes()[:4] == b"\x89PNG"
    assert "time to first token" in capsys.readouterr().out
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"rows": []}))
    with pytest.raises(SystemExit):
        vllm_pd.main(["--plot-from", str(other)])
    assert f"--plot-from {other}: not vllm_pd.py results" in capsys.readouterr().err


def test_vllm_pd_refuses_a_role_configured_twice(capsys: pytest.CaptureFixture[str]) -> None:
    import vllm_pd

    with pytest.raises(SystemExit):
        vllm_pd.main(["--config", 'decode={"channel": "tcp"}', "--config", 'decode={"channel": "zmq"}'])
    assert "--config names a role more than once: ['decode']" in capsys.readouterr().err
