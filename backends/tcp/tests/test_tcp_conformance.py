"""rd2h-tcp on real sockets: the shared channel suite, over TCP loopback and over a unix socket."""

from __future__ import annotations

import itertools
import os
import tempfile
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from rd2h.interfaces import ControlChannel
from rd2h.testing.channel_suite import ChannelConformance

T = TypeVar("T")
_SEQ = itertools.count()


class TestTcpConformance(ChannelConformance):
    channel_name = "tcp"


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

    def test_concurrent_send_while_another_thread_receives(
        self, channel: ControlChannel, closer: Callable[[T], T]
    ) -> None:
        """The suite's test, with the listener's loop running until the replies are in, as
        Decode's does. A unix socket holds ~200 small frames unread (wmem_max); when the
        receiving thread lags that far behind, the listener holds the next replies and writes
        them from its loop (``recv``) once the socket drains, so a listener nobody calls
        after its last ``send`` would keep them (seen 2 runs in 30 on 2 busy cores)."""
        dialer = closer(channel.dialer())
        listener = closer(channel.listen(self.make_address()))
        count = 300
        replies: list[tuple[str, bytes] | None] = []

        def receive() -> None:
            while len(replies) < count:
                got = dialer.recv(self.arrival)
                replies.append(got)
                if got is None:
                    return

        thread = threading.Thread(target=receive, daemon=True)
        thread.start()
        for i in range(count):
            peer = self.exchange(listener, dialer, b"ask %d" % i)
            listener.send(peer, b"answer %d" % i)
        deadline = time.monotonic() + self.arrival * 2
        while thread.is_alive() and time.monotonic() < deadline:
            listener.recv(0.05)
        assert not thread.is_alive(), f"{len(replies)} of {count} replies received"
        assert None not in replies, f"recv timed out after {replies.index(None)} replies with one waiting"
        assert replies == [(listener.address, b"answer %d" % i) for i in range(count)]
