"""vLLM's P/D convention inside vLLM's own Scheduler (rd2h.vllm.scheduler + handoff): a Prefill
asked with ``do_remote_decode`` and no rd2h fields holds the request and answers signed
``kv_transfer_params``; a Decode given them asks the Prefill ranks (a real listener on
loopback) and, where the hand-off cannot happen, says so and counts it."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import free_base_port
from vllm_kit import SECRET, make_request, make_scheduler, runner_output, write_model

from rd2h.vllm.handoff import HoldTable, accept_handoff, handoff_params
from rd2h.vllm.handoff_net import HandoffListener
from rd2h.vllm.metadata import StepMetadata, WorkerReport
from rd2h.vllm.stats import LOCAL_REASONS

# what vLLM's example proxy (toy_proxy_server.py) sends to Prefill
TOY_PREFILL = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
               "remote_block_ids": None, "remote_host": None, "remote_port": None}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("llama"))


def meta_of(output: Any) -> StepMetadata:
    assert isinstance(output.kv_connector_metadata, StepMetadata)
    return output.kv_connector_metadata


def finish_prefill(scheduler: Any, req: str, tokens: int) -> dict[str, Any] | None:
    """Prefill computes the prompt and samples its one token; its kv_transfer_params."""
    scheduler.add_request(make_request(req, tokens, dict(TOY_PREFILL), max_tokens=1))
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {req: tokens}
    assert not (meta_of(out).send_new or meta_of(out).computed)  # nothing is sent while computing
    (output,) = scheduler.update_from_output(out, runner_output(out, sampled={req: 7}))[0].outputs
    return output.kv_transfer_params


def test_prefill_holds_the_finished_request_and_returns_signed_params_in_vllms_names(model: Path) -> None:
    port = free_base_port(1)
    scheduler, _ = make_scheduler(model, "kv_producer", extra={"handoff_port": port})
    pool = scheduler.kv_cache_manager.block_pool
    free = pool.get_num_free_blocks()
    req = "cmpl-h1-0-abcdef12"
    params = finish_prefill(scheduler, req, 100)
    assert params is not None and params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert (params["remote_host"], params["remote_port"], params["tp_size"], params["remote_num_tokens"]) == (
        "127.0.0.1", port, 1, 100)
    prompt = make_request(req, 100, {}).prompt_token_ids
    handoff = accept_handoff(SECRET, params["rd2h"], prompt, time.time(), block_size=32, mode="dense")
    assert handoff.ext_id == params["remote_request_id"] and len(handoff.ext_id) == 32  # 128 random bits
    out = scheduler.schedule()
    (hold,) = meta_of(out).hold  # the workers keep the blocks for the ask
    assert (hold.ext_id, hold.req_id, hold.num_tokens, len(hold.blocks[0])) == (handoff.ext_id, req, 100, 4)
    assert list(hold.blocks[0]) == params["remote_block_ids"][0]
    assert pool.get_num_free_blocks() < free  # held until the workers report it sent (or expired)
    scheduler.update_from_output(out, runner_output(out, finished_sending={req}))
    assert pool.get_num_free_blocks() == free
    assert scheduler.connector.scheduler.stats["held"] == 1
    scheduler.connector.shutdown()


def test_prefill_without_handoff_port_warns_and_counts_instead_of_answering_nothing(
    model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    scheduler, _ = make_scheduler(model, "kv_producer")
    free = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    with caplog.at_level(logging.WARNING, "rd2h"):
        assert finish_prefill(scheduler, "cmpl-h2-0-abcdef12", 100) is None
    assert "handoff_port" in caplog.text and "1 such requests" in caplog.text
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == free  # nothing held
    assert scheduler.connector.scheduler.stats["no_handoff"] == 1
    assert "no_handoff" in LOCAL_REASONS  # counted in vllm:rd2h_local_recomputes_total


def test_prefill_holds_nothing_for_an_aborted_request(model: Path) -> None:
    from vllm.v1.request import RequestStatus

    scheduler, _ = make_scheduler(model, "kv_producer", extra={"handoff_port": free_base_port(1)})
    req = "cmpl-h3-0-abcdef12"
    scheduler.add_request(make_request(req, 100, dict(TOY_PREFILL), max_tokens=1))
    out = scheduler.schedule()
    scheduler.finish_requests(req, RequestStatus.FINISHED_ABORTED)
    scheduler.update_from_output(out, runner_output(out))
    assert not meta_of(scheduler.schedule()).hold
    assert scheduler.connector.scheduler.stats["held"] == 0


@pytest.fixture
def prefill_rank() -> Iterator[HandoffListener]:
    listener = HandoffListener(HoldTable(), SECRET, "127.0.0.1", free_base_port(1))
    try:
        yield listener
    finally:
        listener.close()


def prefill_params(req: str, port: int, *, tokens: int = 100, ext_id: str = "ab" * 16) -> dict[str, Any]:
    prompt = make_request(req, tokens, {}).prompt_token_ids
    return handoff_params(SECRET, ext_id=ext_id, engine_id="p", host="127.0.0.1", port=port, tp=1, token_ids=prompt,
                          blocks=[[1, 2, 3, 4]], block_size=32, mode="dense", now=time.time(), ttl=60.0)


def port_of(listener: HandoffListener) -> int:
    return int(listener.address.rsplit(":", 1)[1])


def test_decode_given_prefills_params_pulls_and_asks_every_prefill_rank_once_workers_expect_it(
    model: Path, prefill_rank: HandoffListener
) -> None:
    from rd2h.vllm.handoff import Held

    scheduler, posts = make_scheduler(model, "kv_consumer")
    req = "cmpl-h4-0-abcdef12"
    prefill_rank.table.hold(Held("ab" * 16, "p-req", ((1, 2, 3, 4),), 100, time.monotonic() + 60))
    scheduler.add_request(make_request(req, 100, prefill_params(req, port_of(prefill_rank))))
    out = scheduler.schedule()
    assert out.total_num_scheduled_tokens == 0  # waiting for the KV: 100 tokens external
    (spec,) = meta_of(out).recv
    assert (spec.ext_id, spec.first_block, spec.num_tokens) == ("ab" * 16, 0, 100)
    assert not prefill_rank.table.take_claimed()  # not asked before the workers expect it
    scheduler.update_from_output(out, runner_output(out, kv_connector_worker_meta=WorkerReport({"ab" * 16: 1})))
    ours = scheduler.connector.scheduler
    assert ours._asker.wait(10)
    assert ours._asker.results() == [("ab" * 16, None)]  # the rank answered: it announces
    ((held, ask),) = prefill_rank.table.take_claimed()
    assert (held.req_id, str(ask.endpoint), ask.first_block) == ("p-req", str(ours.endpoint), 0)
    assert not posts.bodies  # no rendezvous: no rd2h proxy in this convention
    out = scheduler.schedule()
    scheduler.update_from_output(out, runner_output(out, finished_recving={req}))
    assert scheduler.schedule().num_scheduled_tokens == {req: 1}  # vLLM computes the last token only
    scheduler.connector.shutdown()


def test_decode_stops_the_pull_and_counts_it_when_prefill_is_gone(model: Path, caplog: pytest.LogCaptureFixture) -> None:
    scheduler, _ = make_scheduler(model, "kv_consumer", extra={"handoff_timeout": 0.5},
                                  load_failure_policy="recompute")
    req = "cmpl-h5-0-abcdef12"
    with socket.socket() as gone, caplog.at_level(logging.WARNING, "rd2h"):  # bound, never answering
        gone.bind(("127.0.0.1", 0))
        scheduler.add_request(make_request(req, 100, prefill_params(req, gone.getsockname()[1])))
        out = scheduler.schedule()
        scheduler.update_from_output(out, runner_output(out, kv_connector_worker_meta=WorkerReport({"ab" * 16: 1})))
        ours = scheduler.connector.scheduler
        assert ours._asker.wait(10)
        out = scheduler.schedule()
    assert meta_of(out).recv_abort == ("ab" * 16,)  # the workers stop it and report it failed
    assert "no answer from Prefill" in caplog.text and "recompute" in caplog.text
    scheduler.update_from_output(out, runner_output(out, finished_recving={req}, failed_recving={req}))
    assert scheduler.schedule().num_scheduled_tokens == {req: 100}  # recomputed here (the policy)
    assert scheduler.connector.scheduler.stats["handoff_failed"] == 1 and "handoff_failed" in LOCAL_REASONS
    scheduler.connector.shutdown()


@pytest.mark.parametrize("change, why", [
    ({"remote_port": 1}, None),  # vLLM's fields are informational: only the signed part counts
    ({"rd2h": {"port": 1}}, "signature does not match"),
    ({"rd2h": {"sig": "0" * 64}}, "signature does not match"),
    ({"rd2h": None}, "not signed"),  # another connector's params (NIXL's): refused, not pulled from
])
def test_decode_refuses_altered_or_foreign_params_and_computes_the_prompt(
    model: Path, change: dict, why: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    scheduler, _ = make_scheduler(model, "kv_consumer")
    req = "cmpl-h6-0-abcdef12"
    params = prefill_params(req, 5800)
    for key, value in change.items():
        params[key] = {**params[key], **value} if isinstance(value, dict) else value
    with caplog.at_level(logging.WARNING, "rd2h"):
        scheduler.add_request(make_request(req, 100, params))
        out = scheduler.schedule()
    if why is None:
        assert meta_of(out).recv
        scheduler.connector.shutdown()
        return
    assert out.num_scheduled_tokens == {req: 100} and not meta_of(out).recv
    assert why in caplog.text and "refused" in caplog.text
    assert scheduler.connector.scheduler.stats["refused_params"] == 1


def test_decode_refuses_params_made_for_another_prompt(model: Path) -> None:
    scheduler, _ = make_scheduler(model, "kv_consumer")
    req = "cmpl-h7-0-abcdef12"
    scheduler.add_request(make_request(req, 100, prefill_params("another", 5800), seed=3))
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {req: 100}
    assert scheduler.connector.scheduler.stats["refused_params"] == 1


def test_decode_without_a_metaserver_starts_and_computes_rd2h_proxy_requests_itself(
    model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from rd2h.vllm.params import decode_fields

    with caplog.at_level(logging.WARNING, "rd2h"):
        scheduler, _ = make_scheduler(model, "kv_consumer", extra={"metaserver": None})  # the convention only
        req = "cmpl-h8-0-abcdef12"
        fields = decode_fields(SECRET, "ab" * 16, 1, 1, time.time())
        scheduler.add_request(make_request(req, 100, {"do_remote_prefill": True, "rd2h": fields}))
        out = scheduler.schedule()
    assert out.num_scheduled_tokens == {req: 100}  # nowhere to post its rendezvous: computed here
    assert "without kv_connector_extra_config 'metaserver'" in caplog.text
    assert "no 'metaserver' is configured" in caplog.text
    assert scheduler.connector.scheduler.stats["refused_params"] == 1
