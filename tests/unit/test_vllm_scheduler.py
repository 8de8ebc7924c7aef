"""The connector's scheduler side inside vLLM's own Scheduler, with vLLM's Request objects.

The tests play the workers: each step's ``SchedulerOutput`` carries our metadata, and the
``ModelRunnerOutput`` they return carries what workers would report.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from vllm_kit import make_request, make_scheduler, runner_output, write_model

from rd2h.vllm.metadata import StepMetadata, WorkerReport


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("llama"))


def decode_params(rid: str = "r1", children: int = 1) -> dict[str, Any]:
    return {"do_remote_prefill": True, "rd2h": {"id": rid, "children": children, "metaserver": "http://proxy/rdv"}}


def prefill_params(rid: str = "r1", endpoint: str = "127.0.0.1:5600/1", first_block: int = 0) -> dict[str, Any]:
    return {"do_remote_decode": True,
            "rd2h": {"id": rid, "children": 1, "targets": {"0": {"endpoint": endpoint, "first_block": first_block}}}}


def meta_of(output: Any) -> StepMetadata:
    meta = output.kv_connector_metadata
    assert isinstance(meta, StepMetadata)
    return meta


def test_decode_pulls_the_prompt_and_posts_only_after_every_worker_expects_it(model: Path) -> None:
    scheduler, posts = make_scheduler(model, "kv_consumer")
    free = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    scheduler.add_request(make_request("cmpl-1-0-abcdef12", 100, decode_params()))
    out = scheduler.schedule()
    assert out.total_num_scheduled_tokens == 0  # waiting for remote KV
    (spec,) = meta_of(out).recv
    assert (spec.ext_id, spec.first_block, spec.num_tokens, len(spec.blocks[0])) == ("r1-0", 0, 100, 4)
    assert scheduler.connector.scheduler.stats["rendezvous"] == 0  # the workers have not seen it yet
    scheduler.update_from_output(out, runner_output(out, kv_connector_worker_meta=WorkerReport({"r1-0": 1})))
    assert posts.posted.wait(5)
    (body,) = posts.bodies
    assert body["url"] == "http://proxy/rdv" and body["endpoint"] == "127.0.0.1:5600/1"
    assert (body["id"], body["child"], body["first_block"], body["num_tokens"]) == ("r1", 0, 0, 100)
    # the transfer ends: vLLM computes only the last prompt token itself
    out = scheduler.schedule()
    scheduler.update_from_output(out, runner_output(out, finished_recving={"cmpl-1-0-abcdef12"}))
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"cmpl-1-0-abcdef12": 1}
    assert not meta_of(out).recv  # a second allocation does not pull again
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() < free
    scheduler.connector.shutdown()


def test_decode_rendezvous_waits_for_every_rank(model: Path) -> None:
    scheduler, posts = make_scheduler(model, "kv_consumer")
    ours = scheduler.connector.scheduler
    ours.world_size = 2  # as with Decode TP 2: the summed report must reach 2
    scheduler.add_request(make_request("cmpl-2-0-abcdef12", 40, decode_params("r2")))
    out = scheduler.schedule()
    scheduler.update_from_output(out, runner_output(out, kv_connector_worker_meta=WorkerReport({"r2-0": 1})))
    assert ours.stats["rendezvous"] == 0
    report = WorkerReport({"r2-0": 1}).aggregate(WorkerReport({"r2-0": 1}))
    out = scheduler.schedule()
    scheduler.update_from_output(out, runner_output(out, kv_connector_worker_meta=report))
    assert posts.posted.wait(5) and ours.stats["rendezvous"] == 1
    scheduler.connector.shutdown()


def test_decode_rendezvous_sums_reports_that_come_back_in_different_steps(model: Path) -> None:
    """Each Decode rank said it expects the request, but in the outputs of two different steps:
    the rendezvous is posted once the sum reaches the world (a per-step count never did, and
    Decode waited for KV that Prefill was never asked to send, until its deadline)."""
    scheduler, posts = make_scheduler(model, "kv_consumer")
    ours = scheduler.connector.scheduler
    ours.world_size = 2
    scheduler.add_request(make_request("cmpl-5-0-abcdef12", 40, decode_params("r5")))
    for _rank in range(2):
        out = scheduler.schedule()
        scheduler.update_from_output(out, runner_output(out, kv_connector_worker_meta=WorkerReport({"r5-0": 1})))
    assert posts.posted.wait(5) and ours.stats["rendezvous"] == 1
    scheduler.connector.shutdown()


def test_decode_prompt_list_children_get_their_own_ids(model: Path) -> None:
    scheduler, posts = make_scheduler(model, "kv_consumer")
    for i in range(3):
        scheduler.add_request(make_request(f"cmpl-x-{i}-abcdef12", 40 + i, decode_params("rx", 3), seed=i))
    out = scheduler.schedule()
    ids = sorted(spec.ext_id for spec in meta_of(out).recv)
    assert ids == ["rx-0", "rx-1", "rx-2"]
    scheduler.update_from_output(out, runner_output(out, kv_connector_worker_meta=WorkerReport({i: 1 for i in ids})))
    assert posts.posted.wait(5)
    ours = scheduler.connector.scheduler
    ours._poster.close()  # drains nothing more; every body was posted in order
    assert sorted(b["child"] for b in posts.bodies) == [0, 1, 2]


def test_decode_honours_a_local_prefix_hit(model: Path) -> None:
    scheduler, _ = make_scheduler(model, "kv_consumer")
    ours = scheduler.connector.scheduler
    request = make_request("cmpl-3-0-abcdef12", 100, decode_params("r3"))
    assert ours.get_num_new_matched_tokens(request, 64) == (36, True)
    ours.update_state_after_alloc(request, ([5, 6, 7, 8],), 36)
    (spec,) = meta_of(scheduler.schedule()).recv
    assert (spec.first_block, spec.blocks) == (2, ((5, 6, 7, 8),))
    assert request.kv_transfer_params["do_remote_prefill"] is False
    assert ours.get_num_new_matched_tokens(request, 64) == (0, False)  # consumed
    scheduler.connector.shutdown()


def test_decode_abort_while_waiting_stops_the_pull_and_frees_blocks_once_reported(model: Path) -> None:
    from vllm.v1.request import RequestStatus

    scheduler, posts = make_scheduler(model, "kv_consumer")
    pool = scheduler.kv_cache_manager.block_pool
    free = pool.get_num_free_blocks()
    scheduler.add_request(make_request("cmpl-4-0-abcdef12", 100, decode_params("r4")))
    out = scheduler.schedule()
    scheduler.finish_requests("cmpl-4-0-abcdef12", RequestStatus.FINISHED_ABORTED)
    assert pool.get_num_free_blocks() < free  # a pull may still write them
    scheduler.update_from_output(out, runner_output(out, kv_connector_worker_meta=WorkerReport({"r4-0": 1})))
    out = scheduler.schedule()
    assert meta_of(out).recv_abort == ("r4-0",)
    assert scheduler.connector.scheduler.stats["rendezvous"] == 0 and not posts.bodies
    scheduler.update_from_output(out, runner_output(out, finished_recving={"cmpl-4-0-abcdef12"}))
    assert pool.get_num_free_blocks() == free
    scheduler.connector.shutdown()


def test_prefill_sends_blocks_as_chunks_allocate_them_and_holds_them_until_sent(model: Path) -> None:
    scheduler, _ = make_scheduler(model, "kv_producer", batched=128)
    pool = scheduler.kv_cache_manager.block_pool
    free = pool.get_num_free_blocks()
    req = "cmpl-5-0-abcdef12"
    scheduler.add_request(make_request(req, 290, prefill_params("r5", "10.0.0.2:5600/2", first_block=1), max_tokens=1))
    seen: list[int] = []
    computed: list[int] = []
    for _ in range(3):
        out = scheduler.schedule()
        meta = meta_of(out)
        for spec in meta.send_new:
            assert (spec.ext_id, spec.endpoint, spec.first_block, spec.num_tokens) == ("r5-0", "10.0.0.2:5600/2", 1, 290)
            seen += spec.blocks[0]
        for more in meta.send_blocks:
            seen += more.blocks[0]
        computed += [tokens for ext_id, tokens in meta.computed]
        last = computed[-1] == 290
        scheduler.update_from_output(out, runner_output(out, sampled={req: 7} if last else None))
    assert computed == [128, 256, 290]
    assert len(seen) == 10 == len(set(seen))  # ceil(290 / 32) blocks, each once
    # max_tokens=1: finished; the blocks stay until the workers report it sent
    out = scheduler.schedule()
    (finish,) = meta_of(out).send_finish
    assert (finish.ext_id, finish.req_id, finish.aborted) == ("r5-0", req, False)
    assert pool.get_num_free_blocks() < free
    scheduler.update_from_output(out, runner_output(out, finished_sending={req}))
    assert pool.get_num_free_blocks() == free


def test_prefill_abort_mid_prompt_is_reported_aborted(model: Path) -> None:
    from vllm.v1.request import RequestStatus

    scheduler, _ = make_scheduler(model, "kv_producer", batched=128)
    req = "cmpl-6-0-abcdef12"
    scheduler.add_request(make_request(req, 290, prefill_params("r6"), max_tokens=1))
    out = scheduler.schedule()
    scheduler.update_from_output(out, runner_output(out))
    scheduler.finish_requests(req, RequestStatus.FINISHED_ABORTED)
    (finish,) = meta_of(scheduler.schedule()).send_finish
    assert finish.aborted


def test_requests_without_rd2h_params_are_untouched(model: Path) -> None:
    for role in ("kv_consumer", "kv_producer", "kv_both"):
        scheduler, _ = make_scheduler(model, role)
        scheduler.add_request(make_request("cmpl-7-0-abcdef12", 50, {}))
        out = scheduler.schedule()
        assert out.num_scheduled_tokens == {"cmpl-7-0-abcdef12": 50}
        meta = meta_of(out)
        assert not (meta.recv or meta.send_new or meta.computed)
        scheduler.connector.shutdown()


def test_prefill_preempted_mid_send_is_stopped_and_never_reported(model: Path) -> None:
    scheduler, _ = make_scheduler(model, "kv_producer", batched=128)
    ours = scheduler.connector.scheduler
    req = "cmpl-8-0-abcdef12"
    scheduler.add_request(make_request(req, 290, prefill_params("r8"), max_tokens=1))
    out = scheduler.schedule()
    assert meta_of(out).send_new
    scheduler.update_from_output(out, runner_output(out))
    build = ours.build_connector_meta

    def preempted(scheduler_output: Any) -> StepMetadata:  # as vLLM marks a resumed request
        scheduler_output.scheduled_cached_reqs.resumed_req_ids.add(req)
        return build(scheduler_output)

    ours.build_connector_meta = preempted
    meta = meta_of(scheduler.schedule())
    assert meta.send_abort == ("r8-0",) and not meta.computed
    ours.build_connector_meta = build
    assert ours.request_finished(scheduler.requests[req], ([],)) == (False, None)  # vLLM frees it


@pytest.mark.parametrize(
    "ours",
    [None, "x", {"id": 3}, {"id": "r", "children": 2}, {"id": "r", "children": "two"},
     {"id": "r", "targets": {}}, {"id": "r", "targets": {"0": {"endpoint": "nonsense"}}},
     {"id": "r", "targets": {"0": {"endpoint": "h:1/1", "first_block": "x"}}}],
)
def test_malformed_params_never_raise_in_the_scheduler(model: Path, ours: Any) -> None:
    for role, flag in (("kv_consumer", "do_remote_prefill"), ("kv_producer", "do_remote_decode")):
        scheduler, _ = make_scheduler(model, role)
        scheduler.add_request(make_request("cmpl-9-0-abcdef12", 50, {flag: True, "rd2h": ours}))
        out = scheduler.schedule()  # computed locally, as if no transfer had been asked
        assert out.num_scheduled_tokens == {"cmpl-9-0-abcdef12": 50}
        meta = meta_of(out)
        assert not (meta.recv or meta.send_new)
        scheduler.connector.shutdown()
