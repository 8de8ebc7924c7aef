"""rd2h-tcp on real sockets: the shared channel suite, over TCP loopback and over a unix socket."""

from __future__ import annotations

import itertools
import os
import tempfile
import threading
from collections.abc import Callable
from typing import TypeVar

from rd2h.interfaces import ControlChannel
from rd2h.testing.channel_suite import ChannelConformance

T = TypeVar("T")
_SEQ = itertools.count()


class TestTcpConformance(ChannelConformance):
    channel_name = "tcp"


class TestTcpBusyPollConformance(ChannelConformance):
    """The whole suite again with both ends polling awake after each frame: a frame that lands
    while an end polls is taken as one that wakes it from ``epoll``."""

    channel_name = "tcp"
    channel_options = {"busy_poll_us": 2000}


class TestTcpIpcConformance(ChannelConformance):
    channel_name = "tcp"

    def make_address(self) -> str:
        return f"ipc://{tempfile.gettempdir()}/rd2h-tcp-test-{os.getpid()}-{next(_SEQ)}.sock"

    def test_payload_bytes_are_exact(self, channel: ControlChannel, closer: Callable[[T], T]) -> None:
        """The suite's test, with the listener reading on its own thread, as Decode's loop does:
        a unix socket buffers ~208 KiB (wmem_max), so a 1 MiB frame is written while the
        listener reads (the suite's single thread would wait out ``send_timeout``; over TCP
        loopback the kernel buffers it whole and the suite's own test runs)."""
        listener = closer(channel.listen(self.make_address()))
        dialer = closer(channel.dialer())
        blob = os.urandom(1 << 20) + b"\x00" * 7
        got: list[tuple[bytes, bytes] | None] = []
        reader = threading.Thread(target=lambda: got.append(listener.recv(self.arrival)), daemon=True)
        reader.start()
        dialer.send(listener.address, blob)
        reader.join(self.arrival * 2)
        assert got and got[0] is not None and got[0][1] == blob
        listener.send(got[0][0], blob[::-1])  # held by the listener, flushed as the dialer reads
        replies: list[tuple[str, bytes] | None] = []
        reader = threading.Thread(target=lambda: replies.append(dialer.recv(self.arrival)), daemon=True)
        reader.start()
        while reader.is_alive():
            listener.recv(0.05)  # the listener's loop writes what the socket had no room for
        assert replies == [(listener.address, blob[::-1])]
