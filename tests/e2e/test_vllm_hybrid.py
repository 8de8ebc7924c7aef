"""A model alternating sliding-window and full-attention layers on real vLLM engines with vLLM's
hybrid allocator on (issue 20, item 1): the tests' tiny Llama with 4 layers and ``layer_types``
(layers 0 and 2 slide over 64 tokens, 1 and 3 see everything), prompts up to ~490 tokens, far past
the window.

vLLM makes two KV cache groups with block ids of their own, overlaid in one allocation: a
sliding layer and a full layer view each storage slot. rd2h pulls both groups through the two
slots, the sliding group only the blocks vLLM keeps for the window. Decode's tokens through
``rd2h proxy`` equal one engine's, Decode's metrics count every prompt token but the last as
external transfer (none computed but the last: the equality could otherwise hold with nothing
moved), and the negative control shows the tokens depend on the bytes moved.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_vllm_convention import metric
from test_vllm_pd import PROMPTS, complete, last_record

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

WINDOW = 64


@pytest.fixture(scope="module")
def swa_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from vllm_cluster import tiny_model

    out = tiny_model(tmp_path_factory.mktemp("swa") / "tiny-swa", TINY_LAYERS="4")
    config = json.loads((out / "config.json").read_text())
    config.update(layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=WINDOW)
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def swa_cluster(swa_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    from vllm_cluster import Cluster

    with Cluster(swa_model, tmp_path_factory.mktemp("swa-cluster")) as cluster:
        yield cluster


def test_sliding_window_model_with_the_hybrid_allocator_equals_one_engine(swa_cluster: Any) -> None:
    swa_cluster.ensure()
    log = swa_cluster.procs["decode"].log.read_text(errors="replace")
    assert "rd2h worker rank 0/1: 2 layers" in log  # 4 attention layers in 2 storage slots
    assert max(len(p.split()) for p in PROMPTS) > WINDOW  # the window slides inside the prompt
    decode = swa_cluster.url("decode")
    baseline = complete(swa_cluster.url("prefill"), PROMPTS, timeout=600)
    external = metric(decode, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    local = metric(decode, "vllm:prompt_tokens_by_source_total", source="local_compute")
    assert complete(swa_cluster.url("proxy"), PROMPTS, timeout=300) == baseline
    record = last_record(swa_cluster)
    assert record["status"] == 200 and all(c["first_block"] == 0 for c in record["children"])
    prompt_tokens = sum(c["num_tokens"] for c in record["children"])
    moved = metric(decode, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") - external
    computed = metric(decode, "vllm:prompt_tokens_by_source_total", source="local_compute") - local
    print(f"{len(PROMPTS)} requests, {prompt_tokens} prompt tokens: {moved:g} from external_kv_transfer, "
          f"{computed:g} computed on Decode")
    # Decode loads every prompt token but the last and computes that one (the window of the
    # token it samples stays whole in vLLM's sliding-window group)
    assert moved == prompt_tokens - len(PROMPTS) and computed == len(PROMPTS)


def test_sliding_window_negative_control(swa_cluster: Any) -> None:
    """Decode overwrites the blocks it received with noise: the tokens change."""
    swa_cluster.ensure(decode={"_test_corrupt": True})
    prompts = [PROMPTS[1] + " once more"]  # not in Decode's prefix cache from the test before
    baseline = complete(swa_cluster.url("prefill"), prompts)
    assert complete(swa_cluster.url("proxy"), prompts) != baseline


def test_a_prompt_decode_loads_nothing_of_is_not_waited_for(swa_cluster: Any) -> None:
    """Decode loads all prompt tokens but the last: nothing of a one-token prompt, and nothing of a
    33-token prompt whose first block (32 tokens) it holds from the same prompt before. It says so at
    once (a signed ``nothing`` rendezvous): the proxy sends no Prefill leg and waits for nothing. A
    rendezvous timeout of 1 s, shorter than Decode's 400 tokens: before, the proxy waited for a
    rendezvous that never came and answered 502 "Decode did not post a rendezvous within 1 s"."""
    swa_cluster.ensure()
    swa_cluster.remove("proxy")
    swa_cluster._proxy("proxy", ["decode"], "--rendezvous-timeout", "1")
    try:
        decode, block = swa_cluster.url("decode"), list(range(100, 133))
        said = metric(decode, "vllm:rd2h_local_recomputes_total", reason="nothing_to_pull")
        seen = []
        for prompt in ([7], block, block):
            baseline = complete(swa_cluster.url("prefill"), [prompt], max_tokens=400, timeout=300)
            assert complete(swa_cluster.url("proxy"), [prompt], max_tokens=400, timeout=300) == baseline
            record = last_record(swa_cluster)
            seen.append((record["status"], record.get("prefill"), record["children"][0].get("nothing")))
        skipped = "skipped: Decode loads nothing"
        assert seen == [(200, skipped, "short_prompt"), (200, None, None), (200, skipped, "prefix_cached")]
        assert metric(decode, "vllm:rd2h_local_recomputes_total", reason="nothing_to_pull") - said == 2
    finally:
        swa_cluster.remove("proxy")
        swa_cluster._proxy("proxy", ["decode"])
