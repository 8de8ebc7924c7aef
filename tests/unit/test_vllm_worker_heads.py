"""The connector's workers with a GQA model at unequal TP, over real zmq and the local engine:
each Decode rank's blocks hold exactly its KV heads of what the Prefill ranks computed
(vLLM's CPU cache ``[blocks, kv_heads, block_size, 2 * head_size]``, heads split as vLLM splits
them, replicated where the model has fewer KV heads than ranks)."""

from __future__ import annotations

import pytest
import torch
from conftest import free_base_port
from test_vllm_worker import BLOCKS, _settle, run_prefill

from rd2h.errors import ConfigError
from rd2h.layout.heads import kv_heads_of
from rd2h.vllm.config import ConnectorConfig
from rd2h.vllm.metadata import RecvSpec, SendFinish, SendSpec, StepMetadata
from rd2h.vllm.worker import RD2HWorker

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
KV_HEADS = 2


def _worker(config: ConnectorConfig, role: str, tp: int, rank: int, caches: dict) -> RD2HWorker:
    worker = RD2HWorker(config, consumer=role == "decode", producer=role == "prefill", rank=rank, tp_size=tp,
                        dp_rank=0, block_sizes=[32], kv_heads=KV_HEADS)  # fmt: skip
    worker.register(caches, {n: BLOCKS for n in caches})
    return worker


@pytest.mark.parametrize("p_tp,d_tp", [(2, 1), (1, 2), (4, 1), (1, 4), (4, 2)])
def test_each_decode_rank_gets_its_kv_heads_of_every_block(p_tp: int, d_tp: int) -> None:
    config = ConnectorConfig.from_extra({"kv_port": free_base_port(d_tp), "request_timeout": 30})
    whole = {name: torch.randn(BLOCKS, KV_HEADS, 32, 64) for name in LAYERS}

    def caches(tp: int, rank: int, fill: bool) -> dict:
        span = kv_heads_of(KV_HEADS, tp, rank)
        return {n: (t[:, span.first : span.end].clone() if fill else torch.zeros(BLOCKS, span.count, 32, 64))
                for n, t in whole.items()}  # fmt: skip

    sources = [caches(p_tp, r, True) for r in range(p_tp)]
    prefills = [_worker(config, "prefill", p_tp, r, sources[r]) for r in range(p_tp)]
    decodes = [_worker(config, "decode", d_tp, r, caches(d_tp, r, False)) for r in range(d_tp)]
    try:
        for d in decodes:
            d.bind(StepMetadata(recv=(RecvSpec("r-0", "d", ((2, 4, 6, 8, 10),), 0, 150),)))
        endpoint = f"127.0.0.1:{config.kv_port}/{d_tp}"
        for p, src in zip(prefills, sources):
            run_prefill(p, src, [
                StepMetadata(send_new=(SendSpec("r-0", "p", endpoint, ((0, 1, 3, 5, 7),), 150, 0),), computed=(("r-0", 150),)),
                StepMetadata(send_finish=(SendFinish("r-0", "p", False),)),
            ])  # fmt: skip
        _settle(prefills, decodes)  # asserts no pull failed
        for rank, d in enumerate(decodes):
            span = kv_heads_of(KV_HEADS, d_tp, rank)
            for name in LAYERS:
                got = d._tensors[name].main[0][[2, 4, 6, 8, 10]]
                assert torch.equal(got, whole[name][[0, 1, 3, 5, 7], span.first : span.end]), (rank, name)
    finally:
        for w in prefills + decodes:
            w.close()


def test_heads_not_outermost_with_another_peer_tp_are_refused_at_registration() -> None:
    """A block of [block_size, kv_heads, head_size] (NHD) cannot give a head range in one piece."""
    config = ConnectorConfig.from_extra({"kv_port": free_base_port(1), "peer_tp": 2})
    worker = RD2HWorker(config, consumer=False, producer=True, rank=0, tp_size=1, dp_rank=0, block_sizes=[32],
                        kv_heads=KV_HEADS)  # fmt: skip
    with pytest.raises(ConfigError, match="does not hold this rank's 2 KV head.*outermost"):
        worker.register({LAYERS[0]: torch.zeros(BLOCKS, 32, KV_HEADS, 64)}, {LAYERS[0]: BLOCKS})
    worker.close()
