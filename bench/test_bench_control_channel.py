"""bench/control_channel.py once at a tiny size, as a correctness test: every arm completes (the
demos verify every byte) and the JSON holds a ratio per arm. No timing is asserted."""

from __future__ import annotations

import json
import math
from pathlib import Path

import busy_poll
import busy_poll_gil
import control_channel
import pingpong


def test_socket_pingpong_round_trips() -> None:
    result = pingpong.measure_socket(50)
    assert result["rounds"] == 50 and 0 < result["p50_us"] <= result["p99_us"]


def test_every_arm_runs_and_is_held_against_the_zmq_pingpong(tmp_path: Path) -> None:
    out = tmp_path / "control_channel.json"
    assert control_channel.main(["--rounds", "1", "--messages", "20", "--layers", "8", "--json", str(out)]) == 0
    summary = json.loads(out.read_text())["summary"]
    arms = {"zmq ping-pong", "socket ping-pong", "channel zmq", "channel tcp", "layer zmq", "layer tcp", "layer tcp busy"}
    assert set(summary) == arms | {"load"}
    assert 0 <= summary["load"]["min"] <= summary["load"]["median"] <= summary["load"]["max"]
    summary.pop("load")
    assert summary["zmq ping-pong"]["over_zmq_pingpong"] == 1.0
    assert summary["socket ping-pong"]["over_socket_pingpong"] == 1.0
    assert all(s["p50_us"] > 0 and s["over_socket_pingpong"] > 0 for s in summary.values())
    assert summary["layer tcp"]["over_layer_zmq"] > 0 and summary["layer tcp busy"]["over_layer_zmq"] > 0


def test_busy_poll_cost_script_reports_both_parts(tmp_path: Path) -> None:
    out = tmp_path / "busy_poll.json"
    assert busy_poll.main(["--rounds", "1", "--messages", "20", "--layers", "264", "--json", str(out)]) == 0
    summary = json.loads(out.read_text())["summary"]
    assert all(summary[f"ping-pong {arm}"]["p50_us"] > 0 for arm in ("blocking", "spinning"))
    assert all(summary[f"demo busy_poll_us={bp}"]["layer_p50_us"] > 0 for bp in (0, 300))
    assert math.isfinite(summary["cpu_on_over_off"])


def test_busy_poll_gil_script_times_compute_while_frames_flow(tmp_path: Path) -> None:
    out = tmp_path / "busy_poll_gil.json"
    # work long enough (~0.1 s an arm) that frames flow while it runs even on a loaded machine
    assert busy_poll_gil.main(["--rounds", "1", "--scale", "0.5", "--json", str(out)]) == 0
    summary = json.loads(out.read_text())["summary"]
    for kind in ("python", "numpy"):
        assert math.isfinite(summary[kind]["polled_over_not"]) and summary[kind]["polled_over_not"] > 0
        assert summary[kind]["frames_while_computing"] > 0, "no frame flowed while the compute thread was timed"
