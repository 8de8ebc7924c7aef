"""A dialer's DEALER with its own lock and outbox, and the thread that sends what waits.

A send hands its frame to libzmq on the calling thread (``zmq.NOBLOCK``) while nothing of its
connection waits and libzmq's queue (``high_water_mark`` frames) has room: the usual case,
with no thread switch. A frame libzmq refuses (``zmq.Again``: the Decode is behind, or not
reading) waits in that connection's outbox, every later frame of the connection queues behind
it (order is kept), and the dialer's writer thread hands them on as the queue drains. A send
therefore never waits for a Decode, and one Decode never delays the frames to another.

A frame at the head of an outbox that libzmq does not take within ``send_timeout``, or more
than ``max_queued_bytes`` waiting in the outbox, fails that connection alone: its socket
is closed and what waited is dropped, as when a send used to block there for ``send_timeout``
and raise.

zmq sockets are not thread-safe: every call on a socket holds its connection's ``lock``. The
socket's notification fd (``zmq.FD``) only says "look again", and any call may consume it:
whoever finds the socket writable while frames wait kicks the writer, and whoever finds a
message waiting has the dialer kick its ``recv``. The writer's own lock (taken under a
connection's, never the other way) covers the set of connections it drains.
"""

from __future__ import annotations

import logging
import select
import threading
import time
from collections import deque
from collections.abc import Callable

import zmq

from rd2h.errors import ChannelError
from rd2h.writer_thread import BROKEN, LATE, FailureReport, WriterThread
from rd2h_zmq.settings import Settings

__all__ = ["Connection", "Writer", "BROKEN", "LATE", "FailureReport"]  # the last three are rd2h.writer_thread's

log = logging.getLogger("rd2h_zmq")

_LOOK_AGAIN = 0.05  # seconds the writer waits at most while frames wait (should an fd's signal be missed)


class Connection:
    """One DEALER to a Decode address. Every call but ``__init__`` under ``lock``."""

    __slots__ = ("sock", "fd", "address", "lock", "closed", "outbox", "queued_bytes", "deadline", "_settings",
                 "_writer")

    def __init__(self, sock: zmq.Socket[bytes], address: str, settings: Settings, writer: Writer) -> None:
        self.sock = sock
        self.fd: int = sock.getsockopt(zmq.FD)
        self.address = address
        self.lock = threading.Lock()
        self.closed = False
        self.outbox: deque[bytes] = deque()  # frames libzmq had no room for, in order; in the writer's set
        self.queued_bytes = 0  # their size
        self.deadline = 0.0  # when libzmq must have taken the outbox's head frame
        self._settings = settings
        self._writer = writer

    def send(self, payload: bytes) -> None:
        """Hand ``payload`` to libzmq now, or queue it behind what waits. Raises ``ChannelError``
        when the outbox is full (the connection is then shut) or libzmq refuses the frame."""
        if self.outbox:
            self._queue(payload)
            return
        try:
            self.sock.send(payload, zmq.NOBLOCK, copy=False)
        except zmq.Again:  # high_water_mark frames are queued: the Decode is behind, or not reading
            self.deadline = time.monotonic() + self._settings.send_timeout_ms / 1000
            self.outbox.append(payload)
            self.queued_bytes = len(payload)
            self._writer.add(self)
        except zmq.ZMQError as exc:
            raise ChannelError(f"send to {self.address} failed: {exc.strerror}") from exc

    def _queue(self, payload: bytes) -> None:
        """Behind what waits, unless the head frame waited past ``send_timeout`` (a Decode that
        takes nothing: known here at once, not only when the writer looks) or the outbox would
        hold more than ``max_queued_bytes`` (a Decode that far behind): then the connection fails.
        Bytes, not frames: a Decode that reads, however slowly, is not failed for a burst of
        small frames."""
        limit = self._settings.max_queued_bytes
        if time.monotonic() >= self.deadline:
            why = f"it took no frame of the {len(self.outbox)} queued for it within send_timeout (is it running?)"
        elif self.queued_bytes + len(payload) > limit:
            why = f"more than max_queued_bytes ({limit}) would be queued for it"
        else:
            self.outbox.append(payload)
            self.queued_bytes += len(payload)
            return
        self.shut()
        raise ChannelError(f"cannot send to {self.address}: {why}; the connection is closed and the next send "
                           "connects again")  # fmt: skip

    def look(self) -> bool:
        """Whether a message waits to be read. Tells the writer when frames wait and the socket
        has room (this call may have consumed the fd's signal the writer waits for)."""
        events = self.sock.getsockopt(zmq.EVENTS)
        if self.outbox and events & zmq.POLLOUT:
            self._writer.kick()
        return bool(events & zmq.POLLIN)

    def flush(self, now: float) -> str | None:
        """Hand libzmq what waits while it takes it. ``LATE`` if the head frame is past its
        deadline, ``BROKEN`` if the socket failed; the caller then drops the connection."""
        outbox = self.outbox
        while outbox:
            try:
                self.sock.send(outbox[0], zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return LATE if now >= self.deadline else None
            except zmq.ZMQError as exc:
                log.debug("send to %s failed with %d frames waiting: %s", self.address, len(outbox), exc)
                return BROKEN
            self.queued_bytes -= len(outbox.popleft())
            self.deadline = now + self._settings.send_timeout_ms / 1000  # the next frame's own wait
        self._writer.discard(self)
        return None

    def shut(self, linger_ms: int = 0) -> None:
        """Close the socket (its queue gets ``linger_ms`` to leave) and drop what waits (once)."""
        if self.closed:
            return
        self.closed = True
        if self.outbox:
            self.outbox.clear()
            self.queued_bytes = 0
            self._writer.discard(self)
        self.sock.close(linger=linger_ms)


class Writer(WriterThread[Connection]):
    """One thread per dialer (``rd2h.writer_thread``), started when a frame first waits, that
    hands the connections' outboxes to libzmq as their queues drain. It reports a connection to
    drop (``LATE`` or ``BROKEN``) to ``failed(connection, why)`` and one with a message waiting
    to ``readable()``, both called without locks held."""

    def __init__(self, failed: Callable[[Connection, str], None], readable: Callable[[], None]) -> None:
        # zmq.FD polls readable for "look again", for reading or writing; a signal another call
        # consumed is made up for by looking again at least every _LOOK_AGAIN seconds
        super().__init__("rd2h-zmq-writer", select.POLLIN, look_again=_LOOK_AGAIN)
        self._failed = failed
        self._readable = readable

    def serve(self, connection: Connection, now: float) -> None:
        why, readable = None, False
        with connection.lock:
            if not connection.closed:
                why = connection.flush(now)
                readable = why is None and connection.look()
        if why is not None:
            self._failed(connection, why)
        if readable:
            self._readable()
