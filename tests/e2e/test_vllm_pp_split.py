"""Pipeline parallel on both sides, split differently (issue 20, item 3): a three-layer tiny
model, Prefill with three stages (one layer each) and Decode with two (vLLM's split: layers
0-1 on stage 0, layer 2 on stage 1), behind ``rd2h proxy``.

Decode's stage 0 pulls layer 0 from Prefill's stage 0 and layer 1 from Prefill's stage 1, and
completes a request only once both stages' finals are in; Prefill's stage 2 sends layer 2 to
Decode's stage 1 alone. Tokens through the proxy equal the Prefill engine asked directly, and
Decode's metrics show the prompts' KV came by transfer (the tokens alone could match with
nothing moved); test_vllm_pp.py has the negative control that corrupts what arrived.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_vllm_pp import PP_ARGS, assert_pulled_tokens_equal_one_engine

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def three_layers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tests' tiny Llama (its tokenizer) with three random layers instead of two."""
    from vllm_cluster import tiny_model

    out = tiny_model(tmp_path_factory.mktemp("model3") / "tiny-llama-3")
    script = (
        "import sys, torch\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "cfg = LlamaConfig.from_pretrained(sys.argv[1]); cfg.num_hidden_layers = 3\n"
        "torch.manual_seed(0); LlamaForCausalLM(cfg).save_pretrained(sys.argv[1], safe_serialization=True)\n"
    )
    subprocess.run([sys.executable, "-c", script, str(out)], check=True, capture_output=True, timeout=120)
    return out


@pytest.fixture(scope="module")
def split_cluster(three_layers: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    from vllm_cluster import Cluster

    with Cluster(three_layers, tmp_path_factory.mktemp("pp-split")) as cluster:
        yield cluster


def test_prefill_pp3_to_decode_pp2_equals_one_engine(split_cluster: Any) -> None:
    pp3 = {"_engine_args": [*PP_ARGS["_engine_args"], "--pipeline-parallel-size", "3"]}  # the last one counts
    split_cluster.ensure(prefill=pp3, decode=PP_ARGS)
    assert_pulled_tokens_equal_one_engine(split_cluster, decode_stages=2, stages="2,1")
    assert "Worker_PP2" in split_cluster.procs["prefill"].log.read_text(errors="replace")  # three stages ran
