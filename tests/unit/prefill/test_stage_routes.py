"""A Decode run with pipeline parallel (issue 20, item 3): its endpoint names how many model
layers each stage holds (``host:port/tp/n0,n1``), and a Prefill rank sends each of its layers
only to the stage holding it, each stage's final signal with the last layer it gets (pure)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_send_tracker import META, done, readiness, tracker

from rd2h.errors import ConfigError, PortError
from rd2h.outcome import TerminalState
from rd2h.prefill.stage_routes import Route, stage_routes
from rd2h.wire.endpoint import DecodeEndpoint

STAGED = DecodeEndpoint("127.0.0.1", 5600, 2, (2, 1))  # TP 2; layers 0-1 on stage 0, layer 2 on stage 1


def test_the_endpoint_names_its_stages_in_text_and_back() -> None:
    assert str(STAGED) == "127.0.0.1:5600/2/2,1" and DecodeEndpoint.parse("127.0.0.1:5600/2/2,1") == STAGED
    assert DecodeEndpoint.from_bytes(STAGED.to_bytes()) == STAGED
    assert STAGED.stage(1) == DecodeEndpoint("127.0.0.1", 5602, 2)  # its ranks from base + stage * tp
    assert str(DecodeEndpoint("::1", 5600, 1, (1, 1))) == "[::1]:5600/1/1,1"
    for bad in ["h:5600/2/3", "h:5600/2/1,0", "h:5600/2/", "h:5600/2/1,,1", "h:5600/2/" + ",".join(["1"] * 65)]:
        with pytest.raises(ConfigError):
            DecodeEndpoint.parse(bad)
    with pytest.raises(ConfigError):
        STAGED.stage(2)
    with pytest.raises(PortError):
        DecodeEndpoint("h", 65535, 1, (1, 1)).stage(1)


@given(st.lists(st.integers(1, 4), min_size=2, max_size=5), st.integers(1, 3))
def test_every_layer_goes_to_the_stage_holding_it_and_nowhere_else(counts: list[int], tp: int) -> None:
    endpoint = DecodeEndpoint("h", 20000, tp, tuple(counts))
    layers = list(range(sum(counts)))
    routes = stage_routes(endpoint, 0, 1, layers)  # Prefill TP 1: fan-out to every rank of each stage
    start = 0
    for stage, count in enumerate(counts):
        mine = frozenset(range(start, start + count))
        start += count
        got = [r for r in routes if r.layers == mine]
        assert [r.address for r in got] == [endpoint.stage(stage).address(d) for d in range(tp)]
        assert all(r.last == max(mine) for r in got)
    assert len(routes) == len(counts) * tp


def test_a_prefill_stage_reaches_only_the_decode_stages_holding_its_layers() -> None:
    """Prefill holding model layers 1-2 only (a stage of its own): local 0 is model 1 (Decode
    stage 0), local 1 is model 2 (Decode stage 1)."""
    routes = stage_routes(STAGED, 1, 2, [1, 2])
    assert routes == [Route(STAGED.stage(0).address(1), frozenset({0}), 0),
                      Route(STAGED.stage(1).address(1), frozenset({1}), 1)]  # fmt: skip
    assert stage_routes(STAGED, 0, 2, [2]) == [Route(STAGED.stage(1).address(0), frozenset({0}), 0)]
    assert stage_routes(DecodeEndpoint("h", 5600, 2), 1, 2, None) == [Route("tcp://h:5601")]  # no stages: all


def test_layers_a_staged_decode_cannot_place_are_refused() -> None:
    with pytest.raises(ConfigError, match="model_layers"):
        stage_routes(STAGED, 0, 1, None)
    with pytest.raises(ConfigError, match=r"holds model layers 0..2; this Prefill has layers \[3\]"):
        stage_routes(STAGED, 0, 1, [2, 3])


def test_the_tracker_sends_each_stage_its_layers_and_its_own_final_signal() -> None:
    t = tracker(tp_size=1, model_layers=[0, 1, 2])
    endpoint = DecodeEndpoint("127.0.0.1", 5600, 1, (2, 1))
    first, second = endpoint.stage(0).address(0), endpoint.stage(1).address(0)
    t.add_request("r", endpoint, main_block_ids=[1, 2], num_tokens=8, now=0.0)
    step, problems = t.schedule({"r": 8}, 0.0)
    assert problems == {}
    sent: dict[str, list[tuple[int, tuple[str, ...]]]] = {first: [], second: []}
    for layer in range(3):
        targets, effects = t.announce(step, layer, f"l{layer}", 0.0)
        assert list(targets) == [first if layer < 2 else second]  # only the stage holding it
        for address, _, frame in effects.sends:
            if frame != META:
                message = readiness(frame)
                sent[address].append((message.layer_idx, message.done_ext_ids))
    assert sent == {first: [(0, ()), (1, ("r",))], second: [(2, ("r",))]}  # a final per stage
    for address, layers in ((first, (0, 1)), (second, (2,))):
        t.on_reply(address, b"ACK", 0.0)
        for layer in layers:
            t.on_reply(address, done(layer), 0.0)
    assert t.take()["r"].state is TerminalState.DONE
