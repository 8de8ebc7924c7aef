"""The connector's scheduler side inside vLLM's own Scheduler, with vLLM's Request objects.

The tests play the workers: each step's ``SchedulerOutput`` carries our metadata, and the
``ModelRunnerOutput`` they return carries what workers would report.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from vllm_kit import SECRET, make_request, make_scheduler, runner_output, write_model

from rd2h.vllm.metadata import StepMetadata, WorkerReport
from rd2h.vllm.params import decode_fields, prefill_fields
from rd2h.vllm.vouch import verify


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("llama"))


def hexid(tag: str) -> str:
    """A proxy-like id (hex) for a readable tag."""
    return tag.encode().hex().ljust(32, "0")


def ext(tag: str, prompt: int = 0, sample: int = 0) -> str:
    return f"{hexid(tag)}-{prompt}-{sample}"


def decode_params(rid: str = "r1", prompts: int = 1, samples: int = 1, *, now: float | None = None) -> dict[str, Any]:
    fields = decode_fields(SECRET, hexid(rid), prompts, samples, time.time() if now is None else now)
    return {"do_remote_prefill": True, "rd2h": fields}


def prefill_params(
    rid: str = "r1", endpoint: str = "127.0.0.1:5600/1", first_block: int = 0, samples: int = 1
) -> dict[str, Any]:
    targets = {0: [{"endpoint": endpoint, "first_block": first_block + s} for s in range(samples)]}
    return {"do_remote_decode": True, "rd2h": prefill_fields(SECRET, hexid(rid), 1, samples, targets, time.time())}


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
    assert (spec.ext_id, spec.first_block, spec.num_tokens, len(spec.blocks[0])) == (ext("r1"), 0, 100, 4)
    assert scheduler.connector.scheduler.stats["rendezvous"] == 0  # the workers have not seen it yet
    scheduler.update_from_output(out, runner_output(out, kv_connector_worker_meta=WorkerReport({ext("r1"): 1})))
    assert posts.posted.wait(5)
    (body,) = posts.bodies
    assert body.pop("url") == "http://proxy/rdv" and body["endpoint"] == "127.0.0.1:5600/1"
    signed = verify(SECRET, body, time.time())  # the proxy hears only what the secret signed
    assert (signed["ext_id"], signed["first_block"], signed["num_tokens"]) == (ext("r1"), 0, 100)
    # the transfer ends: vLLM computes only the last prompt token itself
    out = scheduler.schedule()
    scheduler.update_from_output(out, runner_output(out, finished_recving={"cmpl-1-0-abcdef12"}))
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"cmpl-1-0-abcdef12": 1}
    assert not meta_of(out).recv  # a second allocation does not pull again
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() < free
    scheduler.connector.shutdown()


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_the_rendezvous_tells_the_proxy_decodes_load_failure_policy(model: Path, policy: str) -> None:
    """The proxy acts on it when Prefill fails (recompute: a Decode computes the prompt), so
    it is vLLM's own setting, signed with the rest."""
    scheduler, posts = make_scheduler(model, "kv_consumer", load_failure_policy=policy)
    scheduler.add_request(make_request("cmpl-p-0-abcdef12", 40, decode_params("rp")))
    out = scheduler.schedule()
    scheduler.update_from_output(out, runner_output(out, kv_connector_worker_meta=WorkerReport({ext("rp"): 1})))
    assert posts.posted.wait(5)
    (body,) = posts.bodies
    body.pop("url")
    assert verify(SECRET, body, time.time())["on_load_failure"] == policy
    scheduler.connector.shutdown()


def test_decode_rendezvous_waits_for_every_rank(model: Path) -> None:
    scheduler, posts = make_scheduler(model, "kv_consumer")
    ours = scheduler.connector.scheduler
    ours.world_size = 2  # as with Decode TP 2: the summed report must reach 2
    scheduler.add_request(make_request("cmpl-2-0-abcdef12", 40, decode_params("r2")))
    out = scheduler.schedule()
    scheduler.update_from_output(out, runner_output(out, kv_connector_worker_meta=WorkerReport({ext("r2"): 1})))
    assert ours.stats["rendezvous"] == 0
    report = WorkerReport({ext("r2"): 1}).aggregate(WorkerReport({ext("r2"): 1}))
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
        scheduler.update_from_output(out, runner_output(out, kv_connector_worker_meta=WorkerReport({ext("r5"): 1})))
    assert posts.posted.wait(5) and ours.stats["rendezvous"] == 1
    scheduler.connector.shutdown()


def test_decode_prompt_list_children_get_their_own_ids(model: Path) -> None:
    scheduler, posts = make_scheduler(model, "kv_consumer")
    for i in range(3):
        scheduler.add_request(make_request(f"cmpl-x-{i}-abcdef12", 40 + i, decode_params("rx", 3), seed=i))
    out = scheduler.schedule()
    ids = sorted(spec.ext_id for spec in meta_of(out).recv)
    assert ids == [ext("rx", i) for i in range(3)]
    scheduler.update_from_output(out, runner_output(out, kv_connector_worker_meta=WorkerReport({i: 1 for i in ids})))
    assert posts.posted.wait(5)
    ours = scheduler.connector.scheduler
    assert ours._poster.flush(30)  # every body was posted (close would drop what is still queued)
    ours._poster.close()
    assert sorted(b["ext_id"] for b in posts.bodies) == ids


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
    scheduler.update_from_output(out, runner_output(out, kv_connector_worker_meta=WorkerReport({ext("r4"): 1})))
    out = scheduler.schedule()
    assert meta_of(out).recv_abort == (ext("r4"),)
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
            assert (spec.ext_id, spec.endpoint, spec.first_block, spec.num_tokens) == (ext("r5"), "10.0.0.2:5600/2", 1, 290)
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
    assert (finish.ext_id, finish.req_id, finish.aborted) == (ext("r5"), req, False)
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
    assert meta.send_abort == (ext("r8"),) and not meta.computed
    ours.build_connector_meta = build
    assert ours.request_finished(scheduler.requests[req], ([],)) == (False, None)  # vLLM frees it


def _forged(fields: dict[str, Any], **change: Any) -> dict[str, Any]:
    return {**fields, **change}


GOOD_DECODE = decode_fields(SECRET, hexid("r9"), 1, 1, time.time())
GOOD_PREFILL = prefill_fields(SECRET, hexid("r9"), 1, 1, {0: [{"endpoint": "127.0.0.1:5600/1"}]}, time.time())


@pytest.mark.parametrize(
    "ours",
    [None, "x", {"id": 3}, {"id": "r", "children": 2}, {"id": "r", "children": "two"},
     {"id": "r", "targets": {}}, {"id": "r", "targets": {"0": {"endpoint": "nonsense"}}},
     {"id": "r", "targets": {"0": {"endpoint": "h:1/1", "first_block": "x"}}},
     {"id": "r", "children": 1e400},
     # signed by someone without the secret, or changed after signing, or expired
     decode_fields(b"another-secret-0123456789abcdef", hexid("r9"), 1, 1, time.time()),
     prefill_fields(b"another-secret-0123456789abcdef", hexid("r9"), 1, 1, {0: [{"endpoint": "h:1/1"}]}, time.time()),
     _forged(GOOD_DECODE, samples=2), _forged(GOOD_PREFILL, targets={"0": [{"endpoint": "attacker.example:6666/1"}]}),
     decode_fields(SECRET, hexid("r9"), 1, 1, time.time() - 3600),
     prefill_fields(SECRET, hexid("r9"), 1, 1, {0: [{"endpoint": "h:70000/1"}]}, time.time()),
     prefill_fields(SECRET, hexid("r9"), 1, 1, {0: [{"endpoint": "h:1/1", "first_block": -5}]}, time.time()),
     decode_fields(SECRET, "not-hex", 1, 1, time.time()),
     {"sig": "x", "deep": functools.reduce(lambda inner, _: [inner], range(5000), [])}],  # re-encoding it recurses
)
def test_unvouched_or_malformed_params_are_served_locally_and_counted(model: Path, ours: Any) -> None:
    """A client's own kv_transfer_params (or a forged or stale signature) never steer a
    transfer and never raise inside vLLM's scheduler: the request is computed here."""
    for role, flag in (("kv_consumer", "do_remote_prefill"), ("kv_producer", "do_remote_decode")):
        scheduler, posts = make_scheduler(model, role)
        scheduler.add_request(make_request("cmpl-9-0-abcdef12", 50, {flag: True, "rd2h": ours}))
        out = scheduler.schedule()  # computed locally, as if no transfer had been asked
        assert out.num_scheduled_tokens == {"cmpl-9-0-abcdef12": 50}
        meta = meta_of(out)
        assert not (meta.recv or meta.send_new)
        assert scheduler.connector.scheduler.stats["refused_params"] >= 1
        scheduler.connector.shutdown()
        assert not posts.bodies


def test_decode_sample_0_pulls_and_the_other_samples_wait_for_its_blocks(model: Path) -> None:
    """n=2: vLLM fans the request out into 0_<id> and 1_<id>, which share kv_transfer_params
    (and, in the prefix cache, the prompt's blocks). Sample 0 pulls under its own id; sample 1
    is not schedulable until that pull ended, then finds the blocks as a local hit."""
    scheduler, posts = make_scheduler(model, "kv_consumer")
    ours = scheduler.connector.scheduler
    params = decode_params("rn", samples=2)
    leader, follower = "0_cmpl-n-0-abcdef12", "1_cmpl-n-0-abcdef12"
    for req in (leader, follower):
        scheduler.add_request(make_request(req, 70, params))
    out = scheduler.schedule()
    assert [spec.ext_id for spec in meta_of(out).recv] == [ext("rn", 0, 0)]
    assert out.total_num_scheduled_tokens == 0  # sample 1 waits too
    scheduler.update_from_output(out, runner_output(out, kv_connector_worker_meta=WorkerReport({ext("rn"): 1})))
    assert posts.posted.wait(5) and len(posts.bodies) == 1  # one rendezvous for the prompt
    out = scheduler.schedule()
    assert out.total_num_scheduled_tokens == 0
    scheduler.update_from_output(out, runner_output(out, finished_recving={leader}))
    out = scheduler.schedule()  # both go: sample 0 computes its last token, sample 1 its last partial block
    assert out.num_scheduled_tokens == {leader: 1, follower: 70 - 64}
    assert ours.stats["samples_from_prefix_cache"] == 1
    scheduler.connector.shutdown()


def test_decode_without_prefix_caching_samples_compute_here_and_say_so(model: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Without prefix caching sample 1 cannot reuse sample 0's pulled blocks: it computes its
    prompt here, and the engine says so with a count instead of falling back in silence."""
    scheduler, _ = make_scheduler(model, "kv_consumer", prefix_caching=False)
    ours = scheduler.connector.scheduler
    params = decode_params("rq", samples=2)
    assert ours.get_num_new_matched_tokens(make_request("0_cmpl-q-0-abcdef12", 70, params), 0) == (70, True)
    ours.update_connector_output(SimpleNamespace(finished_recving={"0_cmpl-q-0-abcdef12"}))  # its pull ended
    with caplog.at_level("WARNING", logger="rd2h.vllm.scheduler"):
        assert ours.get_num_new_matched_tokens(make_request("1_cmpl-q-0-abcdef12", 70, params), 0) == (0, False)
    assert ours.stats["samples_computed_here"] == 1 and "without prefix caching" in caplog.text
    scheduler.connector.shutdown()


def test_decode_a_second_live_request_with_the_same_id_is_served_locally(model: Path) -> None:
    """A replay of one signed request: the first keeps its pull, the second computes locally,
    and the first is still reported when its pull ends."""
    scheduler, _ = make_scheduler(model, "kv_consumer")
    params = decode_params("rd")
    scheduler.add_request(make_request("cmpl-d-0-abcdef12", 40, params))
    scheduler.add_request(make_request("cmpl-d-0-99999999", 40, params, seed=1))  # same prompt index 0
    out = scheduler.schedule()
    (spec,) = meta_of(out).recv
    assert spec.req_id == "cmpl-d-0-abcdef12"
    assert out.num_scheduled_tokens == {"cmpl-d-0-99999999": 40}
    assert scheduler.connector.scheduler.stats["refused_params"] == 1
    scheduler.connector.shutdown()


def test_prefill_serves_every_sample_from_one_computation(model: Path) -> None:
    scheduler, _ = make_scheduler(model, "kv_producer", batched=128)
    req = "cmpl-s-0-abcdef12"
    scheduler.add_request(make_request(req, 40, prefill_params("rs", "10.0.0.2:5600/1", samples=2), max_tokens=1))
    out = scheduler.schedule()
    meta = meta_of(out)
    assert [(s.ext_id, s.req_id, s.first_block) for s in meta.send_new] == [(ext("rs", 0, 0), req, 0), (ext("rs", 0, 1), req, 1)]
    assert meta.send_new[0].blocks == meta.send_new[1].blocks  # the same source blocks
    assert dict(meta.computed) == {ext("rs", 0, 0): 40, ext("rs", 0, 1): 40}
    scheduler.update_from_output(out, runner_output(out, sampled={req: 7}))
    finishes = meta_of(scheduler.schedule()).send_finish
    assert sorted(f.ext_id for f in finishes) == [ext("rs", 0, 0), ext("rs", 0, 1)]
    assert {f.req_id for f in finishes} == {req}
    scheduler.connector.shutdown()


def test_prefill_a_second_live_request_with_the_same_targets_is_computed_locally(model: Path) -> None:
    scheduler, _ = make_scheduler(model, "kv_producer", batched=256)
    params = prefill_params("rp")
    scheduler.add_request(make_request("cmpl-p-0-abcdef12", 40, params, max_tokens=1))
    scheduler.add_request(make_request("cmpl-p-0-99999999", 40, params, max_tokens=1, seed=1))
    meta = meta_of(scheduler.schedule())
    assert [s.req_id for s in meta.send_new] == ["cmpl-p-0-abcdef12"]
    assert scheduler.connector.scheduler.stats["refused_params"] == 1
    scheduler.connector.shutdown()
