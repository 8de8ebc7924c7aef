"""Prefill TP 2 -> Decode TP 2 on real vLLM engines: two workers on each side, each Decode
rank pulling its own heads, whole blocks (unequal TP with this GQA model, head ranges of
blocks: test_vllm_gqa_tp.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_vllm_pd import PROMPTS, complete, last_record, model  # noqa: F401 - the model fixture

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def cluster_tp2(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:  # noqa: F811
    from vllm_cluster import Cluster

    # two engines of two workers on a 2-core machine: no core pinning
    with Cluster(model, tmp_path_factory.mktemp("tp2"), tp=2, env={"VLLM_CPU_OMP_THREADS_BIND": "nobind"}) as cluster:
        cluster.ensure()
        yield cluster


def test_tp2_decode_tokens_equal_a_single_engine(cluster_tp2: Any) -> None:
    baseline = complete(cluster_tp2.url("prefill"), PROMPTS, timeout=600)  # the first call compiles
    assert complete(cluster_tp2.url("proxy"), PROMPTS, timeout=300) == baseline
    record = last_record(cluster_tp2)
    assert record["status"] == 200 and {c["endpoint"].rsplit("/", 1)[1] for c in record["children"]} == {"2"}
