"""Faults over real processes and sockets: each side killed, stopped, restarted or cut off
between two layers, a missing contributor under unequal TP, a port in use.

Every rank is a child process (``harness.Rank``); Decode's destinations are shared memory the
test checks itself. What each scenario shows is in docs/reliability.md, with the times.
"""

from __future__ import annotations

import signal
import time

import pytest
from harness import ChildError, Cluster, Rank, Request, Shape, poll

pytestmark = pytest.mark.faults

REPLY_TIMEOUT = 1.5  # Prefill's bound on a silent Decode, short to keep the suite quick
SHAPE = Shape(layers=4)


def _req(ext_id: str, index: int, src: range, dst: range) -> Request:
    return Request(ext_id, index, tuple(src), tuple(dst))


def _serve_one(cluster: Cluster, decode: Rank, prefills: list[Rank], req: Request, timeout: float = 30.0) -> tuple[tuple, list[tuple]]:
    """Expect, add and send ``req`` whole; the outcomes on Decode and on each Prefill rank."""
    decode.call("expect", req)
    for p in prefills:
        p.call("add", req)
        p.call("schedule", {req.ext_id: req.tokens})
    for p in prefills:
        p.send("layers", 0, cluster.shape.layers)
    for p in prefills:
        p.result()
    return decode.call("wait", [req.ext_id], timeout)[req.ext_id], [
        p.call("wait", [req.ext_id], timeout)[req.ext_id] for p in prefills
    ]


def _start(decode: Rank, prefill: Rank, req: Request, layers: int) -> None:
    """Expect and add ``req``, announce its first ``layers`` layers and wait until Decode read them."""
    decode.call("expect", req)
    prefill.call("add", req)
    prefill.call("schedule", {req.ext_id: req.tokens})
    prefill.call("layers", 0, layers)
    poll(lambda: decode.call("layers_read") >= layers, 20, f"Decode reads {layers} layers")


def test_prefill_killed_mid_request_fails_it_on_decode_and_a_restarted_prefill_serves(kv_port: int) -> None:
    """Prefill SIGKILLed after 2 of 4 layers: Decode sees the process gone (pidfd, liveness
    cadence 0.5 s) and fails the request with PeerGoneError long before its deadline. A new
    Prefill process then serves the next request byte for byte."""
    with Cluster(SHAPE, kv_port) as cluster:
        decode = cluster.decode()
        prefill = cluster.prefill()
        cut = _req("cut", 1, range(5), range(10, 15))
        _start(decode, prefill, cut, 2)
        prefill.kill()
        started = time.monotonic()
        outcome = decode.call("wait", ["cut"], 20)["cut"]
        took = time.monotonic() - started
        assert outcome[:2] == ("failed", "PeerGoneError"), outcome
        assert took < 5, took  # the pidfd check runs every 0.5 s, not at the 300 s deadline
        assert cluster.written_outside(cut.dst) == 0
        cluster.zero()
        restarted = cluster.prefill()
        nxt = _req("next", 2, range(20, 26), range(30, 36))
        on_decode, on_prefill = _serve_one(cluster, decode, [restarted], nxt)
        assert on_decode[0] == "done" and on_prefill[0][0] == "done", (on_decode, on_prefill)
        assert cluster.arrived(nxt, [0]) == [] and cluster.written_outside(nxt.dst) == 0


def test_prefill_stopped_mid_request_fails_at_decodes_deadline_and_agrees_when_continued(kv_port: int) -> None:
    """Prefill SIGSTOPped after 2 of 4 layers: alive to the pidfd, silent on the wire. Decode
    fails the request at its deadline (DeadlineExceeded); continued, Prefill announces the
    rest and is told the request failed, so both sides say FAILED."""
    with Cluster(SHAPE, kv_port) as cluster:
        decode = cluster.decode()
        prefill = cluster.prefill()
        req = _req("r", 1, range(4), range(8, 12))
        decode.call("expect", req, deadline=2.0)
        prefill.call("add", req)
        prefill.call("schedule", {"r": req.tokens})
        prefill.call("layers", 0, 2)
        poll(lambda: decode.call("layers_read") >= 2, 20, "Decode reads 2 layers")
        prefill.signal(signal.SIGSTOP)
        prefill.wait_stopped()
        on_decode = decode.call("wait", ["r"], 20)["r"]
        assert on_decode[:2] == ("failed", "DeadlineExceeded"), on_decode
        prefill.signal(signal.SIGCONT)
        prefill.call("layers", 2, 4)
        on_prefill = prefill.call("wait", ["r"], 20)["r"]
        assert on_prefill[0] == "failed", on_prefill
        assert cluster.written_outside(req.dst) == 0


def test_decode_killed_mid_request_fails_it_on_prefill_and_a_restarted_decode_serves(kv_port: int) -> None:
    """Decode SIGKILLed after 1 of 4 layers: Prefill's gates are released and the request
    fails with ReplyTimeout once the oldest readiness went unanswered for reply_timeout. A
    Decode restarted on the same port is introduced again (mf_meta) on the next request."""
    with Cluster(SHAPE, kv_port) as cluster:
        decode = cluster.decode()
        prefill = cluster.prefill(reply_timeout=REPLY_TIMEOUT)
        req = _req("r", 1, range(4), range(8, 12))
        _start(decode, prefill, req, 1)
        decode.kill()
        started = time.monotonic()
        prefill.call("layers", 1, 4, gate=10.0)  # each layer its own slot: nothing blocks
        on_prefill = prefill.call("wait", ["r"], 20)["r"]
        took = time.monotonic() - started
        assert on_prefill[:2] == ("failed", "ReplyTimeout"), on_prefill
        assert took < REPLY_TIMEOUT + 3, took
        prefill.call("layers", 0, 4, gate=10.0)  # the slots were released: no GateTimeout
        cluster.zero()
        restarted = cluster.decode()
        nxt = _req("next", 2, range(10, 17), range(40, 47))
        on_decode, on_prefills = _serve_one(cluster, restarted, [prefill], nxt)
        assert on_decode[0] == "done" and on_prefills[0][0] == "done", (on_decode, on_prefills)
        assert cluster.arrived(nxt, [0]) == [] and cluster.written_outside(nxt.dst) == 0


def _stop_decode_while_prefill_gives_up(cluster: Cluster) -> tuple[Rank, Rank, Request, tuple, tuple]:
    decode = cluster.decode()
    prefill = cluster.prefill(reply_timeout=REPLY_TIMEOUT)
    req = _req("r", 1, range(4), range(8, 12))
    _start(decode, prefill, req, 1)
    decode.signal(signal.SIGSTOP)
    decode.wait_stopped()
    prefill.call("layers", 1, 4, gate=10.0)
    on_prefill = prefill.call("wait", ["r"], 20)["r"]
    decode.signal(signal.SIGCONT)
    on_decode = decode.call("wait", ["r"], 20)["r"]
    return decode, prefill, req, on_decode, on_prefill


def test_decode_stopped_mid_request_and_continued(kv_port: int) -> None:
    """Decode SIGSTOPped after 1 of 4 layers while Prefill announces the rest: Prefill fails
    the request with ReplyTimeout and releases its slots. Continued, Decode handles the
    readiness still queued in its socket; whatever it decides, no byte is wrong, and the next
    request goes through on a new connection (Prefill revives the endpoint)."""
    with Cluster(SHAPE, kv_port) as cluster:
        decode, prefill, req, on_decode, on_prefill = _stop_decode_while_prefill_gives_up(cluster)
        assert on_prefill[:2] == ("failed", "ReplyTimeout"), on_prefill
        if on_decode[0] == "done":
            assert cluster.arrived(req, [0]) == []
        assert cluster.written_outside(req.dst) == 0
        cluster.zero()
        nxt = _req("next", 2, range(10, 13), range(40, 43))
        on_decode, on_prefills = _serve_one(cluster, decode, [prefill], nxt)
        assert on_decode[0] == "done" and on_prefills[0][0] == "done", (on_decode, on_prefills)
        assert cluster.arrived(nxt, [0]) == []


def test_decode_stopped_mid_request_outcomes_agree(kv_port: int) -> None:
    """Issue 9 D9: Prefill gives up on the stopped Decode (ReplyTimeout); the continued Decode
    reads the readiness still queued in its socket, and its reply may be lost on the closing
    connection without an error. It must not end DONE: it waits for Prefill's word
    (``settled``), and Prefill tells it the request failed."""
    with Cluster(SHAPE, kv_port) as cluster:
        _, _, _, on_decode, on_prefill = _stop_decode_while_prefill_gives_up(cluster)
        assert on_prefill[:2] == ("failed", "ReplyTimeout"), on_prefill
        assert on_decode[0] == "failed", on_decode  # failed too: by the lost reply or Prefill's word


def test_decode_closes_its_socket_mid_request_and_binds_again(kv_port: int) -> None:
    """The connection cut from Decode's side: after 1 of 4 layers the sink closes (socket,
    sessions) and a new one binds the same port. The cut request fails on Decode ("closed").
    Prefill's next readiness reaches the new sink over libzmq's reconnection, which has no
    mf_meta for it: Prefill introduces itself again, repeats the readiness once, and is told
    the request is not expected there, so it fails on Prefill too, at once. The next request
    goes through on that connection."""
    with Cluster(SHAPE, kv_port) as cluster:
        decode = cluster.decode()
        prefill = cluster.prefill(reply_timeout=REPLY_TIMEOUT)
        req = _req("r", 1, range(4), range(8, 12))
        _start(decode, prefill, req, 1)
        on_decode = decode.call("reopen")
        assert on_decode["r"][:2] == ("failed", "RD2HError") and "closed" in on_decode["r"][2], on_decode
        prefill.call("layers", 1, 4, gate=10.0)
        on_prefill = prefill.call("wait", ["r"], 20)["r"]
        assert on_prefill[:2] == ("failed", "UnknownRequestError"), on_prefill  # answered, not timed out
        assert cluster.written_outside(req.dst) == 0
        cluster.zero()
        nxt = _req("next", 2, range(10, 13), range(40, 43))
        on_decode, on_prefills = _serve_one(cluster, decode, [prefill], nxt)
        assert on_decode[0] == "done" and on_prefills[0][0] == "done", (on_decode, on_prefills)
        assert cluster.arrived(nxt, [0]) == []


@pytest.mark.parametrize("killed", [0, 1], ids=["member-0-sends-main", "member-1-indexer-only"])
def test_a_missing_contributor_under_unequal_tp_fails_the_request_never_done(kv_port: int, killed: int) -> None:
    """Prefill TP 2 -> Decode TP 1: both Prefill ranks contribute to the one Decode rank. One
    is killed before its final layer while the other sends every layer: Decode fails the
    request (PeerGoneError), never DONE; the survivor's outcome is whatever Decode had
    decided when its final layer arrived, and the request as a whole (any rank failed) is
    FAILED on both sides."""
    with Cluster(SHAPE, kv_port) as cluster:
        decode = cluster.decode()
        prefills = [cluster.prefill(rank, tp=2) for rank in range(2)]
        req = _req("r", 1, range(6), range(20, 26))
        decode.call("expect", req)
        for p in prefills:
            p.call("add", req)
            p.call("schedule", {"r": req.tokens})
            p.call("layers", 0, 3)
        poll(lambda: decode.call("layers_read") >= 6, 20, "Decode reads 3 layers from both")
        prefills[killed].kill()
        survivor = prefills[1 - killed]
        survivor.call("layers", 3, 4)
        on_decode = decode.call("wait", ["r"], 20)["r"]
        assert on_decode[:2] == ("failed", "PeerGoneError"), on_decode
        on_survivor = survivor.call("wait", ["r"], 20)["r"]
        assert on_survivor[0] in ("done", "failed"), on_survivor
        assert cluster.written_outside(req.dst) == 0


def test_a_decode_port_in_use_is_refused_at_once(kv_port: int) -> None:
    """A second Decode process on a port another holds: PortInUseError at construction, in
    well under a second; the first keeps serving."""
    with Cluster(SHAPE, kv_port) as cluster:
        decode = cluster.decode()
        started = time.monotonic()
        with pytest.raises(ChildError) as info:
            cluster.decode()
        assert info.value.kind == "PortInUseError" and str(kv_port) in info.value.message
        assert time.monotonic() - started < 30  # a process start; the bind itself fails at once
        prefill = cluster.prefill()
        req = _req("r", 1, range(3), range(5, 8))
        on_decode, on_prefills = _serve_one(cluster, decode, [prefill], req)
        assert on_decode[0] == "done" and on_prefills[0][0] == "done"
        assert cluster.arrived(req, [0]) == []



def test_a_prefill_whose_first_contact_falls_in_a_decode_stop_is_failed_on_decode_as_it_continues(kv_port: int) -> None:
    """Issue 19, item 5: Decode is SIGSTOPped before Prefill ever reached it; Prefill announces
    every layer (its frames wait in its own socket: the stopped Decode never completed the
    connection's handshake), gives up after reply_timeout and drops them. Decode never heard
    of that Prefill, so it ignored the ``settled`` saying the request failed, and held the
    destinations until request_timeout (300 s by default; 18.6 s after SIGCONT measured
    with 20 s). Prefill now introduces itself (mf_meta) before that notice: continued,
    Decode admits it and fails the request at once, and the next request is DONE."""
    with Cluster(SHAPE, kv_port) as cluster:
        decode = cluster.decode()  # the default request_timeout: 300 s
        prefill = cluster.prefill(reply_timeout=REPLY_TIMEOUT)
        req = _req("r", 1, range(4), range(8, 12))
        decode.call("expect", req)
        decode.signal(signal.SIGSTOP)
        decode.wait_stopped()
        prefill.call("add", req)
        prefill.call("schedule", {"r": req.tokens})
        prefill.call("layers", 0, SHAPE.layers, gate=10.0)
        on_prefill = prefill.call("wait", ["r"], 20)["r"]
        assert on_prefill[:2] == ("failed", "ReplyTimeout"), on_prefill
        decode.signal(signal.SIGCONT)
        started = time.monotonic()
        on_decode = decode.call("wait", ["r"], 20)["r"]
        took = time.monotonic() - started
        assert on_decode[:2] == ("failed", "ReplyTimeout") and "did not reply" in on_decode[2], on_decode
        assert took < REPLY_TIMEOUT + 3, took  # a handshake, not request_timeout
        assert cluster.written_outside(req.dst) == 0 and cluster.written_outside([]) == 0
        nxt = _req("next", 2, range(10, 13), range(8, 11))  # r's destinations, free again
        on_decode, on_prefills = _serve_one(cluster, decode, [prefill], nxt)
        assert on_decode[0] == "done" and on_prefills[0][0] == "done", (on_decode, on_prefills)
        assert cluster.arrived(nxt, [0]) == []
