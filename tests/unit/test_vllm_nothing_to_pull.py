"""Decode's scheduler when it loads nothing of a prompt (rd2h.vllm.nothing), inside vLLM's own
Scheduler with the hybrid allocator (a sliding-window and a full group: Decode loads all prompt
tokens but the last). It must say so to the proxy at once, signed, release its claim and count it:
before, it posted nothing and the proxy waited out its rendezvous timeout."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from test_vllm_hybrid_groups import hybrid_scheduler, model  # noqa: F401 - the model fixture
from test_vllm_mamba_state import state_scheduler
from test_vllm_scheduler import decode_params, ext, hexid, meta_of
from vllm_kit import BLOCK, SECRET, Posts, make_request, make_scheduler, record_posts, runner_output

from rd2h.vllm.params import accept_late, accept_later, accept_prefill, later_fields, prefill_fields
from rd2h.vllm.stats import LOCAL_REASONS
from rd2h.vllm.vouch import verify


def _said(scheduler, posts: Posts) -> dict:  # type: ignore[no-untyped-def]
    assert scheduler.connector.scheduler._poster.flush(5)  # everything submitted was posted
    (body,) = posts.bodies
    assert body.pop("url") == "http://proxy/rdv"
    return verify(SECRET, body, time.time())  # signed with the secret, as every rendezvous


def test_a_one_token_prompt_is_computed_here_and_the_proxy_told_at_once(model: Path) -> None:  # noqa: F811
    scheduler = hybrid_scheduler(model, "kv_consumer")
    posts = record_posts(scheduler)
    ours = scheduler.connector.scheduler
    req = "cmpl-one-0-abcdef12"
    scheduler.add_request(make_request(req, 1, decode_params("one")))
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {req: 1} and not out.kv_connector_metadata.recv  # computed, not waited for
    said = _said(scheduler, posts)
    assert (said["ext_id"], said["nothing"], said["num_tokens"]) == (ext("one"), "short_prompt", 1)
    assert "endpoint" not in said  # nothing to dial
    assert ours.stats["nothing_to_pull"] == 1 and ours.stats["rendezvous"] == 0
    assert ext("one") not in ours._claims and req not in ours._claimed  # released: nothing lands under it
    assert "nothing_to_pull" in LOCAL_REASONS  # vllm:rd2h_local_recomputes_total{reason="nothing_to_pull"}
    scheduler.connector.shutdown()


def test_a_prompt_whose_loadable_tokens_are_all_in_the_prefix_cache_is_said_once(model: Path) -> None:  # noqa: F811
    scheduler = hybrid_scheduler(model, "kv_consumer")
    posts = record_posts(scheduler)
    ours = scheduler.connector.scheduler
    request = make_request("cmpl-pc-0-abcdef12", BLOCK + 1, decode_params("pc"))
    assert ours.get_num_new_matched_tokens(request, BLOCK) == (0, False)  # the hit is all Decode would load
    assert request.kv_transfer_params["do_remote_prefill"] is False  # preempted later: never pulls
    assert ours.get_num_new_matched_tokens(request, 0) == (0, False)
    # a replay of its signed fields, with nothing cached: the proxy will never send, so it is not pulled
    replay = make_request("cmpl-pc-0-replay12", BLOCK + 1, request.kv_transfer_params | {"do_remote_prefill": True})
    assert ours.get_num_new_matched_tokens(replay, 0) == (0, False)
    assert ours.stats["refused_params"] == 1  # the replay: refused, counted, not said again
    said = _said(scheduler, posts)
    assert (said["nothing"], said["num_tokens"]) == ("prefix_cached", BLOCK + 1)
    assert ours.stats["nothing_to_pull"] == 1 and len(posts.bodies) == 1 and not ours._recv_new
    # a prompt with one more token to load still pulls it, and posts only once its workers expect it
    more = make_request("cmpl-pm-0-abcdef12", BLOCK + 2, decode_params("pm"))
    assert ours.get_num_new_matched_tokens(more, BLOCK) == (1, True)
    scheduler.connector.shutdown()


def test_prefill_fields_name_no_target_for_a_prompt_decode_loads_nothing_of() -> None:
    rid = "ab" * 16
    targets = {0: [], 1: [{"endpoint": "127.0.0.1:5600/1", "first_block": 0}]}
    fields = prefill_fields(SECRET, rid, 2, 1, targets, time.time())
    assert accept_prefill(SECRET, fields, "cmpl-x-0-abcdef12", time.time()) == []  # computed, sent nowhere
    (target,) = accept_prefill(SECRET, fields, "cmpl-x-1-abcdef12", time.time())
    assert target.ext_id == f"{rid}-1-0"
    # asked at once: no target is a failed ask (its held blocks are freed), never a wait for more
    later = later_fields(SECRET, rid, 2, "http://proxy/v1/rd2h/targets", 60, time.time())
    asked = accept_later(SECRET, later, "cmpl-x-0-abcdef12", time.time())
    assert asked is not None
    with pytest.raises(ValueError, match="loads nothing of prompt 0"):
        accept_late(SECRET, asked, fields, "cmpl-x-0-abcdef12", time.time())


def test_the_ids_said_to_load_nothing_are_remembered_up_to_a_bound(model: Path) -> None:  # noqa: F811
    from types import SimpleNamespace

    from rd2h.vllm.nothing import _REMEMBERED

    scheduler = hybrid_scheduler(model, "kv_consumer")
    ours = scheduler.connector.scheduler
    ours._poster.close()
    ours._poster = None  # said, not posted: only the memory is under test
    for i in range(_REMEMBERED + 1):
        request = SimpleNamespace(request_id=f"r{i}", prompt_token_ids=[1], kv_transfer_params={})
        ours._nothing_to_pull(request, f"e{i}", 0)
    assert len(ours._said_nothing) == _REMEMBERED  # bounded: the oldest went first
    assert not ours._told_nothing("e0") and ours._told_nothing("e1") and ours._told_nothing(f"e{_REMEMBERED}")
    assert ours.stats["nothing_to_pull"] == _REMEMBERED + 1
    scheduler.connector.shutdown()


def _nowhere(rid: str) -> dict:
    """Prefill's leg of prompt 0 of two, which Decode loads nothing of (its target list is empty)."""
    targets = {0: [], 1: [{"endpoint": "127.0.0.1:5600/1", "first_block": 0}]}
    return {"do_remote_decode": True, "rd2h": prefill_fields(SECRET, hexid(rid), 2, 1, targets, time.time())}


def test_a_prefill_leg_sent_nowhere_is_computed_untracked_and_its_blocks_freed(model: Path) -> None:  # noqa: F811
    """Nothing will read its blocks: the scheduler keeps no send for it (no per-step gathering of
    its block ids), refuses nothing and vLLM frees its blocks when it finishes."""
    scheduler, _ = make_scheduler(model, "kv_producer")
    ours = scheduler.connector.scheduler
    pool = scheduler.kv_cache_manager.block_pool
    free = pool.get_num_free_blocks()
    req = "cmpl-nw-0-abcdef12"
    scheduler.add_request(make_request(req, 40, _nowhere("nw"), max_tokens=1))
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {req: 40} and not meta_of(out).send_new
    assert req not in ours._send and ours.stats["refused_params"] == 0
    scheduler.update_from_output(out, runner_output(out, sampled={req: 7}))
    assert req not in scheduler.requests and pool.get_num_free_blocks() == free  # nothing held
    scheduler.connector.shutdown()


def test_a_mamba_prefill_leg_sent_nowhere_keeps_its_prompt_whole(tmp_path: Path) -> None:
    """Its prompt is cut only for a state Decode continues from: none here, so computed as sent."""
    from vllm_kit import write_model

    scheduler = state_scheduler(write_model(tmp_path / "mamba"), "kv_producer")
    request = make_request("cmpl-nm-0-abcdef12", 50, _nowhere("nm"), max_tokens=1)
    scheduler.add_request(request)
    assert request.num_prompt_tokens == 50 == len(request.prompt_token_ids)
    scheduler.connector.shutdown()
