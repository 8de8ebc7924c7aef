"""A bug in rd2h's half of a vLLM hook is caught so that the engine goes on, and never silent:
logged with its traceback and counted (``hook_errors`` by hook, ``vllm:rd2h_hook_errors_total``;
a request then served locally also under ``local``'s ``scheduler_error``), inside vLLM's own
Scheduler."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from vllm_kit import make_request, make_scheduler, write_model

from rd2h.vllm.metadata import StepMetadata
from rd2h.vllm.stats import LOCAL_REASONS, RD2HStats


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("llama"))


def bug(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError("an rd2h bug")


def test_a_matching_error_serves_the_request_locally_and_is_counted(
    model: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    scheduler, _ = make_scheduler(model, "kv_consumer")
    connector = scheduler.connector
    monkeypatch.setattr(connector.scheduler, "get_num_new_matched_tokens", bug)
    with caplog.at_level(logging.ERROR, "rd2h"):
        scheduler.add_request(make_request("cmpl-e1-0-abcdef12", 100, {"do_remote_prefill": True}))
        out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"cmpl-e1-0-abcdef12": 100}  # computed here, not waiting for KV
    assert "get_num_new_matched_tokens raised" in caplog.text and "an rd2h bug" in caplog.text
    stats = connector.get_kv_connector_stats()
    assert stats is not None
    assert stats.data["hook_errors"] == {"get_num_new_matched_tokens": 1}
    assert stats.data["local"] == {"scheduler_error": 1} and "scheduler_error" in LOCAL_REASONS
    assert connector.get_kv_connector_stats() is None  # counted once: the next interval has nothing
    connector.shutdown()


def test_an_error_after_allocation_is_counted_and_the_request_runs(
    model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    scheduler, _ = make_scheduler(model, "kv_consumer")
    connector = scheduler.connector
    monkeypatch.setattr(connector.scheduler, "update_state_after_alloc", bug)
    scheduler.add_request(make_request("cmpl-e2-0-abcdef12", 64, {}))
    assert scheduler.schedule().num_scheduled_tokens == {"cmpl-e2-0-abcdef12": 64}
    stats = connector.get_kv_connector_stats()
    assert stats is not None and stats.data["hook_errors"] == {"update_state_after_alloc": 1}
    assert stats.data["local"] == {}  # not a recompute: the request was local anyway
    connector.shutdown()


def test_an_error_cutting_a_prompt_is_counted(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rd2h.vllm.state_groups import PromptTruncation

    scheduler, _ = make_scheduler(model, "kv_producer")
    connector = scheduler.connector
    monkeypatch.setattr(connector, "_truncation", PromptTruncation())  # as a Mamba model's Prefill has
    monkeypatch.setattr(connector, "_signed_prefill", bug)
    connector.on_new_request(make_request("cmpl-e3-0-abcdef12", 64, {}))
    stats = connector.get_kv_connector_stats()
    assert stats is not None and stats.data["hook_errors"] == {"on_new_request": 1}
    connector.shutdown()


def test_an_error_binding_a_steps_metadata_is_counted_by_the_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    from rd2h.vllm.config import ConnectorConfig
    from rd2h.vllm.connector import RD2HConnector
    from rd2h.vllm.worker import RD2HWorker

    worker = RD2HWorker(ConnectorConfig.from_extra({}), consumer=False, producer=True, rank=0, tp_size=1,
                        dp_rank=0, block_sizes=[32])  # fmt: skip
    connector = RD2HConnector.__new__(RD2HConnector)  # the worker role without vLLM's parallel state
    connector._worker, connector._scheduler = worker, None
    monkeypatch.setattr(worker, "bind", bug)
    connector.bind_connector_metadata(StepMetadata())
    stats = connector.get_kv_connector_stats()
    assert stats is not None and stats.data["hook_errors"] == {"bind_connector_metadata": 1}
    assert RD2HStats(data=stats.data).reduce()["Hook errors"] == 1
    worker.close()
