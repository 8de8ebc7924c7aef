"""The engines' side of ``rd2h proxy --first-token-from-prefill``, inside vLLM's own Scheduler
with its Request objects: a Decode whose signed fields say ``tail`` 1 (its prompt ends in
Prefill's first sampled token, which Prefill never computed) loads every token but that one and
computes its position itself; ``tail`` is refused where it is not safe (several prompts or
samples, several KV cache groups, a field nobody signed); a Mamba Prefill asked for its first
token computes the prompt whole (a cut prompt would sample another token) and sends nothing."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from test_vllm_mamba_state import state_scheduler
from test_vllm_scheduler import ext, hexid, meta_of
from vllm_kit import SECRET, make_request, make_scheduler, runner_output, write_model

from rd2h.vllm.metadata import WorkerReport
from rd2h.vllm.params import accept_decode_leg, decode_fields, later_fields
from rd2h.vllm.vouch import sign, verify


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("llama"))


def params(rid: str, tail: int = 0, prompts: int = 1) -> dict[str, Any]:
    return {"do_remote_prefill": True, "rd2h": decode_fields(SECRET, hexid(rid), prompts, 1, time.time(), tail=tail)}


@pytest.mark.parametrize(("tokens", "tail", "blocks"), [(65, 1, 2), (65, 0, 3), (41, 1, 2)])
def test_decode_loads_what_prefill_computed_and_computes_the_first_tokens_position(
        model: Path, tokens: int, tail: int, blocks: int) -> None:
    """65 = two blocks of 32 and the first token: with ``tail`` Decode expects the 64 tokens
    Prefill computed, in two blocks (a third, which Prefill never fills, waited for in vain
    until Decode's deadline), and posts 64; the first token's position is its own."""
    scheduler, posts = make_scheduler(model, "kv_consumer")
    req = "cmpl-t-0-abcdef12"
    scheduler.add_request(make_request(req, tokens, params("t", tail)))
    out = scheduler.schedule()
    assert out.total_num_scheduled_tokens == 0  # waiting for remote KV
    (spec,) = meta_of(out).recv
    assert (spec.num_tokens, len(spec.blocks[0])) == (tokens - tail, blocks)
    scheduler.update_from_output(out, runner_output(out, kv_connector_worker_meta=WorkerReport({ext("t"): 1})))
    assert posts.posted.wait(5)
    (body,) = posts.bodies
    body.pop("url")
    assert verify(SECRET, body, time.time())["num_tokens"] == tokens - tail
    out = scheduler.schedule()
    scheduler.update_from_output(out, runner_output(out, finished_recving={req}))
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {req: 1}  # the last prompt token: the first token's position, or vLLM's own
    assert scheduler.requests[req].num_computed_tokens == tokens  # loaded, and the one token just scheduled
    scheduler.connector.shutdown()


def test_tail_is_for_one_prompt_of_one_sample_and_signed() -> None:
    with pytest.raises(ValueError, match="one prompt of one sample"):
        accept_decode_leg(SECRET, decode_fields(SECRET, hexid("a"), 2, 1, time.time(), tail=1), "x-1-ab", time.time())
    forged = {**decode_fields(SECRET, hexid("a"), 1, 1, time.time()), "tail": 1}  # a client's addition
    with pytest.raises(ValueError):
        accept_decode_leg(SECRET, forged, "x", time.time())
    assert accept_decode_leg(SECRET, decode_fields(SECRET, hexid("a"), 1, 1, time.time()), "x", time.time())[3] == 0


def test_tail_with_several_kv_cache_groups_is_refused_and_computed_here(model: Path) -> None:
    """Prefill sends all but the last token there, which this path was not built or tested for."""
    scheduler, posts = make_scheduler(model, "kv_consumer")
    ours = scheduler.connector.scheduler
    ours._whole = True  # as with several groups or a Mamba state group
    scheduler.add_request(make_request("cmpl-w-0-abcdef12", 65, params("w", 1)))
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"cmpl-w-0-abcdef12": 65} and not meta_of(out).recv
    assert ours.stats["refused_params"] == 1 and not posts.bodies
    scheduler.connector.shutdown()


def test_a_mamba_prefill_asked_for_its_first_token_computes_the_prompt_whole_and_sends_nothing(model: Path) -> None:
    scheduler = state_scheduler(model, "kv_producer")  # the same model files: the specs give its state group
    fields = later_fields(SECRET, hexid("f"), 1, "http://proxy/v1/rd2h/targets", 5.0, time.time(), first=True)
    request = make_request("cmpl-f-0-abcdef12", 50, {"do_remote_decode": True, "rd2h": fields}, max_tokens=1)
    scheduler.add_request(request)
    assert request.num_prompt_tokens == 50 == len(request.prompt_token_ids)  # not cut: its token is the client's
    out = scheduler.schedule()
    assert out.num_scheduled_tokens["cmpl-f-0-abcdef12"] == 50 and not out.kv_connector_metadata.send_new
    assert scheduler.connector._truncation.refused == 1  # counted as state_uncut
    scheduler.connector.shutdown()


@pytest.mark.parametrize("forged", ["tail added", "another secret", "tail for two prompts", "tail 2"])
def test_a_direct_decode_request_with_a_forged_tail_is_refused_counted_and_computed_here(
        model: Path, forged: str) -> None:
    """A client writing to Decode directly cannot make it load all but a last token of its own
    choosing: a ``tail`` the proxy did not sign for this request is refused like any forged field."""
    rid, now = hexid("g"), time.time()
    fields = {
        "tail added": {**decode_fields(SECRET, rid, 1, 1, now), "tail": 1},  # the proxy's fields, a client's addition
        "another secret": decode_fields(b"not-the-shared-secret-0123456789", rid, 1, 1, now, tail=1),
        "tail for two prompts": decode_fields(SECRET, rid, 2, 1, now, tail=1),  # never signed by the proxy
        "tail 2": sign(SECRET, {"leg": "decode", "id": rid, "prompts": 1, "samples": 1, "tail": 2}, now),
    }[forged]
    scheduler, posts = make_scheduler(model, "kv_consumer")
    ours = scheduler.connector.scheduler
    req = "cmpl-g-0-abcdef12"
    scheduler.add_request(make_request(req, 65, {"do_remote_prefill": True, "rd2h": fields}))
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {req: 65} and not meta_of(out).recv  # computed here, nothing pulled
    assert ours.stats["refused_params"] == 1 and not posts.bodies  # counted; no rendezvous names it
    scheduler.connector.shutdown()


@pytest.mark.parametrize("forged", ["first_token added", "unsigned"])
def test_a_direct_prefill_request_with_a_forged_first_token_is_refused_and_nothing_is_held(
        model: Path, forged: str) -> None:
    """A client cannot make Prefill hold blocks or ask for targets with fields the proxy did not sign."""
    fields = later_fields(SECRET, hexid("h"), 1, "http://proxy/v1/rd2h/targets", 5.0, time.time())
    fields = {"first_token added": {**fields, "first_token": True},
              "unsigned": {k: v for k, v in later_fields(SECRET, hexid("h"), 1, "http://proxy/v1/rd2h/targets", 5.0,
                                                         time.time(), first=True).items() if k != "sig"}}[forged]
    scheduler, _ = make_scheduler(model, "kv_producer")
    ours = scheduler.connector.scheduler
    req = "cmpl-h-0-abcdef12"
    scheduler.add_request(make_request(req, 40, {"do_remote_decode": True, "rd2h": fields}, max_tokens=1))
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {req: 40} and not meta_of(out).send_new and not meta_of(out).hold
    assert ours.stats["refused_params"] == 1 and req not in ours._send and ours._targets is None  # nothing asked
    scheduler.update_from_output(out, runner_output(out, sampled={req: 7}))
    assert req not in scheduler.requests  # finished and freed: nothing held for targets
    scheduler.connector.shutdown()
