"""Prefill asked before Decode's rendezvous (rd2h.vllm.late_sends): inside vLLM's own Scheduler.

The proxy's answers come from a stand-in that answers when the test says, with fields signed
as the proxy signs them (rd2h.vllm.params): the targets after Prefill finished its layers, a
rendezvous that never comes, and a forged answer.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from vllm_kit import SECRET, make_request, make_scheduler, runner_output, write_model

from rd2h.vllm.later import TargetAsker
from rd2h.vllm.metadata import StepMetadata
from rd2h.vllm.params import accept_targets_ask, later_fields, prefill_fields

URL = "http://proxy/v1/rd2h/targets"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("llama"))


def hexid(tag: str) -> str:
    return tag.encode().hex().ljust(32, "0")


class Proxy:
    """The proxy's targets route: each ask waits until ``answer`` is called (or forever)."""

    def __init__(self) -> None:
        self.asks: list[tuple[str, dict[str, Any]]] = []
        self.asked = threading.Event()
        self._answered = threading.Event()
        self._answer: tuple[int, Any] = (500, None)

    def answer(self, status: int, body: Any) -> None:
        self._answer = (status, body)
        self._answered.set()

    async def __call__(self, url: str, body: Any, timeout: float) -> tuple[int, Any]:
        self.asks.append((url, dict(body)))
        self.asked.set()
        await asyncio.get_running_loop().run_in_executor(None, self._answered.wait, timeout)
        return self._answer


def producer(model: Path) -> tuple[Any, Proxy]:
    scheduler, _ = make_scheduler(model, "kv_producer", batched=128)
    proxy = Proxy()
    scheduler.connector.scheduler._targets = TargetAsker(post=proxy)
    return scheduler, proxy


def later(rid: str, wait: float = 30.0) -> dict[str, Any]:
    return {"do_remote_decode": True, "rd2h": later_fields(SECRET, hexid(rid), 1, URL, wait, time.time())}


def targets(rid: str, *, secret: bytes = SECRET) -> dict[str, Any]:
    return prefill_fields(secret, hexid(rid), 1, 1, {0: [{"endpoint": "10.0.0.2:5600/1", "first_block": 1}]},
                          time.time())  # fmt: skip


def meta_of(output: Any) -> StepMetadata:
    meta = output.kv_connector_metadata
    assert isinstance(meta, StepMetadata)
    return meta


def prefill_whole_prompt(scheduler: Any, req: str) -> None:
    """One step computes the 40-token prompt (nothing to send yet), max_tokens=1 finishes it."""
    out = scheduler.schedule()
    meta = meta_of(out)
    assert out.num_scheduled_tokens == {req: 40} and not meta.send_new and not meta.computed
    scheduler.update_from_output(out, runner_output(out, sampled={req: 7}))


def until(scheduler: Any, done: Any, steps: int = 2000) -> StepMetadata:
    """Idle steps (each waits for the proxy's answer, woken by it) until ``done(meta)``."""
    for _ in range(steps):
        out = scheduler.schedule()
        meta = meta_of(out)
        scheduler.update_from_output(out, runner_output(out))
        if done(meta):
            return meta
    raise AssertionError("never")


def test_targets_that_come_after_prefill_finished_its_layers_announce_them_all_at_once(model: Path) -> None:
    scheduler, proxy = producer(model)
    ours = scheduler.connector.scheduler
    pool = scheduler.kv_cache_manager.block_pool
    free = pool.get_num_free_blocks()
    req = "cmpl-a-0-abcdef12"
    scheduler.add_request(make_request(req, 40, later("ra"), max_tokens=1))
    prefill_whole_prompt(scheduler, req)  # computed before any rendezvous
    assert proxy.asked.wait(5)
    (url, ask), = proxy.asks
    assert url == URL and accept_targets_ask(SECRET, ask, time.time()) == hexid("ra")  # signed by the engine
    assert pool.get_num_free_blocks() < free  # finished, its blocks held for the targets
    meta = meta_of(scheduler.schedule())
    assert not meta.send_new and not meta.release
    proxy.answer(200, targets("ra"))  # every Decode posted its rendezvous
    meta = until(scheduler, lambda m: m.send_new)
    (spec,) = meta.send_new
    assert (spec.ext_id, spec.endpoint, spec.first_block, spec.num_tokens) == (f"{hexid('ra')}-0-0",
                                                                               "10.0.0.2:5600/1", 1, 40)
    assert spec.written == 40 and len(spec.blocks[0]) == 2  # every layer written: announced at once
    (finish,) = meta.send_finish
    assert (finish.req_id, finish.aborted) == (req, False)
    assert ours.stats["late_targets"] == 1
    out = scheduler.schedule()
    scheduler.update_from_output(out, runner_output(out, finished_sending={req}))
    assert pool.get_num_free_blocks() == free
    scheduler.connector.shutdown()


def test_a_rendezvous_that_never_comes_frees_the_blocks_at_the_deadline(model: Path) -> None:
    scheduler, proxy = producer(model)
    ours = scheduler.connector.scheduler
    pool = scheduler.kv_cache_manager.block_pool
    free = pool.get_num_free_blocks()
    req = "cmpl-b-0-abcdef12"
    scheduler.add_request(make_request(req, 40, later("rb", wait=0.2), max_tokens=1))  # the proxy's deadline
    prefill_whole_prompt(scheduler, req)
    meta = until(scheduler, lambda m: m.release)  # the proxy never answers: the ask runs out of its wait
    assert meta.release == (req,) and not meta.send_new and ours.stats["targets_failed"] == 1
    out = scheduler.schedule()  # the workers report it finished-sending at once (RD2HWorker.bind)
    scheduler.update_from_output(out, runner_output(out, finished_sending={req}))
    assert pool.get_num_free_blocks() == free
    # the engine goes on: the next request is computed and sent as any other
    req2 = "cmpl-c-0-abcdef12"
    scheduler.add_request(make_request(req2, 40, later("rc"), max_tokens=1))
    proxy.answer(200, targets("rc"))
    (spec,) = until(scheduler, lambda m: m.send_new).send_new
    assert spec.ext_id == f"{hexid('rc')}-0-0"
    scheduler.connector.shutdown()


def test_a_proxy_that_says_no_targets_come_frees_the_blocks(model: Path) -> None:
    scheduler, proxy = producer(model)
    req = "cmpl-d-0-abcdef12"
    scheduler.add_request(make_request(req, 40, later("rd"), max_tokens=1))
    prefill_whole_prompt(scheduler, req)
    proxy.answer(410, {"error": "no targets: Decode did not post a rendezvous within 60 s"})
    assert until(scheduler, lambda m: m.release).release == (req,)
    scheduler.connector.shutdown()


@pytest.mark.parametrize("forged", ["another secret", "another request", "unsigned"])
def test_forged_targets_are_refused_and_nothing_is_sent(model: Path, forged: str) -> None:
    scheduler, proxy = producer(model)
    ours = scheduler.connector.scheduler
    req = "cmpl-e-0-abcdef12"
    scheduler.add_request(make_request(req, 40, later("re"), max_tokens=1))
    prefill_whole_prompt(scheduler, req)
    answer = {
        "another secret": targets("re", secret=b"not-the-shared-secret-0123456789"),
        "another request": targets("rf"),  # the proxy's signed answer for another request, replayed
        "unsigned": {k: v for k, v in targets("re").items() if k != "sig"},
    }[forged]
    proxy.answer(200, answer)
    meta = until(scheduler, lambda m: m.release or m.send_new)
    assert meta.release == (req,) and not meta.send_new
    assert ours.stats["targets_failed"] == 1 and ours.stats["late_targets"] == 0
    scheduler.connector.shutdown()


def test_targets_that_come_while_prefill_computes_start_the_send_with_the_written_chunks(model: Path) -> None:
    scheduler, proxy = producer(model)
    req = "cmpl-g-0-abcdef12"
    scheduler.add_request(make_request(req, 290, later("rg"), max_tokens=1))  # three chunks of 128
    out = scheduler.schedule()
    assert not meta_of(out).send_new
    scheduler.update_from_output(out, runner_output(out))
    proxy.answer(200, targets("rg"))
    assert proxy.asked.wait(5)
    scheduler.connector.scheduler._targets.wait(5)
    out = scheduler.schedule()  # the second chunk's step: the first is written
    meta = meta_of(out)
    (spec,) = meta.send_new
    assert spec.written == 128 and len(spec.blocks[0]) == 4
    assert meta.computed == ((spec.ext_id, 256),)  # the rest as it is computed
    scheduler.connector.shutdown()


def test_a_hybrid_request_finished_short_of_its_prompt_before_its_targets_is_refused_with_a_count(
    tmp_path: Path,
) -> None:
    from test_vllm_hybrid_groups import hybrid_scheduler
    from vllm.v1.request import RequestStatus

    scheduler = hybrid_scheduler(write_model(tmp_path / "hybrid"), "kv_producer", batched=32)
    ours = scheduler.connector.scheduler
    proxy = Proxy()
    ours._targets = TargetAsker(post=proxy)
    pool = scheduler.kv_cache_manager.block_pool
    free = pool.get_num_free_blocks()
    req = "cmpl-h-0-abcdef12"
    scheduler.add_request(make_request(req, 40, later("rh"), max_tokens=1))
    out = scheduler.schedule()  # the first chunk: 32 of its 40 prompt tokens
    assert out.num_scheduled_tokens == {req: 32}
    scheduler.update_from_output(out, runner_output(out))
    scheduler.finish_requests(req, RequestStatus.FINISHED_STOPPED)  # not aborted: its blocks held for the targets
    assert pool.get_num_free_blocks() < free
    proxy.answer(200, targets("rh"))
    meta = until(scheduler, lambda m: m.release)  # several groups move whole: a part is never sent
    assert meta.release == (req,) and not meta.send_new
    assert ours.stats["targets_failed"] == 1 and ours.stats["late_targets"] == 0  # counted (and logged), not silent
    out = scheduler.schedule()
    scheduler.update_from_output(out, runner_output(out, finished_sending={req}))
    assert pool.get_num_free_blocks() == free
    scheduler.connector.shutdown()
