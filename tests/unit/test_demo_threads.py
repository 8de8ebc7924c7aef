"""The demo splits this host's cores between roles: Decode's local engine gets its share."""

from __future__ import annotations

from rd2h.cli.demo.workload import DemoConfig


def test_decode_read_threads_are_a_share_of_the_cores() -> None:
    one_one = DemoConfig(prefill_tp=1, decode_tp=1)
    assert one_one.options_for("decode", 2) == {"threads": 1}
    assert one_one.options_for("decode", 16) == {"threads": 8}
    assert DemoConfig(prefill_tp=4, decode_tp=2).options_for("decode", 2) == {"threads": 1}
    assert one_one.options_for("prefill", 16) == {}  # Prefill never reads
    assert one_one.options_for("decode") == {}  # cores unknown: the engine's own default


def test_threads_given_or_another_engine_are_left_alone() -> None:
    told = DemoConfig(prefill_tp=1, decode_tp=1, engine_options={"threads": 2})
    assert told.options_for("decode", 16) == {"threads": 2}
    by_side = DemoConfig(prefill_tp=1, decode_tp=1, decode_engine_options={"threads": 3})
    assert by_side.options_for("decode", 2) == {"threads": 3}
    assert DemoConfig(prefill_tp=1, decode_tp=1, engine="nixl").options_for("decode", 16) == {}
