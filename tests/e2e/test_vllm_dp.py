"""Data parallel on Decode (issue 20, item 4): one vLLM API server in front of two DP engines
(``--data-parallel-size 2``, vLLM's own front end balancing requests over them) behind
``rd2h proxy``.

vLLM runs the DP ranks of a dense model as independent engines and resets their
``data_parallel_rank`` to 0; only ``data_parallel_index`` keeps the global rank. Each rank's
connector binds its own control ports from it (``kv_port + dp_index * tp + tp_rank``) and
posts its own rendezvous naming them, so Prefill pulls into whichever rank vLLM gave the
request. Tokens through the proxy equal one engine asked directly, both ranks served pulled
requests (vLLM labels each rank's series ``engine="0"``/``"1"``), the prompts' KV came from
the transfer, and a Decode that overwrites what it received answers otherwise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_vllm_convention import metric
from test_vllm_pd import PROMPTS, complete, last_record, model  # noqa: F401 - the model fixture

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

DP = 2
DP_ARGS = {"_engine_args": ["--data-parallel-size", str(DP)]}
# enough requests that vLLM's balancing gives each rank some (it picks the least loaded rank)
MANY = [f"{prompt} {i}" for i in range(4) for prompt in PROMPTS]


@pytest.fixture(scope="module")
def dp_cluster(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:  # noqa: F811
    from vllm_cluster import Cluster

    cluster = Cluster(model, tmp_path_factory.mktemp("dp"))
    try:
        yield cluster
    finally:
        cluster.close()


def per_rank(url: str, name: str, **labels: str) -> list[float]:
    return [metric(url, name, engine=str(rank), **labels) for rank in range(DP)]


def test_decode_dp2_pulls_into_both_ranks_and_equals_one_engine(dp_cluster: Any) -> None:
    dp_cluster.ensure(decode=DP_ARGS)
    decode = dp_cluster.url("decode")
    baseline = complete(dp_cluster.url("prefill"), MANY, timeout=600)  # the first call compiles
    pulled = per_rank(decode, "vllm:rd2h_pulled_requests_total")
    external = metric(decode, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    assert complete(dp_cluster.url("proxy"), MANY, timeout=600) == baseline
    children = last_record(dp_cluster)["children"]
    assert len(children) == len(MANY)
    prompt_tokens = sum(c["num_tokens"] for c in children)
    moved = metric(decode, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") - external
    served = [after - before for after, before in zip(per_rank(decode, "vllm:rd2h_pulled_requests_total"), pulled)]
    print(f"{len(MANY)} requests, {prompt_tokens} prompt tokens, {moved:g} from external_kv_transfer; "
          f"pulled per DP rank: {served}")
    assert sum(served) == len(MANY)  # every request was pulled, once, by one rank
    assert all(n > 0 for n in served), f"a DP rank served no pulled request: {served}"
    assert moved >= prompt_tokens - len(MANY)  # all but each prompt's last token came by transfer
    # each rank posted its own rendezvous, naming its own ports (kv_port + dp_index)
    endpoints = {c["endpoint"] for c in children}
    assert endpoints == {f"127.0.0.1:{dp_cluster.kv_port + rank}/1" for rank in range(DP)}, endpoints


def test_decode_dp2_negative_control(dp_cluster: Any) -> None:
    """Both Decode ranks overwrite every block they received with noise: the tokens change."""
    dp_cluster.ensure(decode={**DP_ARGS, "_test_corrupt": True})
    prompts = [f"{PROMPTS[1]} once more {i}" for i in range(4)]  # not in Decode's prefix cache
    baseline = complete(dp_cluster.url("prefill"), prompts)
    pulled = per_rank(dp_cluster.url("decode"), "vllm:rd2h_pulled_requests_total")
    answer = complete(dp_cluster.url("proxy"), prompts, timeout=300)
    served = [a - b for a, b in zip(per_rank(dp_cluster.url("decode"), "vllm:rd2h_pulled_requests_total"), pulled)]
    assert sum(served) == len(prompts)
    assert all(got != want for got, want in zip(answer, baseline)), served
