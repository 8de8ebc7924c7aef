"""A slow (not dead) Decode is abandoned, then revived by a new request: the request it held
ends FAILED on Prefill and never DONE on Decode, and the slow Decode's late answers to the
abandoned readiness cannot stand in for the new request's. Synchronised on events and a
manual clock: nothing sleeps."""

from __future__ import annotations

import threading

import numpy as np
from layers import layer_tensors
from prefill_kit import BLOCK, MemoryNamed, memory_listener, memory_source

from rd2h import plugins
from rd2h.clock import ManualClock
from rd2h.decode.sink import LayerStat, Sink
from rd2h.errors import ReplyTimeout
from rd2h.outcome import TerminalState
from rd2h.tensors import layer_layout
from rd2h.wire import protocol
from rd2h.wire.endpoint import DecodeEndpoint


def _last_readiness(frames: list[bytes]) -> int | None:
    message = protocol.decode_request(frames[-1]) if frames else None
    return message.layer_idx if isinstance(message, protocol.ReadReadyBatch) else None


def test_revived_endpoint_does_not_complete_a_request_with_a_missing_layer(kv_port: int) -> None:
    names = [f"l{i}" for i in range(4)]
    src = {n: layer_tensors(True, i) for i, n in enumerate(names)}
    dst = {n: layer_tensors(False) for n in names}
    stalled, resume = threading.Event(), threading.Event()

    def on_layer(stat: LayerStat) -> None:  # Decode stalls once, after answering l0 (GC pause, slow read...)
        if not stalled.is_set():
            stalled.set()
            resume.wait(30)

    sink = Sink(rank=0, tp_size=1, engine=plugins.load_engine("local", "decode"), listener=memory_listener(kv_port),
                layers={n: layer_layout(t) for n, t in dst.items()}, on_layer=on_layer)
    endpoint = DecodeEndpoint("127.0.0.1", kv_port, 1)
    sink.expect("r", [5, 6])
    sink.expect("r2", [7])
    clock, dialer = ManualClock(), MemoryNamed()
    try:
        with sink.start(), memory_source(src, clock, dialer, reply_timeout=5.0) as source:
            source.add_request("r", endpoint, main_block_ids=[1, 2], num_tokens=2 * BLOCK)
            source.schedule({"r": 2 * BLOCK})
            for name in ("l0", "l1"):
                source.layer_ready(name)
            assert stalled.wait(10)  # l0 answered; l1 waits in the stalled Decode
            clock.advance(6.0)  # l1 unanswered past reply_timeout: the endpoint is abandoned
            source.wait_for_layer_send("l1", timeout=10)  # released, without an error
            outcome = source.wait_finished(["r"], 10)["r"]
            assert outcome.state is TerminalState.FAILED and isinstance(outcome.error, ReplyTimeout)
            source.layer_ready("l2")  # r is announced no more
            source.add_request("r2", endpoint, main_block_ids=[3], num_tokens=BLOCK)  # revives the endpoint
            source.schedule({"r2": BLOCK})
            for name in names:
                source.wait_for_layer_send(name, timeout=10)
                source.layer_ready(name)
            assert dialer.wait_sent(lambda frames: _last_readiness(frames) == 3)  # all of r2 is out
            resume.set()  # the slow Decode answers l1 of r first: stale, then r2's layers
            assert source.wait_finished(["r2"], 10)["r2"].ok
            assert sink.wait(["r2"], 10)["r2"].ok
            assert source.counters["stale"] == 1
            decode = sink.wait(["r"], 10)["r"]  # never DONE: Prefill told it the request failed
            assert decode.state is TerminalState.FAILED and isinstance(decode.error, ReplyTimeout)
    finally:
        resume.set()
    for name in names:
        assert np.array_equal(dst[name].main[0][7], src[name].main[0][3])
    assert not dst["l2"].main[0][[5, 6]].any() and not dst["l3"].main[0][[5, 6]].any()
