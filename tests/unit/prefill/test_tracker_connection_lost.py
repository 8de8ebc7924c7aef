"""SendTracker.connection_lost (pure): the channel dropped a Decode's connection with the frames
that waited for it, and no send to it raised. Every readiness in flight there is lost: its
requests fail at once with the channel's error (not at reply_timeout), their slots are released,
other endpoints' requests go on, and the next readiness there goes after an mf_meta, with
replies before its ACK dropped as stale."""

from __future__ import annotations

from typing import Any

from rd2h.errors import ChannelError
from rd2h.outcome import TerminalState
from rd2h.prefill.send_tracker import EndpointState, RequestState, SendTracker
from rd2h.wire import protocol
from rd2h.wire.endpoint import DecodeEndpoint

META = b"META"
D0 = DecodeEndpoint("127.0.0.1", 5600, 1)
D1 = DecodeEndpoint("127.0.0.1", 5700, 1)
A0, A1 = D0.address(0), D1.address(0)
TIMEOUT = 60.0
LOST = ChannelError("cannot send to A0: it took no bytes of a frame for 0.5 s")


def _tracker(**kw: Any) -> SendTracker:
    return SendTracker(
        rank=0, tp_size=1, meta_frame=META, layer_block_bytes=[(100, 10)] * 3, last_layer=2, block_size=4,
        reply_timeout=TIMEOUT, **kw,
    )


def _done(layer: int) -> bytes:
    return protocol.encode(protocol.ReadDone(layer))


def _announce_all(t: SendTracker, step: Any, now: float) -> list[tuple[str, int, bytes]]:
    sends = []
    for layer in range(3):
        sends += t.announce(step, layer, f"l{layer}", now)[1].sends
    return sends


def test_the_requests_in_flight_there_fail_at_once_and_the_other_endpoints_go_on() -> None:
    t = _tracker()
    t.add_request("stuck", D0, main_block_ids=[1], num_tokens=4, now=0.0)
    t.add_request("live", D1, main_block_ids=[2], num_tokens=4, now=0.0)
    step, _ = t.schedule({"stuck": 4, "live": 4}, 0.0)
    _announce_all(t, step, 1.0)
    t.on_reply(A0, protocol.ACK_FRAME, 1.0)
    t.on_reply(A0, _done(0), 1.0)  # Decode read layer 0, then stopped: layers 1 and 2 are lost
    effects = t.connection_lost(A0, LOST, 2.0)  # long before reply_timeout
    assert sorted(effects.released) == [(1, A0), (2, A0)]  # each lost readiness's slots, once
    assert effects.sends == [] and effects.disconnects == []  # the channel dropped it already
    outcome = t.take()["stuck"]  # settled now: nothing in flight names it any more
    assert outcome.state is TerminalState.FAILED and outcome.error is LOST
    assert t.in_flight(A0) == frozenset() and t.endpoint_state(A0) is EndpointState.REVIVED
    assert t.request_state("live") is RequestState.FINAL and t.in_flight(A1) == frozenset({0, 1, 2})
    for layer in range(3):
        t.on_reply(A1, _done(layer), 3.0)
    assert t.take()["live"].ok
    assert t.expire(TIMEOUT + 10.0).disconnects == []  # nothing was left to time out


def test_the_next_readiness_goes_after_an_mf_meta_and_a_late_reply_to_a_lost_one_is_stale() -> None:
    t = _tracker()
    t.add_request("old", D0, main_block_ids=[1], num_tokens=4, now=0.0)
    step, _ = t.schedule({"old": 4}, 0.0)
    _announce_all(t, step, 1.0)
    t.on_reply(A0, protocol.ACK_FRAME, 1.0)
    t.connection_lost(A0, LOST, 2.0)
    assert t.take()["old"].state is TerminalState.FAILED
    t.add_request("new", D0, main_block_ids=[2], num_tokens=4, now=3.0)
    step, _ = t.schedule({"new": 4}, 3.0)
    sends = _announce_all(t, step, 3.0)
    assert sends[0] == (A0, 0, META) and [layer for _, layer, f in sends if f is not META] == [0, 1, 2]
    assert t.on_reply(A0, _done(0), 3.0).released == []  # Decode read a lost readiness and answers it late
    assert t.counters["stale"] == 1 and t.unanswered("new") == 3
    t.on_reply(A0, protocol.ACK_FRAME, 4.0)  # the new mf_meta's ACK: what follows answers "new"
    for layer in range(3):
        t.on_reply(A0, _done(layer), 4.0)
    assert t.take()["new"].ok


def test_an_unknown_or_silent_endpoint_or_one_with_nothing_in_flight_loses_no_request() -> None:
    t = _tracker()
    assert t.connection_lost(A0, LOST, 0.0).released == []  # never named
    t.add_request("r", D0, main_block_ids=[1], num_tokens=4, now=0.0)
    step, _ = t.schedule({"r": 4}, 0.0)
    t.announce(step, 0, "l0", 1.0)
    t.on_reply(A0, protocol.ACK_FRAME, 1.0)
    t.on_reply(A0, _done(0), 1.0)
    assert t.connection_lost(A0, LOST, 2.0).released == []  # what it had was read and answered
    assert t.request_state("r") is RequestState.ACTIVE and t.endpoint_state(A0) is EndpointState.REVIVED
    t.announce(step, 1, "l1", 3.0)
    t.expire(3.0 + TIMEOUT + 1.0)  # it falls silent: the request fails with ReplyTimeout
    assert t.endpoint_state(A0) is EndpointState.SILENT
    assert t.connection_lost(A0, LOST, 70.0).released == []  # a notice's connection: it stays silent
    assert t.endpoint_state(A0) is EndpointState.SILENT
    assert t.take()["r"].error is not LOST


def test_an_endpoint_revived_with_readiness_left_in_flight_times_out_and_never_raises() -> None:
    """Found by the state machine: a revived endpoint whose resend of one layer failed (REVIVED
    again) still has the other layers in flight; past reply_timeout it goes silent and its request
    fails, where ``expire`` raised StateError (TIMEOUT was illegal in REVIVED)."""
    t = _tracker()
    t.add_request("a", D0, main_block_ids=[1], num_tokens=4, now=0.0)
    t.connection_lost(A0, LOST, 0.0)  # nothing in flight yet: REVIVED, the next readiness after an mf_meta
    step, _ = t.schedule({"a": 4}, 0.0)
    _announce_all(t, step, 1.0)
    t.send_failed(A0, 0, ChannelError("reset"), 1.0)  # layer 0's readiness did not go
    assert t.endpoint_state(A0) is EndpointState.REVIVED and t.in_flight(A0) == frozenset({1, 2})
    effects = t.expire(1.0 + TIMEOUT + 1)
    assert effects.disconnects == [A0] and t.endpoint_state(A0) is EndpointState.SILENT
    assert t.take()["a"].state is TerminalState.FAILED
