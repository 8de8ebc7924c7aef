"""Data parallel on Decode (issue 20, item 4): one vLLM API server in front of two DP engines
(``--data-parallel-size 2``, vLLM's own front end balancing requests over them) behind
``rd2h proxy``.

vLLM runs the DP ranks of a dense model as independent engines and resets their
``data_parallel_rank`` to 0; only ``data_parallel_index`` keeps the global rank. Each rank's
connector binds its own control ports from it (``kv_port + dp_index * tp + tp_rank``) and
posts its own rendezvous naming them, so Prefill pulls into whichever rank vLLM gave the
request. Tokens through the proxy equal one engine asked directly, both ranks served pulled
requests (vLLM labels each rank's series ``engine="0"``/``"1"``), and each rank counted the
prompts' tokens as external transfer, not computed (the equality alone could hold with
nothing moved). The bytes themselves are checked by the corrupting Decode of
test_vllm_pd.py; a DP rank reads through the same path, so restarting two DP engines for it
again (minutes on 2 cores) is left out.
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

    with Cluster(model, tmp_path_factory.mktemp("dp")) as cluster:
        yield cluster


def per_rank(url: str, name: str, **labels: str) -> list[float]:
    return [metric(url, name, engine=str(rank), **labels) for rank in range(DP)]


def test_decode_dp2_pulls_into_both_ranks_and_equals_one_engine(dp_cluster: Any) -> None:
    dp_cluster.ensure(decode=DP_ARGS)
    decode = dp_cluster.url("decode")
    baseline = complete(dp_cluster.url("prefill"), MANY, timeout=600)  # the first call compiles
    pulled = per_rank(decode, "vllm:rd2h_pulled_requests_total")
    external = per_rank(decode, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    local = per_rank(decode, "vllm:prompt_tokens_by_source_total", source="local_compute")
    assert complete(dp_cluster.url("proxy"), MANY, timeout=600) == baseline
    children = last_record(dp_cluster)["children"]
    assert len(children) == len(MANY)
    prompt_tokens = sum(c["num_tokens"] for c in children)
    served = since(per_rank(decode, "vllm:rd2h_pulled_requests_total"), pulled)
    moved = since(per_rank(decode, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"), external)
    computed = since(per_rank(decode, "vllm:prompt_tokens_by_source_total", source="local_compute"), local)
    print(f"{len(MANY)} requests, {prompt_tokens} prompt tokens; per DP rank: pulled requests {served}, "
          f"prompt tokens from external_kv_transfer {moved}, computed on Decode {computed}")
    assert sum(served) == len(MANY)  # every request was pulled, once, by one rank
    assert all(n > 0 for n in served), f"a DP rank served no pulled request: {served}"
    # the negative control: the tokens could match with nothing moved (Decode computing the
    # prompts itself); vLLM counts each rank's prompt tokens by where they came from
    assert sum(moved) >= prompt_tokens - len(MANY) and sum(computed) <= len(MANY)
    assert all(m > 0 for m in moved), moved  # each rank's own pulls, not only its requests
    # each rank posted its own rendezvous, naming its own ports (kv_port + dp_index)
    endpoints = {c["endpoint"] for c in children}
    assert endpoints == {f"127.0.0.1:{dp_cluster.kv_port + rank}/1" for rank in range(DP)}, endpoints


def since(after: list[float], before: list[float]) -> list[float]:
    return [a - b for a, b in zip(after, before)]
