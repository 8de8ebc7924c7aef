"""Pipeline parallel over real sockets and the local engine (issue 20, item 3). A Prefill run with
it: each stage is a KVSource holding its own layers, its mf_meta naming its stage
(``pp_rank``/``pp_size``); one KVSink holding every layer completes the request once both
stages sent theirs, byte for byte. A source that says it is no stage but holds only some
layers fails the request instead (its final claims what it never sent). A Decode run with it:
one KVSink per stage, each on its stage's ports; the endpoint names the stages and the Prefill
sends each layer to the stage that holds it."""

from __future__ import annotations

import numpy as np
import pytest

from rd2h.api import DecodeEndpoint, KVSink, KVSource, LayerTensors
from rd2h.errors import ConfigError
from rd2h.outcome import TerminalState

BLOCK, NB = 16, 16


def _layer(fill: bool, seed: int) -> LayerTensors:
    rng = np.random.default_rng(seed)
    make = (lambda w: rng.integers(1, 255, (NB, w), dtype=np.uint8)) if fill else (lambda w: np.zeros((NB, w), np.uint8))
    return LayerTensors(main=[make(128), make(128)])


def test_two_stages_fill_one_decode_rank(kv_port: int) -> None:
    src = {f"model.layers.{i}.attn": _layer(True, i) for i in range(3)}
    dst = {name: _layer(False, 0) for name in src}
    names = list(src)
    stage0, stage1 = {n: src[n] for n in names[:2]}, {n: src[n] for n in names[2:]}  # vLLM's split of 3 over 2
    tokens = 3 * BLOCK - 4
    with KVSink(dst, kv_port=kv_port) as sink, \
            KVSource(stage0, block_size=BLOCK, pp_rank=0, pp_size=2) as first, \
            KVSource(stage1, block_size=BLOCK, pp_rank=1, pp_size=2) as second:  # fmt: skip
        sink.expect("r", main_blocks=[7, 2, 11])
        for stage in (first, second):
            stage.add_request("r", sink.endpoint, main_block_ids=[1, 4, 5], num_tokens=tokens)
        first.send_all({"r": tokens})
        assert first.wait_finished(["r"], 10)["r"].ok
        assert sink.take() == {}  # stage 0's layers are in; stage 1's are not: nothing settled
        second.send_all({"r": tokens})
        assert second.wait_finished(["r"], 10)["r"].ok
        assert sink.wait(["r"], 10)["r"].state is TerminalState.DONE
    for name in names:
        for d, s in zip(dst[name].main, src[name].main):
            assert np.array_equal(d[[7, 2, 11]], s[[1, 4, 5]])


def test_a_source_that_is_no_stage_must_send_every_layer(kv_port: int) -> None:
    src = {f"model.layers.{i}.attn": _layer(True, i) for i in range(2)}
    dst = {name: _layer(False, 0) for name in src}
    first = dict(list(src.items())[:1])
    with KVSink(dst, kv_port=kv_port) as sink, KVSource(first, block_size=BLOCK) as source:
        sink.expect("r", main_blocks=[3])
        source.add_request("r", sink.endpoint, main_block_ids=[0], num_tokens=BLOCK)
        source.send_all({"r": BLOCK})
        outcome = sink.wait(["r"], 10)["r"]
        assert outcome.state is TerminalState.FAILED and "never announced layer(s) model.layers.1.attn" in str(outcome.error)
        assert not source.wait_finished(["r"], 10)["r"].ok


def test_one_source_fills_two_decode_stages_each_with_its_layers(kv_port: int) -> None:
    """A Decode run with pipeline parallel: stage 0 holds layers 0-1 (ports from kv_port), stage 1
    layer 2 (ports from kv_port + tp). The endpoint names the stages; the Prefill sends each layer
    only to the stage holding it, each stage's final signal with that stage's last layer."""
    src = {f"model.layers.{i}.attn": _layer(True, i) for i in range(3)}
    names = list(src)
    first = {n: _layer(False, 0) for n in names[:2]}
    second = {n: _layer(False, 0) for n in names[2:]}
    tokens = 2 * BLOCK + 3
    with KVSink(first, kv_port=kv_port, dp_rank=0) as stage0, KVSink(second, kv_port=kv_port, dp_rank=1) as stage1, \
            KVSource(src, block_size=BLOCK, model_layers=[0, 1, 2]) as source:  # fmt: skip
        endpoint = DecodeEndpoint("127.0.0.1", kv_port, 1, (2, 1))
        assert endpoint.stage(1) == stage1.endpoint
        for sink in (stage0, stage1):
            sink.expect("r", main_blocks=[9, 0, 5])
        source.add_request("r", DecodeEndpoint.parse(str(endpoint)), main_block_ids=[2, 3, 4], num_tokens=tokens)
        source.send_all({"r": tokens})
        assert source.wait_finished(["r"], 10)["r"].ok
        for sink in (stage0, stage1):
            assert sink.wait(["r"], 10)["r"].state is TerminalState.DONE
    for dst in (first, second):
        for name, layer in dst.items():
            for d, s in zip(layer.main, src[name].main):
                assert np.array_equal(d[[9, 0, 5]], s[[2, 3, 4]])


def test_a_source_without_model_layers_refuses_a_decode_with_stages(kv_port: int) -> None:
    src = {"model.layers.0.attn": _layer(True, 0)}
    with KVSource(src, block_size=BLOCK) as source:
        with pytest.raises(ConfigError, match="runs pipeline parallel.*model_layers"):
            source.add_request("r", DecodeEndpoint("127.0.0.1", kv_port, 1, (1, 1)), num_tokens=BLOCK)
