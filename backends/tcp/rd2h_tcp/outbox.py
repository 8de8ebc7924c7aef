"""A dialer's connection with its own lock and outbox, and the thread that writes what waits.

A send writes on the calling thread while nothing of its connection waits and the socket takes
the bytes at once: the usual case, with no thread switch. What the socket has no room for
(Decode is behind, or does not read) waits in that connection's outbox, every later frame of
the connection queues behind it (order is kept), and the dialer's writer thread writes it as
the socket drains. A send therefore never waits for a Decode, and one Decode never delays the
frames to another.

A frame at the head of an outbox not written within ``send_timeout`` (its Decode took too few
bytes), or an outbox over ``max_queued_bytes``, fails that connection alone: it is closed and
what waited is dropped, as when a send used to block there for ``send_timeout`` and raise.

Locks: a ``Link``'s ``lock`` covers its socket and outbox; the writer's own lock (taken under a
link's, never the other way) covers the set of links it drains.
"""

from __future__ import annotations

import logging
import select
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable

from rd2h.errors import ChannelError
from rd2h.writer_thread import BROKEN, LATE, FailureReport, WriterThread
from rd2h_tcp.framing import MAGIC, FrameReader
from rd2h_tcp.settings import Settings

__all__ = ["Link", "Writer", "BROKEN", "LATE", "FailureReport"]  # the last three are rd2h.writer_thread's

log = logging.getLogger("rd2h_tcp")

_RESET_ON_CLOSE = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close sends a reset


class Link:
    """One connection to a Decode address. Every call but ``__init__`` under ``lock``."""

    __slots__ = (
        "sock", "fd", "address", "reader", "lock", "closed", "outbox", "queued_bytes", "deadline", "idle_since",
        "_settings", "_writer",
    )  # fmt: skip

    def __init__(self, sock: socket.socket, address: str, settings: Settings, writer: Writer) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.address = address
        self.reader = FrameReader(settings.max_frame_bytes, len(MAGIC))  # recv's thread only
        self.lock = threading.Lock()
        self.closed = False
        self.outbox: deque[memoryview] = deque()  # bytes the socket had no room for, in order; in the writer's set
        self.queued_bytes = 0
        self.deadline = 0.0  # when the outbox's head frame must be written by
        self.idle_since = 0.0  # when the outbox last took bytes (or began)
        self._settings = settings
        self._writer = writer

    def send(self, data: bytes) -> None:
        """Write ``data`` now as far as the socket takes it; queue the rest behind what waits.
        Raises ``OSError`` from the socket (only when nothing waits), ``ChannelError`` when the
        outbox is full (the link is then shut)."""
        if self.outbox:
            self._queue(memoryview(data), time.monotonic())
            return
        try:
            sent = self.sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        if sent == len(data):
            return
        now = time.monotonic()  # the socket buffer is full: Decode is behind, or not reading
        self.deadline = now + self._settings.send_timeout
        self.idle_since = now
        self._queue(memoryview(data)[sent:], now)
        self._writer.add(self)

    def _queue(self, rest: memoryview, now: float) -> None:
        if self.outbox and self.queued_bytes + rest.nbytes > self._settings.max_queued_bytes:
            frames, queued = len(self.outbox), self.queued_bytes
            self.shut(abort=True)
            raise ChannelError(
                f"cannot send to {self.address}: {frames} frames ({queued / (1 << 20):.1f} MiB) wait for it, the "
                f"most a connection holds (max_queued_bytes), and it took no bytes for {now - self.idle_since:.2f} s "
                "(is its loop running?); the connection is closed and the next send connects again"
            )
        self.outbox.append(rest)
        self.queued_bytes += rest.nbytes

    def flush(self, now: float) -> str | None:
        """Write what waits while the socket takes it. ``LATE`` if the head frame is past its
        deadline, ``BROKEN`` if the socket failed (Decode closed it: the next send connects
        again, and the protocol re-sends what Decode says it missed); the caller then drops the
        link. None otherwise."""
        outbox = self.outbox
        while outbox:
            head = outbox[0]
            try:
                sent = self.sock.send(head)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as exc:
                log.debug("connection to %s failed with %d frames waiting: %s", self.address, len(outbox), exc)
                return BROKEN
            if sent:
                self.queued_bytes -= sent
                self.idle_since = now
            if sent < head.nbytes:
                outbox[0] = head[sent:]
                return LATE if now >= self.deadline else None
            outbox.popleft()
            self.deadline = now + self._settings.send_timeout  # the next frame's own wait
        self._writer.discard(self)
        return None

    def shut(self, abort: bool = False) -> None:
        """Close the socket and drop what waits (once). ``abort``: reset the connection rather
        than leave the kernel to deliver what it holds (a frame may be cut: the stream is done)."""
        if self.closed:
            return
        self.closed = True
        if abort:
            try:
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET_ON_CLOSE)
            except OSError:
                pass
        if self.outbox:
            self.outbox.clear()
            self.queued_bytes = 0
            self._writer.discard(self)
        self.sock.close()


class Writer(WriterThread[Link]):
    """One thread per dialer (``rd2h.writer_thread``), started when a frame first waits, that
    writes the links' outboxes as their sockets drain, and reports a link to drop (``LATE`` or
    ``BROKEN``) to ``failed(link, why)``, called without locks held."""

    def __init__(self, failed: Callable[[Link, str], None]) -> None:
        super().__init__("rd2h-tcp-writer", select.POLLOUT)
        self._failed = failed

    def serve(self, link: Link, now: float) -> None:
        with link.lock:
            why = None if link.closed else link.flush(now)
        if why is not None:
            self._failed(link, why)
