"""The tcp dialer and a Decode that does not read, on real sockets: the shared suites
(``rd2h.testing.stuck_decode_suite``: the channel over TCP loopback and over a unix socket, and
a Prefill Source over it whose Decode stops reading), and a race only this dialer has (a
connection the writer fails as a send looks it up)."""

from __future__ import annotations

import itertools
import os
import socket
import tempfile
import threading
from collections.abc import Callable
from typing import TypeVar

import pytest
from rd2h_tcp.framing import IDENTITY_BYTES, MAGIC, FrameReader

from rd2h.errors import ChannelError
from rd2h.testing.stuck_decode_suite import (
    SEND_TIMEOUT,
    LostFramesConformance,
    StuckDecodeConformance,
    ThenLock,
    hung_up,
)

T = TypeVar("T")
MiB = 1 << 20
_SEQ = itertools.count()


def read_frames(conn: socket.socket) -> tuple[list[bytes], bytes | None]:
    """The first frames the dialer wrote on a new connection, and the identity it sent."""
    reader = FrameReader(1 << 20, len(MAGIC) + IDENTITY_BYTES)
    frames: list[bytes] = []
    while not frames:
        frames += reader.feed(conn.recv(4096))
    return frames, reader.identity


class TcpStuckDecode(StuckDecodeConformance):
    channel_name = "tcp"
    big_frame_bytes = MiB
    backed_up_at = 24 * MiB  # bytes waiting: more than any kernel buffer takes while nobody reads (wmem_max 4 MiB)
    failure_match = "took no bytes"

    def assert_connected_again(self, conn: socket.socket, payload: bytes) -> None:
        frames, identity = read_frames(conn)
        assert frames == [payload] and identity is not None and len(identity) == IDENTITY_BYTES


class TestTcpStuckDecode(TcpStuckDecode, LostFramesConformance):
    def test_a_connection_failed_as_a_send_looks_it_up_is_raised_by_that_send(
        self, closer: Callable[[T], T]
    ) -> None:
        """The writer fails the connection after a send found it in the table and before it took
        the connection's lock: that send raises the failure (before, it connected again and sent
        its frame, and the failure was raised by the send after it, to a healthy connection)."""
        server, stuck = self.stuck_server(closer)
        dialer = closer(self.make_channel(send_timeout=SEND_TIMEOUT).dialer())
        self.fill(dialer, stuck)
        conn = closer(server.accept()[0])  # a Decode that never reads
        lock = ThenLock(threading.current_thread().name, lambda: hung_up(conn, 30.0))
        dialer._lock = lock  # type: ignore[attr-defined]  # the send below waits, after its look-up, for the failure
        with pytest.raises(ChannelError, match=self.failure_match):
            dialer.send(stuck, b"after")
        assert lock.ran.is_set()
        dialer.send(stuck, b"again")  # the one after connects again
        again = closer(server.accept()[0])
        again.settimeout(self.arrival)
        assert read_frames(again)[0] == [b"again"]


class TestTcpIpcStuckDecode(TcpStuckDecode):
    """The suite with its listeners on unix sockets (a Decode that does not read: still TCP)."""

    def make_address(self) -> str:
        return f"ipc://{tempfile.gettempdir()}/rd2h-tcp-slow-{os.getpid()}-{next(_SEQ)}.sock"
