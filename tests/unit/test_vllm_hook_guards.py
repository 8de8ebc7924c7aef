"""The scheduler hooks a bug used to raise out of, inside vLLM's own Scheduler: counted in
``hook_errors`` by hook, logged, and answered safely (rd2h.vllm.finished): blocks a transfer may
still read stay held until the workers say it ended, no block is held forever, and a request
vLLM waits for KV for never waits forever."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from test_vllm_handoff_release import decode_request, freed_by, port_of, prefill  # noqa: F401 - prefill: a fixture
from test_vllm_hook_errors import bug
from test_vllm_late_targets import later, prefill_whole_prompt
from test_vllm_scheduler import decode_params, ext, meta_of, prefill_params
from vllm_kit import BLOCK, make_request, make_scheduler, runner_output, write_model

from rd2h.vllm.metadata import StepMetadata, WorkerReport
from rd2h.vllm.worker import RD2HWorker


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("llama"))


def hook_errors(connector: Any, caplog: pytest.LogCaptureFixture) -> list[str]:
    """The hooks that raised, from the log (vLLM takes the counters after each step's output)."""
    logged = [r.getMessage() for r in caplog.records if r.name == "rd2h.vllm" and r.levelno >= logging.ERROR]
    assert connector._hook_errors == len(logged)  # each counted
    return [message.split(": ")[2].split(" raised")[0] for message in logged]


def worker_connector(connector_cls: type) -> Any:
    """A Decode worker's connector (rd2h's real worker role) without vLLM's parallel state."""
    from rd2h.vllm.config import ConnectorConfig
    from rd2h.vllm.worker import RD2HWorker

    worker = RD2HWorker(ConnectorConfig.from_extra({}), consumer=True, producer=False, rank=0, tp_size=1,
                        dp_rank=0, block_sizes=[BLOCK])  # fmt: skip
    connector = connector_cls.__new__(connector_cls)
    connector._worker, connector._scheduler = worker, None
    return connector


def engine(model: Path, role: str, **kwargs: Any) -> tuple[Any, Any, Callable[[], bool]]:
    """vLLM's scheduler with rd2h, what it posted, and whether every block it had free is free again."""
    scheduler, posts = make_scheduler(model, role, **kwargs)
    pool = scheduler.kv_cache_manager.block_pool
    free = pool.get_num_free_blocks()
    return scheduler, posts, lambda: pool.get_num_free_blocks() == free


def test_prefill_finish_error_holds_blocks_a_send_reads_until_the_workers_end_it(
    model: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    scheduler, _, all_free = engine(model, "kv_producer")
    connector = scheduler.connector
    req = "cmpl-g1-0-abcdef12"
    scheduler.add_request(make_request(req, 64, prefill_params("g1"), max_tokens=1))
    out = scheduler.schedule()
    assert meta_of(out).send_new  # its blocks went to the workers: a Decode may read them
    monkeypatch.setattr(connector.scheduler, "request_finished", bug)
    scheduler.update_from_output(out, runner_output(out, sampled={req: 7}))  # finished: no raise into vLLM
    assert hook_errors(connector, caplog) == ["request_finished"]
    assert not all_free()  # held: the send may still read them
    out = scheduler.schedule()
    (finish,) = meta_of(out).send_finish  # ... until the workers stop it and report it
    assert (finish.ext_id, finish.req_id, finish.aborted) == (ext("g1"), req, True)
    scheduler.update_from_output(out, runner_output(out, finished_sending={req}))
    assert all_free()
    connector.shutdown()


def test_a_finish_that_did_not_raise_keeps_nothing_for_the_error_path(model: Path) -> None:
    """request_finished's snapshot (for finish_after_error) goes once it returned: it does not keep
    the finished request's send alive, nor answer for it later."""
    scheduler, _ = make_scheduler(model, "kv_producer")
    connector = scheduler.connector
    req = "cmpl-g9-0-abcdef12"
    scheduler.add_request(make_request(req, 64, prefill_params("g9"), max_tokens=1))
    out = scheduler.schedule()
    scheduler.update_from_output(out, runner_output(out, sampled={req: 7}))  # finished, held for its send
    assert req not in connector.scheduler._send and connector.scheduler._finishing == (None, None, None)
    connector.shutdown()


def test_decode_finish_error_midway_still_stops_the_pull(
    model: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from vllm.v1.request import RequestStatus

    scheduler, posts, all_free = engine(model, "kv_consumer")
    connector = scheduler.connector
    req = "cmpl-g2-0-abcdef12"
    scheduler.add_request(make_request(req, 100, decode_params("g2")))
    out = scheduler.schedule()
    monkeypatch.setattr(connector.scheduler._poster, "cancel", bug)  # raises after the pull was forgotten
    scheduler.finish_requests(req, RequestStatus.FINISHED_ABORTED)
    assert hook_errors(connector, caplog) == ["request_finished"]
    scheduler.update_from_output(out, runner_output(out, kv_connector_worker_meta=WorkerReport({ext("g2"): 1})))
    out = scheduler.schedule()
    assert meta_of(out).recv_abort == (ext("g2"),) and not posts.bodies  # stopped, never posted
    assert not all_free()  # a pull may still write them
    scheduler.update_from_output(out, runner_output(out, finished_recving={req}))
    assert all_free()
    connector.shutdown()


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_load_whose_allocation_hook_raised_fails_at_once_by_the_policy(
    model: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, policy: str
) -> None:
    from vllm.v1.request import RequestStatus

    scheduler, posts, all_free = engine(model, "kv_consumer", load_failure_policy=policy)
    connector = scheduler.connector
    monkeypatch.setattr(connector.scheduler, "update_state_after_alloc", bug)
    req = "cmpl-g3-0-abcdef12"
    request = make_request(req, 100, decode_params("g3"))
    scheduler.add_request(request)
    out = scheduler.schedule()
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS and not meta_of(out).recv
    assert hook_errors(connector, caplog) == ["update_state_after_alloc"]
    workers = worker_connector(type(connector))  # rd2h's worker role reports what no worker knew of
    workers.bind_connector_metadata(out.kv_connector_metadata)
    results = workers.get_transfer_results(set())
    assert results.finished_recving == results.failed_recving == {req}
    scheduler.update_from_output(out, runner_output(out, finished_recving=results.finished_recving,
                                                    failed_recving=results.failed_recving))  # fmt: skip
    if policy == "fail":
        assert request.status == RequestStatus.FINISHED_ERROR and req not in scheduler.requests
        assert all_free()
    else:  # computed here, never matched again
        out = scheduler.schedule()
        assert out.num_scheduled_tokens == {req: 100} and not meta_of(out).recv
    assert not posts.bodies and not workers.get_transfer_results(set()).finished_recving  # reported once
    workers.worker.close()
    connector.shutdown()


def test_an_output_hook_error_leaves_vllm_to_free_what_the_workers_finished(
    model: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    scheduler, _, all_free = engine(model, "kv_producer")
    connector = scheduler.connector
    req = "cmpl-g4-0-abcdef12"
    scheduler.add_request(make_request(req, 64, prefill_params("g4"), max_tokens=1))
    out = scheduler.schedule()
    scheduler.update_from_output(out, runner_output(out, sampled={req: 7}))
    out = scheduler.schedule()
    monkeypatch.setattr(connector.scheduler, "update_connector_output", bug)
    scheduler.update_from_output(out, runner_output(out, finished_sending={req}))
    assert hook_errors(connector, caplog) == ["update_connector_output"]
    assert all_free()
    connector.shutdown()


def test_a_metadata_error_still_sends_what_was_queued_and_drops_sends_not_announced(
    model: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    scheduler, _, all_free = engine(model, "kv_producer")
    connector = scheduler.connector
    req = "cmpl-g5-0-abcdef12"
    scheduler.add_request(make_request(req, 64, prefill_params("g5"), max_tokens=1))
    with monkeypatch.context() as patch:
        patch.setattr(connector.scheduler, "_computed", bug)  # raises once its send was marked started
        out = scheduler.schedule()
    assert hook_errors(connector, caplog) == ["build_connector_meta"]
    assert not meta_of(out).send_new and out.num_scheduled_tokens == {req: 64}  # computed, not sent
    scheduler.update_from_output(out, runner_output(out, sampled={req: 7}))
    assert all_free()  # no worker knew its blocks: freed at its finish, never held
    assert not meta_of(scheduler.schedule()).send_finish
    connector.shutdown()


def test_a_metadata_error_still_aborts_a_send_preempted_in_that_step(
    model: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Its workers were told of its blocks in an earlier step; vLLM gives it new ones: the abort
    the lost metadata carried still goes out."""
    scheduler, _ = make_scheduler(model, "kv_producer", batched=128)
    connector, ours = scheduler.connector, scheduler.connector.scheduler
    req = "cmpl-g10-0-abcdef12"
    scheduler.add_request(make_request(req, 290, prefill_params("g10"), max_tokens=1))
    out = scheduler.schedule()
    assert meta_of(out).send_new
    scheduler.update_from_output(out, runner_output(out))
    build = ours.build_connector_meta

    def preempted(scheduler_output: Any) -> Any:  # as vLLM marks a resumed request
        scheduler_output.scheduled_cached_reqs.resumed_req_ids.add(req)
        return build(scheduler_output)

    monkeypatch.setattr(ours, "build_connector_meta", preempted)
    monkeypatch.setattr("rd2h.vllm.scheduler.StepMetadata", bug)  # raises once the step's sends are settled
    meta = meta_of(scheduler.schedule())
    assert hook_errors(connector, caplog) == ["build_connector_meta"]
    assert meta.send_abort == (ext("g10"),) and req not in ours._send
    connector.shutdown()


def test_a_late_send_whose_allocation_hook_raised_never_holds_its_blocks(
    model: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Prefill asked at once: the hook raised once the send was tracked, before its targets were
    asked for. Its finish must not hold the blocks for targets that never come (nothing would free them)."""
    scheduler, _, all_free = engine(model, "kv_producer", batched=128)
    connector = scheduler.connector
    monkeypatch.setattr(connector.scheduler, "_ask_targets", bug)
    req = "cmpl-g7-0-abcdef12"
    scheduler.add_request(make_request(req, 40, later("g7"), max_tokens=1))
    prefill_whole_prompt(scheduler, req)  # computed, finished
    assert hook_errors(connector, caplog) == ["update_state_after_alloc"]
    assert all_free() and not connector.scheduler._send  # freed at its finish
    connector.shutdown()


def test_a_handoff_pull_whose_allocation_hook_raised_late_still_releases_the_hold(
    model: Path, prefill: RD2HWorker, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture  # noqa: F811
) -> None:
    """vLLM's P/D convention: the hook raised once the pull had taken the hand-off: every Prefill
    rank is still told to free the held blocks now, not at its hold_timeout."""

    class Stats(dict):  # raises once the pull's record (with the hand-off) is made
        def __setitem__(self, key: str, value: int) -> None:
            if key == "pulled_tokens":
                bug()
            super().__setitem__(key, value)

    scheduler, _ = make_scheduler(model, "kv_consumer")
    connector = scheduler.connector
    monkeypatch.setattr(connector.scheduler, "stats", Stats(connector.scheduler.stats))
    request = decode_request("cmpl-g8-0-abcdef12", port_of(prefill))
    assert connector.get_num_new_matched_tokens(request, 0) == (100, True)
    connector.update_state_after_alloc(request, ((0, 1, 2, 3),), 100)
    assert hook_errors(connector, caplog) == ["update_state_after_alloc"]
    assert freed_by(prefill) == {"p-req"}
    assert connector.scheduler.stats["handoff_released"] == 1 and not connector.scheduler._recv
    connector.shutdown()


def test_a_failed_load_whose_blocks_are_unreadable_still_fails_by_id_and_warns(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An older vLLM learns a load failed from its blocks only: not knowing them is said, not silent."""
    from types import SimpleNamespace

    from rd2h.vllm.finished import FailedLoads

    failed, workers = FailedLoads(), FailedLoads()
    with caplog.at_level(logging.WARNING, logger="rd2h.vllm.finished"):
        failed.fail(SimpleNamespace(request_id="r1"), object())
    assert ["unreadable" in r.getMessage() for r in caplog.records] == [True]
    workers.bind(failed.attach(StepMetadata()))
    assert workers.take() == {"r1"} and workers.take_blocks() == set()
