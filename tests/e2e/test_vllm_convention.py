"""vLLM's own P/D convention in front of RD2HConnector engines (no rd2h proxy in the path).

A router of the tests' own (``convention_router.py``) follows vLLM's example proxy step by
step: Prefill with ``do_remote_decode`` and ``max_tokens=1``, then Decode with the
``kv_transfer_params`` Prefill returned. Decode must pull the prompt's KV (its own metrics
say the prompt tokens came from an external transfer and rd2h pulled the request) and answer
the single engine's tokens, token for token; params a router altered are refused, warned
about and counted, and the prompt is computed on Decode.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_vllm_pd import LONG, model  # noqa: F401 - the tiny model fixture

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

PROMPTS = [LONG, "a tiny model learns to decode " * 7]  # ~490 tokens (chunked on Prefill) and a short one


@pytest.fixture(scope="module")
def cluster(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:  # noqa: F811
    from vllm_cluster import Cluster, free_base_port

    with Cluster(model, tmp_path_factory.mktemp("convention")) as cluster:
        cluster.ensure(prefill={"handoff_port": free_base_port(1)})
        yield cluster


@pytest.fixture(scope="module")
def router(cluster: Any) -> Any:
    from convention_router import ConventionRouter

    router = ConventionRouter(cluster.url("prefill"), cluster.url("decode"))
    yield router
    router.close()


def body(prompt: str) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0, "return_token_ids": True,
            "ignore_eos": True}


def tokens(response: httpx.Response) -> list[int]:
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    return choice["token_ids"]


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of a series on an engine's /metrics over the samples with these labels."""
    text = httpx.get(url + "/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        match = re.match(rf"{re.escape(name)}(?:\{{(.*)\}})? (\S+)$", line)
        if match and all(f'{k}="{v}"' in (match.group(1) or "") for k, v in labels.items()):
            total += float(match.group(2))
    return total


def test_decode_pulls_prefills_kv_and_answers_the_single_engines_tokens(cluster: Any, router: Any) -> None:
    decode = cluster.url("decode")
    for prompt in PROMPTS:
        baseline = tokens(httpx.post(cluster.url("prefill") + "/v1/completions", json=body(prompt), timeout=240))
        external = metric(decode, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
        local = metric(decode, "vllm:prompt_tokens_by_source_total", source="local_compute")
        pulled = metric(decode, "vllm:rd2h_pulled_requests_total")
        assert tokens(router.completions(body(prompt))) == baseline
        params = router.last_params
        assert params is not None and params["do_remote_prefill"] is True and params["remote_num_tokens"] > 100
        assert {"remote_engine_id", "remote_request_id", "remote_host", "remote_port", "remote_block_ids"} <= set(params)
        # the KV moved: all but the last prompt token came from the transfer, and rd2h pulled it
        moved = metric(decode, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") - external
        print(f"prompt of {params['remote_num_tokens']} tokens: {moved:g} from external_kv_transfer, "
              f"{metric(decode, 'vllm:prompt_tokens_by_source_total', source='local_compute') - local:g} local")
        assert moved >= params["remote_num_tokens"] - 1
        assert metric(decode, "vllm:prompt_tokens_by_source_total", source="local_compute") - local <= 1
        assert metric(decode, "vllm:rd2h_pulled_requests_total") - pulled == 1
    assert metric(cluster.url("prefill"), "vllm:rd2h_sent_requests_total") >= len(PROMPTS)


def _moved_port(params: dict[str, Any]) -> dict[str, Any]:
    return {**params, "rd2h": {**params["rd2h"], "port": params["rd2h"]["port"] + 1}}


def _without_rd2h(params: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in params.items() if k != "rd2h"}  # e.g. NIXL-style params only


@pytest.mark.parametrize("tamper", [_moved_port, _without_rd2h], ids=["altered", "unsigned"])
def test_params_a_router_altered_are_refused_counted_and_the_prompt_computed_on_decode(
    cluster: Any, router: Any, tamper: Any
) -> None:
    decode = cluster.url("decode")
    prompt = f"{tamper.__name__} " + "quick brown foxes decode " * 20  # not in Decode's prefix cache
    baseline = tokens(httpx.post(cluster.url("prefill") + "/v1/completions", json=body(prompt), timeout=240))
    refused = metric(decode, "vllm:rd2h_local_recomputes_total", reason="refused_params")
    external = metric(decode, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    assert tokens(router.completions(body(prompt), tamper=tamper)) == baseline
    assert metric(decode, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == external
    assert metric(decode, "vllm:rd2h_local_recomputes_total", reason="refused_params") - refused == 1
    assert "kv_transfer_params refused" in cluster.procs["decode"].log.read_text(errors="replace")
