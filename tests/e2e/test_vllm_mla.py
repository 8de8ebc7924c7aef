"""Dense mode with an MLA model on real vLLM engines: each layer's cache is one latent
tensor (``[blocks, block_size, 576]``; vLLM on CPU forces 16-token blocks for MLA and turns
chunked prefill and prefix caching off). Prefill TP 1 -> Decode TP 1, then Prefill TP 2 ->
Decode TP 1 (the two Prefill ranks split the replicated latent's blocks; only Prefill restarts),
and the negative control on the latter."""

from __future__ import annotations

from typing import Any

import pytest
from test_vllm_pd import PROMPTS, last_record

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def mla_cluster(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from vllm_cluster import Cluster, tiny_model

    out = tiny_model(tmp_path_factory.mktemp("mla") / "tiny-mla", TINY_ARCH="mla")
    with Cluster(out, tmp_path_factory.mktemp("mla-cluster")) as cluster:
        cluster.ensure()
        yield cluster


def top_logprobs(url: str, prompt: str) -> list[dict[str, float]]:
    import httpx

    body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0, "logprobs": 2, "ignore_eos": True}
    response = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["logprobs"]["top_logprobs"]


def assert_matches_up_to_float_ties(cluster: Any) -> None:
    """Every prompt through the proxy against the Prefill engine asked directly."""
    for prompt in PROMPTS:
        baseline = top_logprobs(cluster.url("prefill"), prompt)
        pulled = top_logprobs(cluster.url("proxy"), prompt)
        assert last_record(cluster)["children"][0]["first_block"] == 0
        for step, (ours, theirs) in enumerate(zip(pulled, baseline)):
            best = max(theirs, key=theirs.get)
            if max(ours, key=ours.get) != best:  # parted: only at a tie, and nothing after is compared
                second = sorted(theirs.values())[-2]
                assert theirs[best] - second < 1e-2, (prompt[:20], step, ours, theirs)
                break
            assert abs(ours[best] - theirs[best]) < 1e-2, (prompt[:20], step, ours, theirs)


def test_mla_decode_matches_a_single_engine_up_to_float_ties(mla_cluster: Any) -> None:
    """MLA is not asserted token for token: Decode computes the last prompt token through
    vLLM's MLA path for a token with cached context, the single engine through its full
    prefill, and the two differ in float rounding (here up to ~2e-3 in a log-probability).
    So: every step's log-probabilities match within 1e-2 (a wrong or missing block moves
    them by whole units: see the negative control), and the greedy tokens may part only
    where the single engine's top two were within 1e-2 of each other (a tie)."""
    mla_cluster.ensure(tp={"prefill": 1, "decode": 1})
    assert_matches_up_to_float_ties(mla_cluster)


def test_mla_prefill_tp2_to_decode_tp1(mla_cluster: Any) -> None:
    """Prefill TP 2 -> Decode TP 1: each Prefill rank announces its share of the blocks, the
    one Decode rank reads both. The same bound as at TP 1 -> 1 (the single engine is now the
    TP 2 Prefill engine, which also reduces in another order than Decode's one rank)."""
    mla_cluster.ensure(tp={"prefill": 2, "decode": 1})
    assert_matches_up_to_float_ties(mla_cluster)


def test_mla_negative_control(mla_cluster: Any) -> None:
    """Decode overwrites the blocks it received with noise: the first step moves. Run on
    Prefill TP 2 -> Decode TP 1 (where the previous test left the cluster: one restart)."""
    mla_cluster.ensure(decode={"_test_corrupt": True}, tp={"prefill": 2, "decode": 1})
    baseline = top_logprobs(mla_cluster.url("prefill"), PROMPTS[1])
    pulled = top_logprobs(mla_cluster.url("proxy"), PROMPTS[1])
    best = max(baseline[0], key=baseline[0].get)
    assert abs(pulled[0].get(best, -100.0) - baseline[0][best]) > 1e-2 or max(pulled[0], key=pulled[0].get) != best
