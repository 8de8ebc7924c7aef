"""The tcp dialer and a Decode that does not read, on real sockets: a send never waits for it,
the frames to every other Decode (and their replies) flow meanwhile, what waits keeps its
order, and only that Decode's connection fails once a frame waited ``send_timeout``."""

from __future__ import annotations

import itertools
import os
import select
import socket
import tempfile
import threading
from collections.abc import Callable
from typing import TypeVar

import pytest
from rd2h_tcp import TcpChannel
from rd2h_tcp.dialer import TcpDialer
from rd2h_tcp.framing import IDENTITY_BYTES, MAGIC, FrameReader

from rd2h.errors import ChannelError
from rd2h.testing.channel_suite import free_tcp_address

T = TypeVar("T")
ARRIVAL = 10.0  # a bound for what arrives at once, far below the 60 s send_timeout below
PATIENT = 60.0  # a send_timeout no test waits out: were a send to wait for a Decode, it would
MiB = 1 << 20
STUCK = 24 * MiB  # waiting in an outbox: more than any kernel buffer takes of it while nobody reads
_SEQ = itertools.count()


def ipc_address() -> str:
    return f"ipc://{tempfile.gettempdir()}/rd2h-tcp-slow-{os.getpid()}-{next(_SEQ)}.sock"


def fill(dialer: TcpDialer, address: str) -> None:
    """Send frames to ``address`` (which reads nothing) until more wait in its outbox than the
    kernel's buffers could take (4 MiB of send buffer at most here: wmem_max)."""
    for _ in range(100):
        dialer.send(address, b"f" * MiB)
        if dialer.waiting(address) >= STUCK:
            return
    raise AssertionError(f"{address} took 100 MiB unread")


@pytest.mark.parametrize("make_address", [free_tcp_address, ipc_address], ids=["tcp", "ipc"])
def test_a_decode_that_does_not_read_delays_no_frame_to_another(
    make_address: Callable[[], str], closer: Callable[[T], T]
) -> None:
    channel = TcpChannel(send_timeout=PATIENT)
    stuck = closer(channel.listen(make_address()))  # its loop never runs: it reads nothing
    live = closer(channel.listen(make_address()))
    dialer = closer(channel.dialer())
    filled = threading.Event()
    # on its own thread: the old dialer blocked here (holding its one lock) for send_timeout
    threading.Thread(target=lambda: (fill(dialer, stuck.address), filled.set()), daemon=True).start()
    assert filled.wait(ARRIVAL), "a send to a Decode that does not read waited for it"
    for i in range(200):
        dialer.send(live.address, b"layer %d" % i)
        assert dialer.waiting(stuck.address)  # still stuck while the other is served
    got = [live.recv(ARRIVAL) for _ in range(200)]
    assert [item and item[1] for item in got] == [b"layer %d" % i for i in range(200)]
    peer = got[0][0] if got[0] else b""
    live.send(peer, b"reply")
    assert dialer.recv(ARRIVAL) == (live.address, b"reply")  # replies are read meanwhile too
    dialer.disconnect(live.address)  # and another connection is closed without waiting
    assert dialer.waiting(stuck.address)


@pytest.mark.parametrize("make_address", [free_tcp_address, ipc_address], ids=["tcp", "ipc"])
def test_frames_queued_behind_a_full_socket_keep_their_order(
    make_address: Callable[[], str], closer: Callable[[T], T]
) -> None:
    channel = TcpChannel(send_timeout=PATIENT)
    listener = closer(channel.listen(make_address()))
    dialer = closer(channel.dialer())
    sent = [b"%06d|" % i + os.urandom(64 if i % 2 else MiB) for i in range(48)]  # 24 MiB: big, small, ...
    for frame in sent:
        dialer.send(listener.address, frame)
    assert dialer.waiting(listener.address) > 16 * MiB, "the socket took most: little was queued"
    got = [listener.recv(ARRIVAL) for _ in sent]  # the listener reads now: the outbox drains
    assert [item and item[1] for item in got] == sent
    assert dialer.waiting(listener.address) == 0


def hung_up(sock: socket.socket, within: float) -> bool:
    """Whether the other end closed or reset ``sock`` (what waits unread is not looked at)."""
    poller = select.poll()
    poller.register(sock, select.POLLRDHUP)
    return bool(poller.poll(within * 1000))


def test_only_the_decode_that_does_not_read_fails_after_send_timeout(closer: Callable[[T], T]) -> None:
    server = closer(socket.socket())
    server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)  # fills sooner
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(ARRIVAL)
    stuck = f"tcp://127.0.0.1:{server.getsockname()[1]}"
    channel = TcpChannel(send_timeout=2.0)
    live = closer(channel.listen(free_tcp_address()))
    dialer = closer(channel.dialer())
    dialer.send(live.address, b"before")
    first = live.recv(ARRIVAL)
    assert first is not None
    fill(dialer, stuck)
    conn = closer(server.accept()[0])  # a Decode that never reads
    assert hung_up(conn, 30.0), "the connection to a Decode that does not read was never failed"
    with pytest.raises(ChannelError, match="took no bytes"):
        dialer.send(stuck, b"after")  # the failure, reported once, to this endpoint's send
    dialer.send(live.address, b"after")  # the other endpoint: same connection, no error
    assert live.recv(ARRIVAL) == (first[0], b"after")
    dialer.send(stuck, b"again")  # the one after connects again
    again = closer(server.accept()[0])
    again.settimeout(ARRIVAL)
    reader = FrameReader(1 << 20, len(MAGIC) + IDENTITY_BYTES)
    frames: list[bytes] = []
    while not frames:
        frames += reader.feed(again.recv(4096))
    assert frames == [b"again"] and reader.identity is not None and len(reader.identity) == IDENTITY_BYTES


class _ThenLock:
    """The dialer's table lock, which runs ``then`` once, the first time ``thread`` releases it:
    it puts another thread's work right where a lock hold ends (no sleeps, no timing)."""

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


def test_a_connection_failed_as_a_send_looks_it_up_is_raised_by_that_send(closer: Callable[[T], T]) -> None:
    """The writer fails the connection after a send found it in the table and before it took the
    connection's lock: that send raises the failure (before, it connected again and sent its
    frame, and the failure was raised by the send after it, to a healthy connection)."""
    server = closer(socket.socket())
    server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)  # fills sooner
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(ARRIVAL)
    stuck = f"tcp://127.0.0.1:{server.getsockname()[1]}"
    dialer = closer(TcpChannel(send_timeout=2.0).dialer())
    fill(dialer, stuck)
    conn = closer(server.accept()[0])  # a Decode that never reads
    lock = _ThenLock(threading.current_thread().name, lambda: hung_up(conn, 30.0))
    dialer._lock = lock  # type: ignore[assignment]  # the send below waits, after its look-up, for the failure
    with pytest.raises(ChannelError, match="took no bytes"):
        dialer.send(stuck, b"after")
    assert lock.ran.is_set()
    dialer.send(stuck, b"again")  # the one after connects again
    again = closer(server.accept()[0])
    again.settimeout(ARRIVAL)
    reader = FrameReader(1 << 20, len(MAGIC) + IDENTITY_BYTES)
    frames: list[bytes] = []
    while not frames:
        frames += reader.feed(again.recv(4096))
    assert frames == [b"again"]
