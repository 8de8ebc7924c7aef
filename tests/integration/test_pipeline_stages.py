"""A Prefill run with pipeline parallel, over real sockets and the local engine (issue 20,
item 3): each stage is a KVSource holding its own layers, its mf_meta naming its stage
(``pp_rank``/``pp_size``); one KVSink holding every layer completes the request once both
stages sent theirs, byte for byte. A source that says it is no stage but holds only some
layers fails the request instead (its final claims what it never sent)."""

from __future__ import annotations

import numpy as np

from rd2h.api import KVSink, KVSource, LayerTensors
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
