"""Issue 19, item 3, on real loopback sockets: a listener's connections that carry no
admitted peer are bounded, an admitted peer's connection is never shut.

Before (cdf2a2f^), every connection cost the listener an fd for as long as its peer kept it:
nothing watched them (``connections()`` and ``vouch`` did not exist).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from rd2h.errors import ConfigError
from rd2h_zmq import ZmqChannel, ZmqListener

BOUND = 8
WAIT = 30.0


@pytest.fixture
def context() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture
def listener() -> Iterator[ZmqListener]:
    lst = ZmqChannel(max_unadmitted_connections=BOUND).listen("tcp://127.0.0.1:0")
    yield lst
    lst.close()


def dealer(context: zmq.Context[zmq.Socket[bytes]], address: str, routing_id: bytes | None = None) -> zmq.Socket[bytes]:
    sock = context.socket(zmq.DEALER)
    sock.linger = 0
    if routing_id is not None:
        sock.routing_id = routing_id
    sock.connect(address)
    return sock


def serve_until(listener: ZmqListener, done: Callable[[], bool], on_message: Callable[[bytes, bytes], Any] = print) -> None:
    """Run the listener's loop (as Decode's does) until ``done()``, at most WAIT seconds."""
    deadline = time.monotonic() + WAIT
    while not done():
        assert time.monotonic() < deadline, listener.connections()
        item = listener.recv(0.02)
        if item is not None:
            on_message(*item)


def introduce(listener: ZmqListener, sock: zmq.Socket[bytes]) -> bytes:
    """``sock`` speaks; the listener hears it and Decode admits (vouches for) it."""
    sock.send(b"hello")
    got: list[bytes] = []
    serve_until(listener, lambda: bool(got), lambda peer, payload: got.append(peer))
    listener.vouch(got[0])
    return got[0]


def disconnects(sock: zmq.Socket[bytes]) -> zmq.Socket[bytes]:
    return sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)


def was_disconnected(monitor: zmq.Socket[bytes]) -> bool:
    while monitor.poll(0):
        if recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED:
            return True
    return False


def unadmitted(listener: ZmqListener) -> int:
    counts = listener.connections()
    return counts["disowned"] + counts["silent"] + counts["undecided"]


def test_the_bound_is_validated() -> None:
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ConfigError, match="max_unadmitted_connections"):
            ZmqChannel(max_unadmitted_connections=bad)


def test_silent_connections_past_the_bound_are_shut_and_an_admitted_one_stays(
    listener: ZmqListener, context: zmq.Context[zmq.Socket[bytes]]
) -> None:
    """40 connections that never send anything: the listener keeps BOUND of them (each shut
    one reconnects by itself and is shut again); the admitted peer's connection is never
    shut and its messages still come through."""
    good = dealer(context, listener.address)
    watch_good = disconnects(good)
    peer = introduce(listener, good)
    silent = [dealer(context, listener.address) for _ in range(40)]
    serve_until(listener, lambda: listener.connections_closed >= 40 - BOUND)
    assert unadmitted(listener) <= BOUND
    assert listener.connections()["vouched"] == 1
    good.send(b"still here")
    heard: list[tuple[bytes, bytes]] = []
    serve_until(listener, lambda: bool(heard), lambda p, m: heard.append((p, m)))
    assert heard == [(peer, b"still here")]
    listener.send(peer, b"reply")
    assert good.poll(int(WAIT * 1000)) and good.recv_multipart()[-1] == b"reply"
    assert not was_disconnected(watch_good)
    good.disable_monitor()
    watch_good.close()
    for sock in silent:
        sock.close()


def test_a_refused_peer_is_shut_first(listener: ZmqListener, context: zmq.Context[zmq.Socket[bytes]]) -> None:
    """Decode disowns a refused peer: past the soft bound (a quarter) its connection goes at
    once, while connections that may still be introducing themselves stay."""
    refused = dealer(context, listener.address)
    watch_refused = disconnects(refused)
    peer = introduce(listener, refused)
    speaking = [dealer(context, listener.address) for _ in range(BOUND // 4)]
    for sock in speaking:
        sock.send(b"mf_meta")
    heard: list[bytes] = []
    serve_until(listener, lambda: len(heard) == len(speaking), lambda p, m: heard.append(p))
    listener.disown(peer)
    serve_until(listener, lambda: listener.connections_closed >= 1)
    deadline = time.monotonic() + WAIT
    while not was_disconnected(watch_refused):
        assert time.monotonic() < deadline
        watch_refused.poll(100)
    assert listener.connections()["undecided"] == len(speaking)
    refused.disable_monitor()
    watch_refused.close()


def test_a_reconnection_with_the_same_identity_leaves_no_connection_behind(
    listener: ZmqListener, context: zmq.Context[zmq.Socket[bytes]]
) -> None:
    """With ROUTER_HANDOVER a DEALER that comes back with its routing id takes it over, but
    libzmq keeps the old connection open and unroutable: it is shut first, the new one
    carries the admitted peer."""
    old = dealer(context, listener.address, b"prefill-1")
    watch_old = disconnects(old)
    peer = introduce(listener, old)
    new = dealer(context, listener.address, b"prefill-1")
    new.send(b"again")
    serve_until(listener, lambda: listener.connections().get("disowned", 0) == 1)
    others = [dealer(context, listener.address) for _ in range(BOUND)]
    serve_until(listener, lambda: was_disconnected(watch_old))
    listener.send(peer, b"to the new one")
    assert new.poll(int(WAIT * 1000)) and new.recv_multipart()[-1] == b"to the new one"
    old.disable_monitor()
    watch_old.close()
    for sock in others:
        sock.close()


def test_a_flood_from_one_host_never_shuts_another_hosts_connection(
    listener: ZmqListener, context: zmq.Context[zmq.Socket[bytes]]
) -> None:
    """The host holding the most connections pays: 40 silent connections from 127.0.0.2
    leave the one from 127.0.0.1 open, although it is older and as silent."""
    port = listener.address.rsplit(":", 1)[1]
    lonely = dealer(context, listener.address)
    watch_lonely = disconnects(lonely)
    serve_until(listener, lambda: listener.connections().get("silent", 0) == 1)
    flood = [dealer(context, f"tcp://127.0.0.2:0;127.0.0.1:{port}") for _ in range(40)]
    serve_until(listener, lambda: listener.connections_closed >= 40 - BOUND)
    assert not was_disconnected(watch_lonely)
    lonely.disable_monitor()
    watch_lonely.close()
    for sock in flood:
        sock.close()
