"""Pipeline parallel (issue 20, item 3) against vLLM's own objects: its layer split
(``get_pp_indices``, ``VLLM_PP_LAYER_PARTITION``), its rank order (``ParallelConfig``: DP x PP
x TP, ``ModelConfig.get_layers_start_end_indices``), its layer names (``extract_layer_index``),
and the connector built from a real ``VllmConfig`` on either side."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from vllm_kit import write_model

from rd2h.errors import ConfigError
from rd2h.layout.topology import base_port
from rd2h.prefill.stage_routes import stage_routes
from rd2h.vllm.parallel import port_rank
from rd2h.vllm.pipeline import StageSplit, layer_index
from rd2h.wire.endpoint import DecodeEndpoint


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
def test_every_layer_goes_once_from_the_stage_that_computed_it_to_the_stage_holding_it(
    splits: tuple[StageSplit, StageSplit],
) -> None:
    """Any Prefill split, any Decode split of the same model: the routes of every Prefill stage
    (rd2h.prefill.stage_routes, what the runtime sends by) deliver each layer exactly once, to
    the Decode stage vLLM's split gives it, and each Decode stage gets its final signal with
    the last layer it gets from that Prefill stage."""
    prefill, decode = splits
    endpoint = DecodeEndpoint("h", 20000, 1, decode.counts) if decode.pp_size > 1 else None
    if endpoint is None:
        return  # one Decode stage: every layer goes to it, as without pipeline parallel
    got: dict[int, int] = {}  # model layer -> the Decode stage it was sent to
    for p in range(prefill.pp_size):
        mine = list(prefill.layers(p))  # this stage's model layers, in its announce order
        for route in stage_routes(endpoint, 0, 1, mine):
            stage = next(s for s in range(decode.pp_size) if route.address == endpoint.stage(s).address(0))
            assert route.layers and route.last == max(route.layers)
            for local in route.layers:
                assert mine[local] not in got
                got[mine[local]] = stage
    assert got == {layer: decode.stage_of(layer) for layer in range(decode.num_layers)}


def test_stage_ports_follow_vllms_rank_order_and_never_collide() -> None:
    from vllm.config import ParallelConfig

    seen: dict[int, tuple[int, int, int]] = {}
    for dp, pp_rank, tp_rank in itertools.product(range(3), range(4), range(2)):
        parallel = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=4, data_parallel_size=3,
                                  data_parallel_rank=dp)  # fmt: skip
        port = base_port(20000, port_rank(parallel, pp_rank), 2) + tp_rank
        assert port not in seen, (seen[port], (dp, pp_rank, tp_rank))
        seen[port] = (dp, pp_rank, tp_rank)
        assert port == 20000 + (dp * 4 + pp_rank) * 2 + tp_rank  # vLLM's rank order: DP x PP x TP
    assert port_rank(ParallelConfig(data_parallel_size=4, data_parallel_rank=3)) == 3  # no PP: the DP rank


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
    try:  # started (no refusal), and a Prefill posts no rendezvous of its own: it names no stages
        assert connector.rd2h_config.handoff_port is None and connector.scheduler is not None
    finally:
        connector.shutdown()


def test_pipeline_parallel_beside_what_it_was_not_built_for_is_refused_at_startup(model: Path) -> None:
    """docs/vllm.md's support matrix says refused: several KV cache groups (a storage slot two
    stages split is not handled), sfa mode, speculative decoding. Each is a ConfigError naming it."""
    from test_vllm_kv_groups import _kv_cache_config, _specs, _vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from rd2h.errors import ConfigError
    from rd2h.vllm.connector import RD2HConnector
    from rd2h.vllm.parallel import check_parallel

    for role in ("kv_consumer", "kv_producer"):
        config = _vllm_config(model, role=role, pipeline_parallel_size=2)  # the hybrid allocator on
        with pytest.raises(ConfigError, match=r"pipeline_parallel_size=2.*2 KV cache groups"):
            RD2HConnector(config, KVConnectorRole.SCHEDULER, _kv_cache_config(config, _specs()))
    parallel = _vllm_config(model, pipeline_parallel_size=2).parallel_config
    with pytest.raises(ConfigError, match="mode 'sfa'"):
        check_parallel(parallel, mode="sfa")
    with pytest.raises(ConfigError, match="speculative decoding"):
        check_parallel(parallel, speculative=True)
    check_parallel(parallel, groups=1)  # one group in dense mode is served
    check_parallel(_vllm_config(model).parallel_config, groups=2, mode="sfa", speculative=True)  # no PP: not this check


def test_a_decode_with_pipeline_parallel_names_its_stages_in_its_rendezvous(model: Path) -> None:
    """The endpoint Decode posts says how many layers each stage holds (vLLM's split), so that
    Prefill sends each layer to its stage; stage 0's ports start at the engine's base port."""
    from vllm.distributed.utils import get_pp_indices

    connector = _connector(model, "kv_consumer")
    try:
        endpoint = connector.scheduler.endpoint
        layers = sum(endpoint.stages)
        assert [(sum(endpoint.stages[:s]), sum(endpoint.stages[: s + 1])) for s in range(2)] == [
            get_pp_indices(layers, s, 2) for s in range(2)
        ]
        assert (endpoint.base_port, endpoint.tp_size) == (5600, 1)
        assert str(endpoint).endswith("/1/" + ",".join(map(str, endpoint.stages)))
    finally:
        connector.shutdown()


def test_stages_and_dp_ranks_get_ports_of_their_own(model: Path) -> None:
    """DP rank 1 of a DP 2 x PP 2 Decode: its stage 0 after DP rank 0's two stages."""
    from test_vllm_kv_groups import _vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from rd2h.vllm.connector import RD2HConnector
    from rd2h.vllm.parallel import port_rank

    config = _vllm_config(model, role="kv_consumer", hybrid=False, data_parallel_size=2, data_parallel_rank=1,
                          pipeline_parallel_size=2)  # fmt: skip
    config.parallel_config.reconfigure_for_independent_dp_rank()  # what vLLM's DP engine core does
    assert [port_rank(config.parallel_config, s) for s in range(2)] == [2, 3]
    connector = RD2HConnector(config, KVConnectorRole.SCHEDULER, None)
    try:
        assert connector.scheduler.endpoint.base_port == 5600 + 2  # kv_port + (dp * pp + stage) * tp
        assert connector.scheduler.endpoint.stage(1).base_port == 5600 + 3
    finally:
        connector.shutdown()


def test_model_layers_are_read_from_vllms_layer_names() -> None:
    from rd2h.vllm.parallel import model_layers

    assert model_layers(["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]) == [0, 1]
    assert model_layers(["model.layers.0.self_attn.attn", "lm_head.attn"]) is None  # not said: no staged Decode


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
