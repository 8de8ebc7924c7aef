"""Issue 19, item 7 (pure part): the send tracker forgets Decode endpoints no request uses,
after an idle time or, over a count, least recently used first; never one in use; a forgotten
endpoint named again is introduced again, and one abandoned while silent keeps dropping the
old connection's replies as stale."""

from __future__ import annotations

from typing import Any

import pytest

from rd2h.errors import ConfigError
from rd2h.prefill.endpoint_book import EndpointBook
from rd2h.prefill.send_tracker import EndpointState, SendTracker
from rd2h.wire import protocol
from rd2h.wire.endpoint import DecodeEndpoint

META = b"META"
TIMEOUT = 5.0
IDLE = 60.0


def tracker(**kw: Any) -> SendTracker:
    args: dict[str, Any] = dict(
        rank=0, tp_size=1, meta_frame=META, layer_block_bytes=[(100, 10)], last_layer=0, block_size=4,
        reply_timeout=TIMEOUT, endpoint_idle_seconds=IDLE, max_endpoints=2,
    )
    args.update(kw)
    return SendTracker(**args)


def decode(i: int) -> DecodeEndpoint:
    return DecodeEndpoint("127.0.0.1", 6000 + i, 1)


def serve(t: SendTracker, ext_id: str, i: int, now: float, *, answer: bool = True) -> list[tuple[str, int, bytes]]:
    """One request to Decode ``i``, its one layer announced and (``answer``) acknowledged and read."""
    t.add_request(ext_id, decode(i), main_block_ids=[1], num_tokens=4, now=now)
    step, _ = t.schedule({ext_id: 4}, now)
    sends = t.announce(step, 0, "l0", now)[1].sends
    if answer:
        address = decode(i).address(0)
        t.on_reply(address, protocol.ACK_FRAME, now)
        t.on_reply(address, protocol.encode(protocol.ReadDone(0)), now)
        assert t.take()[ext_id].ok
    return sends


def test_unused_endpoints_go_after_the_idle_time_and_over_the_cap_least_recently_used_first() -> None:
    t = tracker(max_endpoints=3)
    for i in range(6):
        serve(t, f"r{i}", i, now=float(i))
    assert t.endpoints() == 6
    assert t.expire(TIMEOUT + 0.5).forgotten == [decode(0).address(0)]  # only r0's is past the grace
    forgotten = t.expire(5.0 + TIMEOUT).forgotten  # every one past the grace, down to the cap
    assert forgotten == [decode(1).address(0), decode(2).address(0)] and t.endpoints() == 3
    assert t.expire(5.0 + IDLE - 0.1).forgotten == [decode(3).address(0), decode(4).address(0)]
    assert t.expire(5.0 + IDLE).forgotten == [decode(5).address(0)] and t.endpoints() == 0


def test_an_endpoint_in_use_is_never_forgotten() -> None:
    """Named by a live request (not yet announced), or owing a reply: kept past every bound;
    the least recently used one that is unused goes instead."""
    t = tracker(max_endpoints=1)
    t.add_request("waiting", decode(0), main_block_ids=[1], num_tokens=4, now=0.0)  # named, never sent
    serve(t, "owed", 1, now=0.0, answer=False)  # readiness in flight
    serve(t, "done", 2, now=1.0)
    forgotten = t.expire(1.0 + TIMEOUT).forgotten  # "owed" times out in this call: forgotten next time
    assert forgotten == [decode(2).address(0)]
    assert t.endpoint_state(decode(0).address(0)) is EndpointState.NEW
    assert t.endpoint_state(decode(1).address(0)) is EndpointState.SILENT
    assert t.expire(1000.0).forgotten == [decode(1).address(0)]  # its request failed: unused now
    assert t.endpoints() == 1 and t.request_state("waiting") is not None
    t.abort("waiting", 1000.0)
    assert t.expire(2000.0).forgotten == [decode(0).address(0)] and t.endpoints() == 0


def test_a_forgotten_endpoint_named_again_is_introduced_again() -> None:
    t = tracker()
    serve(t, "a", 0, now=0.0)
    assert t.expire(IDLE).forgotten == [decode(0).address(0)]
    sends = serve(t, "b", 0, now=IDLE + 1)
    assert [frame for _, _, frame in sends][0] == META  # a new connection: mf_meta first


def test_a_silent_endpoint_forgotten_and_named_again_drops_the_old_connections_replies() -> None:
    """Abandoned Decodes are the ones that go quiet for good, so they are forgotten too; one
    that was only stopped may still answer the abandoned readiness on the new connection
    (the dialer keeps its identity). It comes back revived: replies before the ACK are stale."""
    t = tracker()
    address = decode(0).address(0)
    serve(t, "old", 0, now=0.0, answer=False)
    t.expire(TIMEOUT + 1)  # silent: "old" fails
    assert t.take()["old"].error is not None
    assert t.expire(IDLE + 1).forgotten == [address] and t.endpoints() == 0
    serve(t, "new", 0, now=IDLE + 2, answer=False)
    assert t.endpoint_state(address) is EndpointState.REINTRODUCED
    assert t.on_reply(address, protocol.encode(protocol.ReadDone(0)), IDLE + 3).ignored == "stale"
    assert t.unanswered("new") == 1  # the old readiness's answer did not answer the new one
    t.on_reply(address, protocol.ACK_FRAME, IDLE + 3)
    t.on_reply(address, protocol.encode(protocol.ReadDone(0)), IDLE + 3)
    assert t.take()["new"].ok


def test_the_memory_of_abandoned_addresses_is_bounded_too() -> None:
    book = EndpointBook(idle_seconds=10.0, max_endpoints=2, grace_seconds=1.0)
    for i in range(5):
        record = book.named(f"tcp://h:{i}", float(i))
        record.state = EndpointState.SILENT
        book.released(f"tcp://h:{i}")
    assert len(book.forget_unused(100.0)) == 5 and len(book) == 0
    # the two most recent are remembered as abandoned; the oldest fell out of the memory
    assert book.named("tcp://h:4", 101.0).state is EndpointState.SILENT
    assert book.named("tcp://h:0", 101.0).state is EndpointState.NEW


@pytest.mark.parametrize(
    "options, name",
    [({"endpoint_idle_seconds": 0}, "endpoint_idle_seconds"), ({"max_endpoints": 0}, "max_endpoints")],
)
def test_bad_bounds_are_refused_by_name(options: dict[str, Any], name: str) -> None:
    with pytest.raises(ConfigError, match=name):
        tracker(**options)
