"""Every KV cache group vLLM makes is pulled or refused at startup (issue 20, items 1, 3, 4).

The groups come from vLLM's own grouping (``get_kv_cache_groups``) over vLLM's spec objects,
so a change in how vLLM groups a hybrid model shows here; the connector is vLLM's own
object built from a real ``VllmConfig``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from vllm_kit import engine_config, write_model

from rd2h.errors import ConfigError
from rd2h.vllm.config import ConnectorConfig, Mode
from rd2h.vllm.kv_groups import check_groups, layers_to_pull
from rd2h.vllm.parallel import check_parallel, dp_rank_of
from rd2h.vllm.worker import RD2HWorker

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]


def _vllm_config(model: Path, *, role: str | None = None, hybrid: bool = True, extra: dict | None = None,
                 **parallel: Any) -> Any:
    return engine_config(model, role, extra=extra, parallel=parallel, disable_hybrid_kv_cache_manager=not hybrid)


def _specs(window: int = 64) -> dict[str, Any]:
    """A Gemma-2-style model: even layers slide over ``window`` tokens, odd ones see all."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    full = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    swa = SlidingWindowSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32, sliding_window=window)
    return {name: swa if i % 2 == 0 else full for i, name in enumerate(LAYERS)}


def _kv_cache_config(vllm_config: Any, specs: dict[str, Any]) -> Any:
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs

    return get_kv_cache_configs(vllm_config, [dict(specs)], [64 << 20])[0]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("model"))


def test_hybrid_sliding_window_groups_are_refused_in_sfa_mode_naming_the_kind_and_layers(model: Path) -> None:
    """dense mode pulls them (tests/unit/test_vllm_hybrid_groups.py); sfa pulls main KV and an indexer only."""
    kv = _kv_cache_config(_vllm_config(model), _specs())
    assert len(kv.kv_cache_groups) == 2  # vLLM's hybrid allocator: a block table per kind
    for mode in [Mode.SFA]:
        with pytest.raises(ConfigError) as err:
            check_groups(kv, mode)
        text = str(err.value)
        assert "sliding window (64 tokens)" in text and "model.layers.0.self_attn.attn" in text
        assert "model.layers.1.self_attn.attn" in text  # the full-attention layers are not pulled either
        assert "--disable-hybrid-kv-cache-manager" in text


def test_without_the_hybrid_allocator_every_layer_is_one_full_attention_group(model: Path) -> None:
    kv = _kv_cache_config(_vllm_config(model, hybrid=False), _specs())
    infos = check_groups(kv, Mode.DENSE)
    assert [i.kind for i in infos] == ["full attention"]
    assert layers_to_pull(infos, LAYERS, Mode.DENSE) == LAYERS


def test_mamba_groups_not_served_and_other_kinds_are_refused_by_name() -> None:
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
    )

    full = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    # prefix caching's Mamba mode (a state per block position): refused; mode 'none' is pulled (test_vllm_mamba.py)
    mamba = MambaSpec(block_size=32, shapes=((4, 64), (2, 16, 16)), dtypes=(torch.float32, torch.float32),
                      mamba_cache_mode="align")  # fmt: skip
    kv = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(LAYERS[:2], full), KVCacheGroupSpec(["model.layers.2.mixer"], mamba)])  # fmt: skip
    with pytest.raises(ConfigError, match=r"group 1 \(mamba / linear-attention state, 1 layers: model.layers.2.mixer\)"):
        check_groups(kv, Mode.DENSE)
    # a pure mamba model
    with pytest.raises(ConfigError, match="mamba / linear-attention state.*cannot be transferred with mamba_cache_mode"):
        check_groups(KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                                   kv_cache_groups=[KVCacheGroupSpec(LAYERS, mamba)]), Mode.DENSE)  # fmt: skip
    local = ChunkedLocalAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32,
                                      attention_chunk_size=128)  # fmt: skip
    with pytest.raises(ConfigError, match=r"chunked local attention \(128 tokens\)"):
        check_groups(KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                                   kv_cache_groups=[KVCacheGroupSpec(LAYERS, local)]), Mode.DENSE)  # fmt: skip


def test_sfa_pulls_the_indexer_group_and_refuses_a_third() -> None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec

    mla = MLAAttentionSpec(block_size=32, num_kv_heads=1, head_size=576, dtype=torch.float32)
    idx = MLAAttentionSpec(block_size=32, num_kv_heads=1, head_size=128, dtype=torch.float32)
    extra = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    attn = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    indexer = [n + ".indexer.k_cache" for n in attn]
    groups = [KVCacheGroupSpec(attn, mla), KVCacheGroupSpec(indexer, idx)]
    infos = check_groups(KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups), Mode.SFA)
    assert layers_to_pull(infos, attn + indexer, Mode.SFA) == attn + indexer
    with pytest.raises(ConfigError, match="group 1 .*does not pull"):  # dense mode has no indexer
        check_groups(KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups), Mode.DENSE)
    third = [*groups, KVCacheGroupSpec(["model.layers.2.self_attn.attn"], extra)]
    with pytest.raises(ConfigError, match="1 of 3 KV cache groups would not be pulled: group 2 .*model.layers.2"):
        check_groups(KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=third), Mode.SFA)


def test_registration_refuses_a_stray_layer_and_leaves_out_groups_vllm_rebuilds() -> None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    full = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    replica = KVCacheGroupSpec(["model.layers.3.replica"], full, enable_kv_transfer=False)
    kv = KVCacheConfig(num_blocks=4, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(LAYERS[:2], full), replica])
    infos = check_groups(kv, Mode.DENSE)
    assert layers_to_pull(infos, [*LAYERS[:2], "model.layers.3.replica"], Mode.DENSE) == LAYERS[:2]
    with pytest.raises(ConfigError, match=r"1 registered KV cache layers belong to no KV cache group it pulls \(x.attn\)"):
        layers_to_pull(infos, [*LAYERS[:2], "x.attn"], Mode.DENSE)
    # the worker checks what vLLM registers before it builds anything
    worker = RD2HWorker(ConnectorConfig(), consumer=False, producer=True, rank=0, tp_size=1, dp_rank=0,
                        block_sizes=[32], kv_cache_config=kv)  # fmt: skip
    caches = {name: torch.zeros(4, 2, 32, 64) for name in [*LAYERS[:2], "x.attn"]}
    with pytest.raises(ConfigError, match="x.attn"):
        worker.register(caches, dict.fromkeys(caches, 4))
    assert worker.source is None


def test_connector_refuses_a_hybrid_kv_cache_config_in_sfa_mode_at_startup_in_both_roles(model: Path) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from rd2h.vllm.connector import RD2HConnector

    for role in ("kv_consumer", "kv_producer"):
        config = _vllm_config(model, role=role, extra={"mode": "sfa"})
        kv = _kv_cache_config(config, _specs())
        for connector_role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
            with pytest.raises(ConfigError, match="sliding window"):
                RD2HConnector(config, connector_role, kv)


def test_pipeline_parallel_with_handoff_port_is_refused_at_startup(model: Path) -> None:
    """Served otherwise (tests/unit/test_vllm_pipeline.py); vLLM's convention's ports carry no stage."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from rd2h.vllm.connector import RD2HConnector

    check_parallel(_vllm_config(model).parallel_config, handoff=True)  # PP 1 passes
    config = _vllm_config(model, role="kv_producer", hybrid=False, extra={"handoff_port": 23456},
                          pipeline_parallel_size=2)  # fmt: skip
    with pytest.raises(ConfigError, match=r"pipeline parallel yet \(pipeline_parallel_size=2\).*--pipeline-parallel-size 1"):
        RD2HConnector(config, KVConnectorRole.SCHEDULER, None)


def test_a_dense_dp_rank_keeps_its_global_rank_in_the_ports(model: Path) -> None:
    """vLLM sets data_parallel_rank to 0 in every DP rank of a dense model; the ports must
    still differ per rank, or two DP ranks on one host bind the same port."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from rd2h.vllm.connector import RD2HConnector

    config = _vllm_config(model, role="kv_consumer", hybrid=False, data_parallel_size=2, data_parallel_rank=1)
    config.parallel_config.reconfigure_for_independent_dp_rank()  # what vLLM's DP engine core does
    assert config.parallel_config.data_parallel_rank == 0 and dp_rank_of(config.parallel_config) == 1
    connector = RD2HConnector(config, KVConnectorRole.SCHEDULER, None)
    try:
        assert connector.scheduler.endpoint.base_port == 5600 + 1  # kv_port + dp_rank * tp
    finally:
        connector.shutdown()
