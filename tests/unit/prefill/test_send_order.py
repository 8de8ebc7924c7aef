"""SendOrder: a tracker call's frames go out in its order, and a send that raises reports every
readiness of that endpoint not written (the raising one and those skipped after it), each the one
the tracker takes for its layer; written on the calling thread, or by a writer thread per endpoint
(a dialer with ``concurrent_send``), where a write blocked on one endpoint holds no other's and a
write that fails after a META_REQUIRED's resend was queued is not reported (the resend stands for
it). The threaded race is in tests/integration/test_source_send_order.py."""

from __future__ import annotations

import logging
import threading

import pytest

from rd2h.errors import ChannelError
from rd2h.interfaces import Dialer
from rd2h.prefill.send_order import SendOrder
from rd2h.prefill.send_tracker import RequestState, SendTracker
from rd2h.quiet_log import QuietLog
from rd2h.wire import protocol
from rd2h.wire.endpoint import DecodeEndpoint

META = b"META"
D0, D1 = DecodeEndpoint("127.0.0.1", 5600, 1), DecodeEndpoint("127.0.0.1", 5601, 1)
A0, A1 = D0.address(0), D1.address(0)
WAIT = 10.0  # a bound on each wait for an event, never a duration the test needs


class _Wire(Dialer):
    """Records what is written; the send of ``raise_on`` raises (the connection broke there). With
    ``threads`` it declares ``concurrent_send``; a send to ``stuck``, and the next send of ``hold``,
    then wait for ``go`` first (and raise after, with ``fail_held``)."""

    def __init__(self, threads: bool = False) -> None:
        self.concurrent_send = threads  # type: ignore[misc]
        self.written: list[bytes] = []
        self.to: list[str] = []
        self.raise_on: bytes | None = None
        self.stuck: str | None = None
        self.hold: bytes | None = None
        self.fail_held = False
        self.blocked, self.go = threading.Event(), threading.Event()
        self.cond = threading.Condition()

    def send(self, address: str, payload: bytes) -> None:
        if (address == self.stuck and not self.go.is_set()) or payload is self.hold:
            self.hold = None
            self.blocked.set()
            assert self.go.wait(WAIT), "the test never let the blocked write go"
            if self.fail_held:
                raise ChannelError("connection reset")
        if payload is self.raise_on:
            raise ChannelError("connection reset")
        with self.cond:
            self.written.append(payload)
            self.to.append(address)
            self.cond.notify_all()

    def recv(self, timeout: float) -> tuple[str, bytes] | None:
        return None

    def disconnect(self, address: str) -> None:
        pass


def _setup(threads: bool = False) -> tuple[SendTracker, _Wire, SendOrder, list[tuple[int, str]]]:
    tracker = SendTracker(
        rank=0, tp_size=1, meta_frame=META, layer_block_bytes=[(100, 10)] * 2, last_layer=1, block_size=4,
    )
    wire, released = _Wire(threads), []
    order = SendOrder(
        rank=0, dialer=wire, tracker=tracker, lock=threading.Condition(), clock=lambda: 0.0,
        quiet=QuietLog(logging.getLogger("test")), meta_frame=META,
        released=lambda effects: released.extend(effects.released),
    )
    return tracker, wire, order, released


@pytest.mark.parametrize("threads", [False, True], ids=["calling thread", "writer threads"])
def test_a_send_that_raises_reports_every_readiness_it_did_not_write_last_first(threads: bool) -> None:
    tracker, wire, order, released = _setup(threads)
    tracker.add_request("a", D0, main_block_ids=[1, 2], num_tokens=8, now=0.0)
    tracker.add_request("b", D0, main_block_ids=[3], num_tokens=4, now=0.0)
    step, _ = tracker.schedule({"a": 4}, 0.0)
    for layer in (0, 1):  # a's first chunk: X (l0), Y (l1)
        order.carry_out(tracker.announce(step, layer, f"l{layer}", 0.0)[1])
    step, _ = tracker.schedule({"b": 4}, 0.0)
    order.carry_out(tracker.announce(step, 0, "l0", 0.0)[1])  # b: Z (l0), while X is unanswered
    assert order.wait_written(WAIT)
    x, y, z = (f for f in wire.written if f is not META)
    wire.raise_on = y
    effects = order.feed(tracker.on_reply, A0, protocol.encode(protocol.ReadFailed.meta_required(0)))
    assert order.wait_written(WAIT)
    assert [f for _, _, f in effects.sends] == [META, x, y, z]  # the resend, in send order
    assert wire.written[4:6] == [META, x]  # y raised: y and z were not written, b's end was told
    assert not any(isinstance(protocol.decode(f), protocol.ReadReadyBatch) for f in wire.written[6:])
    assert tracker.in_flight(A0) == frozenset({0})  # only x awaits a reply; y and z left the tracker
    assert tracker.request_state("a") is RequestState.FAILING and tracker.request_state("b") is None
    outcome = tracker.take()["b"]  # z was b's only readiness: b failed at once, with the send's error
    assert isinstance(outcome.error, ChannelError)
    assert sorted(released) == [(0, A0), (1, A0)]  # the slots of y and z, once each


def test_a_write_blocked_on_one_endpoint_holds_no_write_to_another() -> None:
    tracker, wire, order, _ = _setup(threads=True)
    wire.stuck = A0
    tracker.add_request("a", D0, main_block_ids=[1], num_tokens=4, now=0.0)
    tracker.add_request("b", D1, main_block_ids=[2], num_tokens=4, now=0.0)
    step, _ = tracker.schedule({"a": 4, "b": 4}, 0.0)
    try:
        for layer in (0, 1):  # D0's frames come first in each call; carry_out does not wait for them
            order.carry_out(tracker.announce(step, layer, f"l{layer}", 0.0)[1])
        assert wire.blocked.wait(WAIT)
        with wire.cond:  # D1's mf_meta and both its readiness, while D0's first write still blocks
            assert wire.cond.wait_for(lambda: wire.to.count(A1) == 3, WAIT), wire.to
            assert A0 not in wire.to
    finally:
        wire.go.set()
    assert order.wait_written(WAIT)
    assert [p for p, a in zip(wire.written, wire.to) if a == A0][0] is META and wire.to.count(A0) == 3


def test_a_write_that_fails_after_a_resend_was_queued_behind_it_is_not_reported() -> None:
    """X's write blocks; Decode's META_REQUIRED queues (mf_meta, X) behind it; then X's write
    fails. The resend stands for X: reporting it would take the resent X out of the tracker (the
    last readiness of its layer there) and fail its request, though the resend is still to go."""
    tracker, wire, order, released = _setup(threads=True)
    tracker.add_request("a", D0, main_block_ids=[1, 2], num_tokens=8, now=0.0)
    step, _ = tracker.schedule({"a": 4}, 0.0)
    effects = tracker.announce(step, 0, "l0", 0.0)[1]
    x = effects.sends[-1][2]
    wire.hold, wire.fail_held = x, True
    order.carry_out(effects)  # the mf_meta is written; X's write blocks
    assert wire.blocked.wait(WAIT)
    resend = order.feed(tracker.on_reply, A0, protocol.encode(protocol.ReadFailed.meta_required(0)))
    assert [f for _, _, f in resend.sends] == [META, x] and order.backlog(A0) == 2
    wire.go.set()  # the held write of X fails; the resend (the same frame, written again) does not
    assert order.wait_written(WAIT)
    assert wire.written == [META, META, x]
    assert tracker.in_flight(A0) == frozenset({0})  # the resent X still awaits its reply
    assert tracker.request_state("a") is not RequestState.FAILING and released == []
