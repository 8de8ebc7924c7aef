"""The zmq dialer and a Decode that does not read, on real sockets: a send never waits for it,
the frames to every other Decode (and their replies) flow meanwhile, what waits keeps its
order, and only that Decode's connection fails once a frame waited ``send_timeout``."""

from __future__ import annotations

import os
import select
import socket
import threading
from collections.abc import Callable
from typing import TypeVar

import pytest
from rd2h_zmq import ZmqChannel, ZmqDialer

from rd2h.errors import ChannelError
from rd2h.testing.channel_suite import free_tcp_address

T = TypeVar("T")
ARRIVAL = 10.0  # a bound for what arrives at once, far below the 60 s send_timeout below
PATIENT = 60.0  # a send_timeout no test waits out: were a send to wait for a Decode, it would


def fill(dialer: ZmqDialer, address: str, frame: Callable[[int], bytes], at_least: int = 1) -> list[bytes]:
    """Send ``frame(i)`` to ``address`` (which reads nothing) until ``at_least`` frames wait in
    its outbox (libzmq's queues and the kernel's buffers are full); the frames sent."""
    sent: list[bytes] = []
    while dialer.waiting(address) < at_least:
        assert len(sent) < 2000, f"{address} took 2000 frames unread"
        sent.append(frame(len(sent)))
        dialer.send(address, sent[-1])
    return sent


def test_a_decode_that_does_not_read_delays_no_frame_to_another(closer: Callable[[T], T]) -> None:
    channel = ZmqChannel(high_water_mark=50, send_timeout=PATIENT)
    stuck = closer(channel.listen(free_tcp_address()))  # its loop never runs: it reads nothing
    live = closer(channel.listen(free_tcp_address()))
    dialer = closer(channel.dialer())
    filled = threading.Event()
    # on its own thread: the old dialer blocked here (holding its one lock) for send_timeout
    threading.Thread(
        target=lambda: (fill(dialer, stuck.address, lambda _: b"f" * (256 << 10), 20), filled.set()), daemon=True
    ).start()
    assert filled.wait(ARRIVAL), "a send to a Decode that does not read waited for it"
    peer = b""
    for i in range(200):  # each read as it comes (a burst over 2 x high_water_mark would fail it)
        dialer.send(live.address, b"layer %d" % i)
        got = live.recv(ARRIVAL)
        assert got is not None and got[1] == b"layer %d" % i
        peer = got[0]
    live.send(peer, b"reply")
    assert dialer.recv(ARRIVAL) == (live.address, b"reply")  # replies are read meanwhile too
    dialer.disconnect(live.address)  # and another connection is closed without waiting
    assert dialer.waiting(stuck.address)  # frames waited for the stuck Decode all along


def test_frames_queued_behind_a_full_queue_keep_their_order(closer: Callable[[T], T]) -> None:
    channel = ZmqChannel(high_water_mark=20, send_timeout=PATIENT)
    listener = closer(channel.listen(free_tcp_address()))
    dialer = closer(channel.dialer())
    sent = fill(dialer, listener.address, lambda i: b"%06d|" % i + os.urandom(64 if i % 2 else 64 << 10), 10)
    sent += [b"%06d|after" % i for i in range(len(sent), len(sent) + 5)]
    for frame in sent[-5:]:
        dialer.send(listener.address, frame)
    got = [listener.recv(ARRIVAL) for _ in sent]  # the listener reads now: the outbox drains
    assert [item and item[1] for item in got] == sent
    assert dialer.waiting(listener.address) == 0


def hung_up(sock: socket.socket, within: float) -> bool:
    """Whether the other end closed or reset ``sock`` (what waits unread is not looked at)."""
    poller = select.poll()
    poller.register(sock, select.POLLRDHUP)
    return bool(poller.poll(within * 1000))


def test_only_the_decode_that_does_not_read_fails_after_send_timeout(closer: Callable[[T], T]) -> None:
    server = closer(socket.create_server(("127.0.0.1", 0)))  # accepts, never reads or answers
    server.settimeout(ARRIVAL)
    stuck = f"tcp://127.0.0.1:{server.getsockname()[1]}"
    channel = ZmqChannel(high_water_mark=5, send_timeout=2.0)
    live = closer(channel.listen(free_tcp_address()))
    dialer = closer(channel.dialer())
    dialer.send(live.address, b"before")
    first = live.recv(ARRIVAL)
    assert first is not None
    fill(dialer, stuck, lambda i: b"frame %d" % i)
    conn = closer(server.accept()[0])
    assert hung_up(conn, 30.0), "the connection to a Decode that does not read was never failed"
    with pytest.raises(ChannelError, match="took none"):
        dialer.send(stuck, b"after")  # the failure, reported once, to this endpoint's send
    dialer.send(live.address, b"after")  # the other endpoint: same connection, no error
    assert live.recv(ARRIVAL) == (first[0], b"after")
    dialer.send(stuck, b"again")  # the one after connects again
    again = closer(server.accept()[0])
    again.settimeout(ARRIVAL)
    assert again.recv(1) == b"\xff"  # a ZMTP greeting


class _ThenLock:
    """The dialer's table lock, which runs ``then`` once, the first time ``thread`` releases it:
    it puts another thread's call right where a lock hold ends (no sleeps, no timing)."""

    def __init__(self, thread: str, then: Callable[[], object]) -> None:
        self._lock, self._thread, self._then = threading.Lock(), thread, then
        self.ran = threading.Event()

    def __enter__(self) -> None:
        self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()
        if not self.ran.is_set() and threading.current_thread().name == self._thread:
            self.ran.set()
            self._then()


def test_a_disconnect_as_the_writer_fails_a_connection_drops_the_failure(closer: Callable[[T], T]) -> None:
    """The writer takes the connection out of the table and records its failure in one hold of
    the lock: a disconnect right after the connection left the table (before, the failure was
    recorded in a second hold, after it) leaves no failure behind for the next send."""
    server = closer(socket.create_server(("127.0.0.1", 0)))  # accepts, never reads or answers
    server.settimeout(ARRIVAL)
    stuck = f"tcp://127.0.0.1:{server.getsockname()[1]}"
    dialer = closer(ZmqChannel(high_water_mark=5, send_timeout=1.0).dialer())
    lock = _ThenLock("rd2h-zmq-writer", lambda: dialer.disconnect(stuck))
    dialer._lock = lock  # type: ignore[assignment]  # the writer takes it first when it fails the connection
    fill(dialer, stuck, lambda i: b"frame %d" % i)
    conn = closer(server.accept()[0])
    assert hung_up(conn, 30.0), "the connection to a Decode that does not read was never failed"
    assert lock.ran.is_set()
    dialer.send(stuck, b"again")  # disconnected: no failure left to raise, it connects again
    again = closer(server.accept()[0])
    again.settimeout(ARRIVAL)
    assert again.recv(1) == b"\xff"  # a ZMTP greeting


def test_a_decode_far_behind_but_reading_is_not_failed_for_a_burst(closer: Callable[[T], T]) -> None:
    """A burst of many more frames than high_water_mark (80 layers x a few steps) to a Decode that
    reads them later: all wait in order and arrive; only bytes past max_queued_bytes fail it."""
    channel = ZmqChannel(high_water_mark=5, send_timeout=PATIENT)
    slow = closer(channel.listen(free_tcp_address()))
    dialer = closer(channel.dialer())
    sent = fill(dialer, slow.address, lambda i: b"%06d" % i + b"f" * (256 << 10), 2)
    more = [b"%06d" % (len(sent) + i) for i in range(400)]  # 80 x high_water_mark frames more
    for frame in more:  # queued behind the waiting ones (a frame cap of 2 x high_water_mark failed it here)
        dialer.send(slow.address, frame)
    for expected in [*sent, *more]:  # the Decode reads at last: every frame, in order
        got = slow.recv(ARRIVAL)
        assert got is not None and got[1] == expected


def test_a_decode_past_max_queued_bytes_is_failed_at_once(closer: Callable[[T], T]) -> None:
    channel = ZmqChannel(high_water_mark=5, send_timeout=PATIENT, max_queued_bytes=4 << 20)
    stuck = closer(channel.listen(free_tcp_address()))
    dialer = closer(channel.dialer())
    fill(dialer, stuck.address, lambda _: b"f" * (256 << 10), 1)
    with pytest.raises(ChannelError, match="max_queued_bytes"):
        for _ in range(17):  # 4 MiB of 256 KiB frames, and one more
            dialer.send(stuck.address, b"f" * (256 << 10))
