"""A model alternating sliding-window and full-attention layers on real vLLM engines (issue 20,
item 1): the tests' tiny Llama with ``layer_types`` (layer 0 slides over 64 tokens, layer 1
sees everything), prompts up to ~490 tokens, far past the window.

With vLLM's hybrid allocator (on by default: the connector declares ``SupportsHMA`` and the CPU
platform supports it) the two kinds get two KV cache groups with their own block ids, which
rd2h does not pull yet: both engines refuse to start and say why. Under
``--disable-hybrid-kv-cache-manager`` vLLM keeps every layer's KV as full attention (the
sliding layer still computes over its window) in one group: all of it is pulled, and Decode's
tokens equal one engine's; the negative control shows they depend on the transfer.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_vllm_pd import HERE, PROMPTS, complete, last_record

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

WINDOW = 64
NO_HMA = {"_engine_args": ["--disable-hybrid-kv-cache-manager"]}


@pytest.fixture(scope="module")
def swa_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("swa") / "tiny-swa"
    subprocess.run([sys.executable, str(HERE / "make_tiny_model.py"), str(out)], check=True, capture_output=True,
                   timeout=120, cwd=out.parent)
    config = json.loads((out / "config.json").read_text())
    config.update(layer_types=["sliding_attention", "full_attention"], sliding_window=WINDOW)
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def swa_cluster(swa_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    from vllm_cluster import Cluster

    cluster = Cluster(swa_model, tmp_path_factory.mktemp("swa-cluster"))
    try:
        yield cluster
    finally:
        cluster.close()


def test_hybrid_allocator_groups_are_refused_at_startup(swa_cluster: Any) -> None:
    """Both engines stop at startup (in the connector's constructor) and their logs say why."""
    with pytest.raises(RuntimeError, match="exited with"):
        swa_cluster.ensure()
    for role in ("prefill", "decode"):
        proc = swa_cluster.procs[role]
        assert proc.proc.wait(timeout=240) != 0  # the Decode engine, started beside Prefill, stops too
        text = proc.log.read_text(errors="replace")
        assert "rd2h cannot transfer this model's KV cache" in text, proc.tail()
        assert f"group 0 (sliding window ({WINDOW} tokens), 1 layers: model.layers.0.self_attn.attn)" in text
        assert "--disable-hybrid-kv-cache-manager" in text


def test_sliding_window_model_without_the_hybrid_allocator_equals_one_engine(swa_cluster: Any) -> None:
    swa_cluster.ensure(prefill=NO_HMA, decode=NO_HMA)
    assert max(len(p.split()) for p in PROMPTS) > WINDOW  # the window slides inside the prompt
    baseline = complete(swa_cluster.url("prefill"), PROMPTS, timeout=600)
    assert complete(swa_cluster.url("proxy"), PROMPTS, timeout=300) == baseline
    record = last_record(swa_cluster)
    assert record["status"] == 200 and all(c["first_block"] == 0 for c in record["children"])


def test_sliding_window_negative_control(swa_cluster: Any) -> None:
    """Decode overwrites every block it received with noise: the tokens change."""
    swa_cluster.ensure(prefill=NO_HMA, decode={**NO_HMA, "_test_corrupt": True})
    prompts = [PROMPTS[1] + " once more"]  # not in Decode's prefix cache from the test before
    baseline = complete(swa_cluster.url("prefill"), prompts)
    assert complete(swa_cluster.url("proxy"), prompts) != baseline
