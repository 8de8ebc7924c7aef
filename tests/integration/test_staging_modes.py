"""``RD2H_STAGING=always`` through the vLLM worker's choice (``WorkerStaging``) over real zmq
sockets and the local engine: host KV goes through the Prefill mirror and the Decode landing
buffer (host stand-in), every byte arrives, and the copy counters the worker reports
(``WorkerTally``: ``staged_bytes``, ``landed_bytes``) count exactly the bytes moved; with
``auto`` the same transfer is not staged and they stay zero."""

from __future__ import annotations

import pytest
import torch

from rd2h.api import KVSink, KVSource, StagedKVSource
from rd2h.device import HostStandIn
from rd2h.outcome import TerminalState
from rd2h.staging.choice import WorkerStaging
from rd2h.tensors import LayerTensors, layer_layout
from rd2h.vllm.stats import WorkerTally

BLOCK = 16


def layers(seed: int | None) -> dict[str, LayerTensors]:
    g = torch.Generator().manual_seed(seed or 0)
    make = (lambda *s: torch.randn(*s, generator=g)) if seed is not None else torch.zeros
    return {f"layer.{i}": LayerTensors(main=[make(12, BLOCK, 8), make(12, BLOCK, 8)]) for i in range(3)}


@pytest.mark.parametrize("mode", ["always", "auto"])
def test_forced_staging_moves_every_byte_through_mirror_and_landing_and_counts_them(
    kv_port: int, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RD2H_STAGING_BLOCKS", "4")
    monkeypatch.setenv("RD2H_STAGING_LANDING_MB", "1")
    src, dst = layers(seed=1), layers(seed=None)
    prefill = WorkerStaging(src, {n: layer_layout(t) for n, t in src.items()}, "local", {}, mode=mode)
    decode = WorkerStaging(dst, {n: layer_layout(t) for n, t in dst.items()}, "local", {}, mode=mode)
    p_tally, d_tally = WorkerTally(), WorkerTally()
    p_tally.watch_staging(prefill.counters)
    d_tally.watch_staging(decode.counters)
    p_ids, d_ids = [9, 2, 7], [0, 5, 11]
    with KVSink(dst, kv_port=kv_port, **decode.sink_options()) as sink, \
            prefill.source(KVSource, block_size=BLOCK, reuse_slots=False) as source:  # fmt: skip
        assert isinstance(source, StagedKVSource) is (mode == "always")
        sink.expect("r", main_blocks=d_ids)
        source.add_request("r", sink.endpoint, main_block_ids=p_ids, num_tokens=3 * BLOCK - 5)
        assert source.send_all({"r": 3 * BLOCK - 5}) == {}
        assert source.wait_finished(["r"], 20)["r"].ok
        assert sink.wait(["r"], 20)["r"].state is TerminalState.DONE
    for name in src:
        for k in range(2):
            assert torch.equal(dst[name].main[k][d_ids], src[name].main[k][p_ids]), name
    moved = 3 * 2 * 3 * BLOCK * 8 * 4  # layers x tensors x blocks x block bytes
    p_stats, d_stats = p_tally.take(), d_tally.take()
    if mode == "always":
        assert isinstance(prefill.mirror.device, HostStandIn) and prefill.counters() == (moved, 0)
        assert decode.landing is not None and decode.counters() == (0, moved)
        assert p_stats is not None and p_stats.data["staged_bytes"] == moved and p_stats.data["landed_bytes"] == 0
        assert d_stats is not None and d_stats.data["landed_bytes"] == moved
        assert p_stats.reduce()["Staged GB"] == round(moved / 1e9, 3) and "Landed GB" in d_stats.reduce()
    else:  # the negative control: not staged, nothing counted
        assert prefill.counters() == decode.counters() == (0, 0)
        assert p_stats is None and d_stats is None
    assert p_tally.take() is None  # deltas: nothing new since the last take
