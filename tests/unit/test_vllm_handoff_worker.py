"""vLLM's P/D convention on the workers, over real tensors: a Prefill worker holds a finished
request's blocks, a Decode's ask (real ZMQ on loopback) makes it announce every layer, and the
bytes land in Decode's destination blocks; a hold nobody asks for is freed and counted."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch
from conftest import free_base_port
from test_vllm_worker import BLOCKS, dense_caches, results

from rd2h.vllm.config import ConnectorConfig
from rd2h.vllm.handoff import ask_fields
from rd2h.vllm.handoff_net import HandoffAsker
from rd2h.vllm.metadata import HoldSpec, RecvSpec, StepMetadata
from rd2h.vllm.worker import RD2HWorker

SECRET = "rd2h-unit-test-secret-0123456789"
EXT = "ab" * 16


@pytest.fixture
def pair(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Iterator[tuple]:
    monkeypatch.setenv("RD2H_SECRET", SECRET)
    hold = getattr(request, "param", 60.0)
    config = ConnectorConfig.from_extra({"kv_port": free_base_port(2), "handoff_port": free_base_port(1),
                                         "hold_timeout": hold, "request_timeout": 30})
    src, dst = dense_caches(True), dense_caches(False)
    decode = RD2HWorker(config, consumer=True, producer=False, rank=0, tp_size=1, dp_rank=0, block_sizes=[32])
    prefill = RD2HWorker(config, consumer=False, producer=True, rank=0, tp_size=1, dp_rank=0, block_sizes=[32])
    try:
        decode.register(dst, {n: BLOCKS for n in dst})
        prefill.register(src, {n: BLOCKS for n in src})
        yield prefill, decode, src, dst, config
    finally:
        prefill.close()
        decode.close()


def test_an_asked_hold_announces_every_layer_into_decodes_blocks(pair: tuple) -> None:
    prefill, decode, src, dst, config = pair
    # the step after vLLM finished the request (max_tokens=1): nothing computes, the blocks are held
    prefill.bind(StepMetadata(hold=(HoldSpec(EXT, "p-req", ((0, 1, 2),), 80),), idle=True))
    assert prefill.transfer_results() == (set(), set(), set())  # not asked: still held
    decode.bind(StepMetadata(recv=(RecvSpec(EXT, "d-req", ((9, 3, 12),), 1, 80),)))  # block 9: its prefix hit
    asker = HandoffAsker(timeout=10)
    try:
        body = ask_fields(SECRET.encode(), EXT, f"127.0.0.1:{config.kv_port}/1", 1, 80, time.time())
        asker.submit(EXT, [prefill.handoff.address], body)
        assert asker.wait(10) and asker.results() == [(EXT, None)]
    finally:
        asker.close()
    assert results(prefill, decode) == ({"p-req"}, {"d-req"}, set())  # Prefill frees it once Decode read it
    for name in src:
        assert torch.equal(dst[name][[3, 12]], src[name][[1, 2]])
        assert not dst[name][9].any()  # Decode's own prefix: not written
    stats = prefill.stats()
    assert stats is not None and stats.data["sent"] == 1


def test_an_idle_step_with_a_hold_waits_for_an_ask_instead_of_spinning(pair: tuple) -> None:
    prefill, *_ = pair
    prefill.bind(StepMetadata(hold=(HoldSpec(EXT, "p-req", ((0, 1, 2),), 80),), idle=True))
    started = time.monotonic()
    for _ in range(5):
        prefill.transfer_results()
    assert time.monotonic() - started >= 0.04  # five idle steps of about 10 ms, not five spins


@pytest.mark.parametrize("pair", [0.2], indirect=True)
def test_a_hold_nobody_asks_for_is_freed_and_counted(pair: tuple) -> None:
    prefill, *_ = pair
    prefill.bind(StepMetadata(hold=(HoldSpec(EXT, "p-req", ((0, 1, 2),), 80),), idle=True))
    tick, deadline = threading.Event(), time.monotonic() + 10
    freed: set[str] = set()
    while not freed:
        assert time.monotonic() < deadline
        freed |= prefill.transfer_results()[0]
        tick.wait(0.02)
    assert freed == {"p-req"}
    stats = prefill.stats()
    assert stats is not None and stats.data["local"] == {"hold_expired": 1}
