"""Pipeline-parallel layer arithmetic (issue 20, item 3) against vLLM's own objects: its layer
split (``get_pp_indices``, ``VLLM_PP_LAYER_PARTITION``), its rank order (``ParallelConfig``:
DP x PP x TP, ``ModelConfig.get_layers_start_end_indices``) and its layer names
(``extract_layer_index``)."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from vllm_kit import write_model

from rd2h.errors import ConfigError, PortError
from rd2h.layout.topology import base_port
from rd2h.vllm.pipeline import StageSplit, layer_index, pulls, sends, stage_base_port


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("model"))


def test_the_even_split_is_vllms(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.distributed.utils import get_pp_indices

    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    for num_layers in range(1, 41):
        for pp in range(1, min(num_layers, 8) + 1):
            split = StageSplit.of(num_layers, pp)
            assert [(r.start, r.stop) for r in map(split.layers, range(pp))] == [
                get_pp_indices(num_layers, rank, pp) for rank in range(pp)
            ], (num_layers, pp)


@pytest.mark.parametrize("partition", ["1,3", "3,1", "2,2", "1,1,2", "2,1,1", "4"])
def test_an_explicit_partition_is_vllms(monkeypatch: pytest.MonkeyPatch, partition: str) -> None:
    from vllm.distributed.utils import get_pp_indices

    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", partition)
    pp = partition.count(",") + 1
    split = StageSplit.of(4, pp, partition)
    assert [(r.start, r.stop) for r in map(split.layers, range(pp))] == [get_pp_indices(4, r, pp) for r in range(pp)]


@pytest.mark.parametrize("partition", ["1,2", "2,2,0", "a,b", "4,0"])
def test_a_partition_vllm_refuses_is_refused(partition: str) -> None:
    with pytest.raises(ConfigError):
        StageSplit.of(4, 2, partition)


def test_each_rank_holds_the_layers_vllms_model_config_gives_it(model: Path) -> None:
    """Every rank of a TP 2 x PP 2 engine: vLLM's own range for it (rank order DP x PP x TP)."""
    from vllm.config import ModelConfig, ParallelConfig

    model_config = ModelConfig(model=str(model), skip_tokenizer_init=True, dtype="float32", max_model_len=512)
    layers = model_config.get_total_num_hidden_layers()
    tp, pp = 2, 2
    split = StageSplit.of(layers, pp)
    for rank in range(tp * pp):
        parallel = ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp, rank=rank)
        start, end = model_config.get_layers_start_end_indices(parallel)
        assert split.layers(rank // tp) == range(start, end)


@st.composite
def _splits(draw: Any) -> tuple[StageSplit, StageSplit]:
    layers = draw(st.integers(1, 24))
    out = []
    for _ in range(2):  # Prefill's split, then Decode's: stage boundaries anywhere inside the model
        cuts = draw(st.lists(st.integers(1, layers - 1), unique=True, max_size=7)) if layers > 1 else []
        bounds = [0, *sorted(cuts), layers]
        out.append(StageSplit(tuple(b - a for a, b in itertools.pairwise(bounds))))
    return out[0], out[1]


@given(_splits())
def test_every_layer_is_pulled_once_from_the_stage_that_computed_it(splits: tuple[StageSplit, StageSplit]) -> None:
    prefill, decode = splits
    pulled: dict[int, int] = {}  # layer -> the Prefill stage a Decode stage pulls it from
    for d in range(decode.pp_size):
        got = pulls(prefill, decode, d)
        assert sorted(i for r in got.values() for i in r) == list(decode.layers(d))  # its layers, each once
        for p, layers in got.items():
            assert layers, "no empty source"
            for layer in layers:
                assert layer not in pulled
                pulled[layer] = p
                assert prefill.stage_of(layer) == p and decode.stage_of(layer) == d
    assert sorted(pulled) == list(range(prefill.num_layers))
    # the Prefill side's view is the same table
    for p in range(prefill.pp_size):
        for d, layers in sends(prefill, decode, p).items():
            assert pulls(prefill, decode, d)[p] == layers


def test_splits_of_different_models_are_refused() -> None:
    with pytest.raises(ConfigError, match="not the same model"):
        pulls(StageSplit((2, 2)), StageSplit((3, 2)), 0)


def test_stage_ports_follow_vllms_rank_order_and_never_collide() -> None:
    kv_port = 20000
    seen: dict[int, tuple[int, int, int]] = {}
    for dp, pp_rank, tp_rank in itertools.product(range(3), range(4), range(2)):
        port = stage_base_port(kv_port, dp, 2, 4, pp_rank) + tp_rank
        assert port not in seen, (seen[port], (dp, pp_rank, tp_rank))
        seen[port] = (dp, pp_rank, tp_rank)
        assert port == kv_port + (dp * 4 + pp_rank) * 2 + tp_rank  # vLLM's global rank within the host
    for dp, tp in itertools.product(range(4), range(1, 5)):
        assert stage_base_port(kv_port, dp, tp, 1, 0) == base_port(kv_port, dp, tp)  # one stage: today's ports
    with pytest.raises(ConfigError):
        stage_base_port(kv_port, 0, 1, 2, 2)
    with pytest.raises(PortError):
        stage_base_port(65000, 100, 8, 2, 1)


def test_layer_index_reads_names_as_vllm_does() -> None:
    from vllm.model_executor.models.utils import extract_layer_index

    names = ["model.layers.0.self_attn.attn", "model.layers.17.self_attn.attn", "encoder.layers.3",
             "model.language_model.layers.5.attn", "2.self_attn", "model.layers.12.mlp.experts"]  # fmt: skip
    for name in names:
        assert layer_index(name) == extract_layer_index(name)
    for bad in ["model.embed_tokens", "model.layers.1.experts.2", "", "model.layers.x"]:
        with pytest.raises(ConfigError):
            layer_index(bad)


# -- the connector at startup: vLLM's own config objects -------------------------------------


def _connector(model: Path, role: str, extra: dict | None = None) -> Any:
    from test_vllm_kv_groups import _vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from rd2h.vllm.connector import RD2HConnector

    config = _vllm_config(model, role=role, hybrid=False, extra=extra, pipeline_parallel_size=2)
    return RD2HConnector(config, KVConnectorRole.SCHEDULER, None)


def test_a_prefill_may_run_pipeline_parallel(model: Path) -> None:
    connector = _connector(model, "kv_producer")
    connector.shutdown()


@pytest.mark.parametrize("role", ["kv_consumer", "kv_both"])
def test_a_decode_with_pipeline_parallel_is_refused_at_startup(model: Path, role: str) -> None:
    with pytest.raises(ConfigError, match=r"pipeline parallel on Decode yet \(pipeline_parallel_size=2\): a Decode stage"):
        _connector(model, role)


def test_a_pipeline_prefill_with_handoff_port_is_refused_at_startup(model: Path) -> None:
    """vLLM's P/D convention: each rank binds handoff_port + rank, and the stages would collide."""
    with pytest.raises(ConfigError, match="handoff_port .* does not support pipeline parallel"):
        _connector(model, "kv_producer", {"handoff_port": 23456})


def test_a_worker_names_its_stage_from_vllms_pipeline_group(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm.distributed.parallel_state as parallel_state

    from rd2h.vllm.parallel import pipeline_stage

    assert pipeline_stage() == {}  # no vLLM worker here: its groups are not initialised

    class Group:
        def __init__(self, rank: int, size: int) -> None:
            self.rank_in_group, self.world_size = rank, size

    monkeypatch.setattr(parallel_state, "get_pp_group", lambda: Group(1, 2))
    assert pipeline_stage() == {"pp_rank": 1, "pp_size": 2}
    monkeypatch.setattr(parallel_state, "get_pp_group", lambda: Group(0, 1))
    assert pipeline_stage() == {}  # one stage: an mf_meta like any other
