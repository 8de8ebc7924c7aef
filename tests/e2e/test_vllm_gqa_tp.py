"""Unequal TP with a GQA model on real vLLM engines (the tiny Llama: 4 query heads, 2 KV
heads). vLLM's CPU cache ``[blocks, kv_heads, block_size, 2 * head_size]`` holds each rank's own
KV heads, so a Decode rank assembles every block from the head ranges of the Prefill ranks that
hold its heads: Prefill TP 2 -> Decode TP 1 (two contributors, one head each, into the two
halves of each block) and Prefill TP 1 -> Decode TP 2 (one contributor, each Decode rank its
half of each block). Tokens through ``rd2h proxy`` equal one engine asked directly, and Decode's
metrics show that the prompt came from the transfer, not from computing it (the equality could
otherwise hold with nothing moved)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_vllm_convention import metric
from test_vllm_pd import PROMPTS, complete, last_record, model  # noqa: F401 - the model fixture

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def gqa_cluster(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:  # noqa: F811
    from vllm_cluster import Cluster

    with Cluster(model, tmp_path_factory.mktemp("gqa-tp"), tp={"prefill": 2, "decode": 1}) as cluster:
        yield cluster


def assert_pulled_tokens_equal_one_engine(cluster: Any) -> None:
    """Every prompt through the proxy against the Prefill engine asked directly, and the
    prompts' KV counted by Decode as external transfer (all but the last token of each)."""
    decode = cluster.url("decode")
    baseline = complete(cluster.url("prefill"), PROMPTS, timeout=600)  # the first call compiles
    external = metric(decode, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    local = metric(decode, "vllm:prompt_tokens_by_source_total", source="local_compute")
    pulled = metric(decode, "vllm:rd2h_pulled_requests_total")
    assert complete(cluster.url("proxy"), PROMPTS, timeout=300) == baseline
    children = last_record(cluster)["children"]
    prompt_tokens = sum(c["num_tokens"] for c in children)
    moved = metric(decode, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") - external
    computed = metric(decode, "vllm:prompt_tokens_by_source_total", source="local_compute") - local
    print(f"{len(children)} requests, {prompt_tokens} prompt tokens: {moved:g} from external_kv_transfer, "
          f"{computed:g} computed on Decode")
    assert moved >= prompt_tokens - len(PROMPTS) and computed <= len(PROMPTS)
    # every Decode rank pulls its heads of every request (vLLM sums its workers' counts)
    assert metric(decode, "vllm:rd2h_pulled_requests_total") - pulled == len(PROMPTS) * cluster.tp["decode"]


def test_gqa_prefill_tp2_to_decode_tp1(gqa_cluster: Any) -> None:
    """Two contributors per Decode rank: KV head 0 from Prefill rank 0, head 1 from rank 1."""
    gqa_cluster.ensure(tp={"prefill": 2, "decode": 1})
    assert_pulled_tokens_equal_one_engine(gqa_cluster)


def test_gqa_prefill_tp1_to_decode_tp2(gqa_cluster: Any) -> None:
    """One contributor serving two Decode ranks: each reads its own KV head of every block."""
    gqa_cluster.ensure(tp={"prefill": 1, "decode": 2})
    assert_pulled_tokens_equal_one_engine(gqa_cluster)
