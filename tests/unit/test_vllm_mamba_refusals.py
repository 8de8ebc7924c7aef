"""What a Mamba engine refuses, over vLLM's own objects (the tiny model of test_vllm_mamba):
params a client wrote never cut a prompt, a request that cannot be cut consistently is left
whole, a refusal is said and counted once (``vllm:rd2h_local_recomputes{reason="state_uncut"}``),
and layouts rd2h does not move a state in are refused at startup with the reason."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from test_vllm_mamba_state import config_for, kv_config, mamba_spec, state_scheduler
from test_vllm_scheduler import decode_params, hexid, prefill_params
from vllm_kit import SECRET, make_request, write_model

from rd2h.errors import ConfigError
from rd2h.vllm.params import later_fields
from rd2h.vllm.state_groups import PromptTruncation, check_state_engine, check_state_pages
from rd2h.vllm.stats import SchedulerTally

SETTINGS = {"pp": 1, "tp": 1, "peer_tp": None, "handoff": False, "speculative": False}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("mamba"))


def _stats(connector: Any) -> dict[str, int]:
    connector._local = SchedulerTally()  # vLLM's scheduler takes the stats each step: the counts since startup
    stats = connector.get_kv_connector_stats()
    return {} if stats is None else stats.data["local"]


# -- 1: only params the proxy signed cut a prompt ---------------------------------------------


@pytest.mark.parametrize("bogus", [
    {"do_remote_decode": True, "rd2h": "not signed"},
    {"do_remote_decode": True, "rd2h": {"leg": "prefill", "id": "ab" * 8, "targets": {}, "sig": "00"}},
    {"do_remote_decode": True, "rd2h": None},
])  # fmt: skip
def test_params_a_client_wrote_leave_the_request_whole(model: Path, bogus: dict, caplog: Any) -> None:
    scheduler = state_scheduler(model, "kv_producer")
    request = make_request("cmpl-b-0-abcdef12", 50, bogus, max_tokens=20)
    scheduler.add_request(request)  # vLLM calls on_new_request
    assert request.num_prompt_tokens == 50 == len(request.prompt_token_ids) == request.num_tokens
    assert request.max_tokens == 20
    out = scheduler.schedule()  # the scheduler refuses them, once, with its own reason; nothing is sent
    assert out.num_scheduled_tokens["cmpl-b-0-abcdef12"] == 50 and not out.kv_connector_metadata.send_new
    connector = scheduler.connector
    assert connector.scheduler.stats["refused_params"] == 1 and _stats(connector) == {"refused_params": 1}
    assert "not computed short of its last token" not in caplog.text
    connector.shutdown()


def test_params_signed_by_the_proxy_cut_the_prompt(model: Path) -> None:
    scheduler = state_scheduler(model, "kv_producer")
    signed = make_request("cmpl-s-0-abcdef12", 50, prefill_params("s", "10.0.0.2:5600/1"), max_tokens=20)
    later = make_request("cmpl-l-0-abcdef12", 50, {"do_remote_decode": True, "rd2h": later_fields(
        SECRET, hexid("l"), 1, "http://proxy/v1/rd2h/targets", 5.0, time.time())}, max_tokens=20)
    for request in (signed, later):  # targets named, or targets to come (Prefill at once)
        scheduler.add_request(request)
        assert request.num_prompt_tokens == 49 == len(request.prompt_token_ids) and request.max_tokens == 1
    scheduler.connector.shutdown()


def test_params_signed_for_another_leg_leave_the_request_whole(model: Path) -> None:
    scheduler = state_scheduler(model, "kv_producer")
    request = make_request("cmpl-d-0-abcdef12", 50, {**decode_params("d"), "do_remote_decode": True}, max_tokens=20)
    scheduler.add_request(request)
    assert request.num_prompt_tokens == 50 and request.max_tokens == 20
    scheduler.connector.shutdown()


# -- 2: a request is cut whole or not at all ----------------------------------------------------


def _request(prompt: int = 10) -> Any:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request("r1", list(range(prompt)), SamplingParams(max_tokens=20), None)


@pytest.mark.parametrize("spoil", ["no _all_token_ids", "count disagrees", "lists disagree", "one list"])
def test_a_request_whose_token_lists_disagree_is_left_untouched(spoil: str, caplog: Any) -> None:
    request = _request()
    if spoil == "no _all_token_ids":  # a vLLM whose Request keeps the tokens elsewhere
        del request._all_token_ids
    elif spoil == "count disagrees":
        request.num_prompt_tokens = 9
    elif spoil == "lists disagree":
        request._all_token_ids.append(99)
    else:  # one list seen twice: cutting both would drop two tokens
        request._all_token_ids = request.prompt_token_ids
    before = (list(request.prompt_token_ids), list(getattr(request, "_all_token_ids", [])), request.num_prompt_tokens)
    cut = PromptTruncation()
    assert not cut.truncate(request) and "r1" not in cut and cut.refused == 1
    after = (list(request.prompt_token_ids), list(getattr(request, "_all_token_ids", [])), request.num_prompt_tokens)
    assert after == before and request.max_tokens == 20
    assert "rd2h cannot cut consistently" in caplog.text and "computed here and not sent" in caplog.text


def test_a_request_that_can_be_cut_is_cut_in_every_list() -> None:
    request, cut = _request(), PromptTruncation()
    assert cut.truncate(request) and "r1" in cut
    assert request.prompt_token_ids == list(range(9)) == request._all_token_ids and request.num_prompt_tokens == 9
    assert request.num_tokens == 9 and request.max_tokens == 1 and not cut.truncate(request)


# -- 3: a one-token prompt, said and counted once ------------------------------------------------


def test_a_signed_one_token_prompt_is_refused_once_and_exported(model: Path, caplog: Any) -> None:
    """Prefill at once sends any prompt to Prefill: one of one token cannot be cut; its
    refusal is logged once and counted once (not again as refused params at allocation)."""
    scheduler = state_scheduler(model, "kv_producer")
    req = "cmpl-o-0-abcdef12"
    scheduler.add_request(make_request(req, 1, prefill_params("o", "10.0.0.2:5600/1"), max_tokens=1))
    out = scheduler.schedule()
    assert out.num_scheduled_tokens[req] == 1 and not out.kv_connector_metadata.send_new
    connector = scheduler.connector
    assert connector.scheduler.stats["refused_params"] == 0 and connector._truncation.refused == 1
    assert _stats(connector) == {"state_uncut": 1}
    assert caplog.text.count(f"request {req}:") == 1
    connector.shutdown()


def test_state_uncut_is_a_reason_of_the_local_recomputes_series() -> None:
    from rd2h.vllm.stats import _BY_LABEL, LOCAL_REASONS

    assert "state_uncut" in LOCAL_REASONS
    assert "state_uncut" in next(doc for key, _, _, doc in _BY_LABEL if key == "local")


# -- 4, 5: layouts refused at startup ------------------------------------------------------------


def _specs(names: list[str]) -> dict[str, Any]:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    attention = FullAttentionSpec(block_size=64, num_kv_heads=2, head_size=32, dtype=torch.float32)
    return {n: mamba_spec() if n.endswith("mixer") else attention for n in names}


TWO_BY_TWO = ["model.layers.0.mixer", "model.layers.1.mixer", "model.layers.2.self_attn.attn",
              "model.layers.3.self_attn.attn"]  # fmt: skip


def _kv(directory: Path, layout: str, names: list[str]) -> Any:
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs

    config = config_for(directory)
    config.cache_config.kv_cache_layout = layout
    return get_kv_cache_configs(config, [_specs(names)], [4 << 20])[0]


def test_a_block_outermost_layout_with_state_pages_apart_is_refused_naming_it(model: Path) -> None:
    """BLHNC with two layers per group: a block holds both layers' pages (block_stride twice
    the page); registering a slot's pages block_stride apart would move the other layer's
    page with each block and run past the allocation."""
    kv = _kv(model, "BLHNC", TWO_BY_TWO)
    (tensor,) = [t for t in kv.kv_cache_tensors if "model.layers.0.mixer" in t.layers]
    assert tensor.block_stride == 2 * kv.kv_cache_groups[0].kv_cache_spec.page_size_bytes
    with pytest.raises(ConfigError, match=r"KV cache layout BLHNC: its blocks are 65536 bytes apart for Mamba "
                                          r"state pages of 32768 bytes.*LBHNC"):  # fmt: skip
        check_state_engine(kv, **SETTINGS, layout="BLHNC")
    assert check_state_engine(_kv(model, "LBHNC", TWO_BY_TWO), **SETTINGS, layout="LBHNC")
    # one layer per group: a block-outermost block is one page, dense: served
    assert check_state_engine(_kv(model, "BLHNC", TWO_BY_TWO[1:3]), **SETTINGS, layout="BLHNC")


def test_replayssm_is_refused_at_startup_naming_it(model: Path) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from rd2h.vllm.connector import RD2HConnector

    kv = kv_config(config_for(model))
    with pytest.raises(ConfigError, match=r"Mamba state group with cache_config.use_replayssm"):
        check_state_engine(kv, **SETTINGS, replay=True)
    config = config_for(model, "kv_producer")
    config.cache_config.use_replayssm = True
    with pytest.raises(ConfigError, match=r"cache_config.use_replayssm \(ReplaySSM"):
        RD2HConnector(config, KVConnectorRole.SCHEDULER, kv_config(config))


def test_registered_state_caches_must_step_one_padded_page(model: Path) -> None:
    """The worker's check over the caches vLLM allocated: a Mamba layer's view must step its
    group's padded page from block to block (page_view takes the step as the page)."""
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    kv = _kv(model, "BLHNC", TWO_BY_TWO)
    caches = allocate_kv_cache(kv, torch.device("cpu"), KVCacheLayout.BLHNC)
    with pytest.raises(ConfigError, match=r"Mamba layer model.layers.0.mixer is registered with blocks 65536 bytes "
                                          r"apart for pages of 32768 bytes: KV cache layout BLHNC"):  # fmt: skip
        check_state_pages(kv, caches, "BLHNC")
    kv = _kv(model, "LBHNC", TWO_BY_TWO)
    check_state_pages(kv, allocate_kv_cache(kv, torch.device("cpu"), KVCacheLayout.LBHNC), "LBHNC")
