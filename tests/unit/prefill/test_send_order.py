"""SendOrder: a tracker call's frames go out in its order, and a send that raises reports every
readiness of that endpoint not written (the raising one and those skipped after it), each the one
the tracker takes for its layer. One thread; the threaded race is in
tests/integration/test_source_send_order.py."""

from __future__ import annotations

import logging
import threading

from rd2h.errors import ChannelError
from rd2h.interfaces import Dialer
from rd2h.prefill.send_order import SendOrder
from rd2h.prefill.send_tracker import RequestState, SendTracker
from rd2h.quiet_log import QuietLog
from rd2h.wire import protocol
from rd2h.wire.endpoint import DecodeEndpoint

META = b"META"
D0 = DecodeEndpoint("127.0.0.1", 5600, 1)
A0 = D0.address(0)


class _Wire(Dialer):
    """Records what is written; the send of ``raise_on`` raises (the connection broke there)."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.raise_on: bytes | None = None

    def send(self, address: str, payload: bytes) -> None:
        if payload is self.raise_on:
            raise ChannelError("connection reset")
        self.written.append(payload)

    def recv(self, timeout: float) -> tuple[str, bytes] | None:
        return None

    def disconnect(self, address: str) -> None:
        pass


def _setup() -> tuple[SendTracker, _Wire, SendOrder, list[tuple[int, str]]]:
    tracker = SendTracker(
        rank=0, tp_size=1, meta_frame=META, layer_block_bytes=[(100, 10)] * 2, last_layer=1, block_size=4,
    )
    wire, released = _Wire(), []
    order = SendOrder(
        rank=0, dialer=wire, tracker=tracker, lock=threading.Condition(), clock=lambda: 0.0,
        quiet=QuietLog(logging.getLogger("test")), meta_frame=META,
        released=lambda effects: released.extend(effects.released),
    )
    return tracker, wire, order, released


def test_a_send_that_raises_reports_every_readiness_it_did_not_write_last_first() -> None:
    tracker, wire, order, released = _setup()
    tracker.add_request("a", D0, main_block_ids=[1, 2], num_tokens=8, now=0.0)
    tracker.add_request("b", D0, main_block_ids=[3], num_tokens=4, now=0.0)
    step, _ = tracker.schedule({"a": 4}, 0.0)
    for layer in (0, 1):  # a's first chunk: X (l0), Y (l1)
        order.carry_out(tracker.announce(step, layer, f"l{layer}", 0.0)[1])
    step, _ = tracker.schedule({"b": 4}, 0.0)
    order.carry_out(tracker.announce(step, 0, "l0", 0.0)[1])  # b: Z (l0), while X is unanswered
    x, y, z = (f for f in wire.written if f is not META)
    wire.raise_on = y
    effects = order.feed(tracker.on_reply, A0, protocol.encode(protocol.ReadFailed.meta_required(0)))
    assert [f for _, _, f in effects.sends] == [META, x, y, z]  # the resend, in send order
    assert wire.written[4:6] == [META, x]  # y raised: y and z were not written, b's end was told
    assert not any(isinstance(protocol.decode(f), protocol.ReadReadyBatch) for f in wire.written[6:])
    assert tracker.in_flight(A0) == frozenset({0})  # only x awaits a reply; y and z left the tracker
    assert tracker.request_state("a") is RequestState.FAILING and tracker.request_state("b") is None
    outcome = tracker.take()["b"]  # z was b's only readiness: b failed at once, with the send's error
    assert isinstance(outcome.error, ChannelError)
    assert sorted(released) == [(0, A0), (1, A0)]  # the slots of y and z, once each
