"""vLLM's P/D convention when Decode loads none of a held request: Decode's scheduler (inside
vLLM's own Scheduler) sends every Prefill rank a signed release over the hand-off channel (real
ZMQ on loopback), and the Prefill worker frees the blocks at once instead of at hold_timeout,
counted (``handoff_released``); a release Prefill refuses is counted on Decode."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import free_base_port
from test_vllm_handoff import ask
from test_vllm_worker import BLOCKS, dense_caches
from vllm_kit import SECRET, make_request, make_scheduler, write_model

from rd2h.vllm.config import ConnectorConfig
from rd2h.vllm.handoff import Held, HoldTable, handoff_params
from rd2h.vllm.handoff_net import HandoffListener
from rd2h.vllm.metadata import HoldSpec, StepMetadata
from rd2h.vllm.worker import RD2HWorker

EXT = "ab" * 16
HOLD = 60.0  # Prefill's hold_timeout: the release frees long before it


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("llama"))


@pytest.fixture
def prefill(monkeypatch: pytest.MonkeyPatch) -> Iterator[RD2HWorker]:
    """A Prefill worker holding request ``p-req`` (100 tokens) under EXT, as after vLLM finished it."""
    monkeypatch.setenv("RD2H_SECRET", SECRET.decode())
    config = ConnectorConfig.from_extra({"kv_port": free_base_port(2), "handoff_port": free_base_port(1),
                                         "hold_timeout": HOLD})  # fmt: skip
    worker = RD2HWorker(config, consumer=False, producer=True, rank=0, tp_size=1, dp_rank=0, block_sizes=[32])
    try:
        caches = dense_caches(True)
        worker.register(caches, {n: BLOCKS for n in caches})
        worker.bind(StepMetadata(hold=(HoldSpec(EXT, "p-req", ((0, 1, 2, 3),), 100),), idle=True))
        assert worker.transfer_results() == (set(), set(), set())  # held
        yield worker
    finally:
        worker.close()


def decode_request(req: str, port: int) -> Any:
    """A Decode request with the params Prefill's answer carried (signed, naming its listener)."""
    prompt = make_request(req, 100, {}).prompt_token_ids
    params = handoff_params(SECRET, ext_id=EXT, engine_id="p", host="127.0.0.1", port=port, tp=1, token_ids=prompt,
                            blocks=[[0, 1, 2, 3]], block_size=32, mode="dense", now=time.time(), ttl=HOLD)
    return make_request(req, 100, params)


def freed_by(prefill: RD2HWorker, timeout: float = 10.0) -> set[str]:
    """Once the listener took a release (the table's own event, well within HOLD), what the
    Prefill worker's next step frees."""
    assert prefill.handoff.table.wait(timeout), "still held: nobody released it"
    return prefill.transfer_results()[0]


def port_of(prefill: RD2HWorker) -> int:
    return int(prefill.handoff.address.rsplit(":", 1)[1])


def settled(scheduler: Any) -> dict[str, int]:
    ours = scheduler.connector.scheduler
    assert ours._asker.wait(10)  # Prefill's answer to the release
    ours._handoff_results()
    return ours.stats


def test_a_decode_whose_prefix_cache_has_the_prompt_releases_the_hold_at_once(
    model: Path, prefill: RD2HWorker
) -> None:
    scheduler, _ = make_scheduler(model, "kv_consumer")
    connector = scheduler.connector
    request = decode_request("cmpl-r1-0-abcdef12", port_of(prefill))
    # every token Decode would load is in its prefix cache: nothing to load, nothing asked
    assert connector.get_num_new_matched_tokens(request, 100) == (0, False)
    assert freed_by(prefill) == {"p-req"}  # Prefill frees the blocks now, not at hold_timeout
    stats = prefill.stats()
    assert stats is not None and stats.data["local"] == {"handoff_released": 1}
    assert prefill.handoff.table.counts["released"] == 1
    ours = settled(scheduler)
    assert (ours["handoff_released"], ours["nothing_to_pull"], ours["release_failed"], ours["handoffs"]) == (1, 1, 0, 0)
    assert connector.get_num_new_matched_tokens(request, 0) == (0, False)  # consumed: a preempted one never asks
    connector.shutdown()


def test_a_decode_that_does_not_take_the_load_releases_the_hold(model: Path, prefill: RD2HWorker) -> None:
    scheduler, _ = make_scheduler(model, "kv_consumer")
    connector = scheduler.connector
    request = decode_request("cmpl-r2-0-abcdef12", port_of(prefill))
    assert connector.get_num_new_matched_tokens(request, 0) == (100, True)
    connector.update_state_after_alloc(request, ((),), 0)  # vLLM allocated it without rd2h's tokens
    assert freed_by(prefill) == {"p-req"}
    ours = settled(scheduler)
    assert (ours["handoff_released"], ours["nothing_to_pull"], ours["release_failed"]) == (1, 0, 0)
    assert connector.request_finished(request, []) == (False, None)  # released once: nothing more
    assert prefill.handoff.table.counts == {"asked": 0, "refused": 0, "expired": 0, "released": 1}
    connector.shutdown()


def test_a_release_of_a_request_already_being_sent_is_refused_and_counted(model: Path) -> None:
    table = HoldTable()
    listener = HandoffListener(table, SECRET, "127.0.0.1", free_base_port(1))
    scheduler, _ = make_scheduler(model, "kv_consumer")
    try:
        table.hold(Held(EXT, "p-req", ((0, 1, 2, 3),), 100, time.monotonic() + HOLD))
        assert table.answer(SECRET, ask(), time.time(), 0.0)["ok"] is True  # another Decode's ask came first
        request = decode_request("cmpl-r3-0-abcdef12", int(listener.address.rsplit(":", 1)[1]))
        assert scheduler.connector.get_num_new_matched_tokens(request, 100) == (0, False)
        assert settled(scheduler)["release_failed"] == 1
        assert table.counts["refused"] == 1 and table.take_freed(0.0) == []  # its blocks stay with the send
        assert len(table.take_claimed()) == 1
    finally:
        scheduler.connector.shutdown()
        listener.close()


def test_a_request_matched_then_finding_its_prompt_cached_is_counted_once(model: Path, prefill: RD2HWorker) -> None:
    """vLLM asks a waiting request again when its allocation failed; by then its prefix cache may
    hold the prompt: released as nothing to pull, and not also counted as a load not taken."""
    scheduler, _ = make_scheduler(model, "kv_consumer")
    connector = scheduler.connector
    request = decode_request("cmpl-r4-0-abcdef12", port_of(prefill))
    assert connector.get_num_new_matched_tokens(request, 0) == (100, True)  # then no blocks: not allocated
    assert connector.get_num_new_matched_tokens(request, 100) == (0, False)  # next step: all cached
    connector.update_state_after_alloc(request, ((),), 0)  # allocated without external tokens, as it said
    assert freed_by(prefill) == {"p-req"}
    ours = settled(scheduler)
    assert (ours["handoff_released"], ours["nothing_to_pull"], ours["release_failed"]) == (1, 1, 0)
    stats = connector.get_kv_connector_stats()
    assert stats is not None and stats.data["local"] == {"nothing_to_pull": 1}  # not load_not_taken too
    connector.shutdown()
