"""A listener's watch over its connections: libzmq's monitor in, ``shutdown(2)`` out.

A ROUTER cannot close one peer's connection, and every connection costs Decode an fd for
as long as the peer keeps it (1,100 refused peers: 27 -> 1,129 fds). libzmq does say which
fd each connection has: its monitor reports every accepted connection (``EVENT_ACCEPTED``,
also for peers that never send a message) and every one gone (``EVENT_DISCONNECTED``),
and each received frame names the fd it came from (``ZMQ_SRCFD``). The
:class:`~rd2h.connection_book.ConnectionBook` decides which to close; this shuts that
fd down through a duplicate of it, so libzmq reads end-of-file, closes the connection
itself and reports it gone. Before shutting, it checks that the fd is still the connection
it was when accepted (same local and peer address): an fd closed without an event may
have been reused by another socket of this process.

Threads: the listener's thread only (the monitor is a zmq socket, polled in ``recv``).
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import time
from collections.abc import Callable, Hashable

import zmq

from rd2h.connection_book import Connection, ConnectionBook, Standing
from rd2h.quiet_log import quiet

__all__ = ["ConnectionWatch"]

log = logging.getLogger("rd2h_zmq")

_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED
_EVENT = struct.Struct("=HI")  # libzmq's monitor frame: event (uint16), value (uint32: the fd)
_DRAIN_BATCH = 64  # monitor events handled per recv: the messages waiting are not held up long
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_KIND = {Standing.DISOWNED: "refused, forgotten or replaced", Standing.SILENT: "silent", Standing.UNDECIDED: "undecided"}


class ConnectionWatch:
    """Tracks the connections of ``sock`` (a bound ROUTER) and closes those over the bound.

    ``monitor`` is to be polled with the ROUTER; ``drain()`` handles what it reports, and
    ``carried(fd, identity)`` is told each message's source fd. ``closed`` counts the
    connections shut, ``stale`` the records dropped because their fd was no longer theirs.

    A connection that looks silent may have a first message waiting, unread, in the ROUTER
    (a Prefill's mf_meta while Decode's loop was busy): before closing a silent connection,
    ``read_waiting`` (the listener's) reads what is waiting (bounded), so such a connection
    is known to have spoken and is spared."""

    def __init__(
        self, sock: zmq.Socket[bytes], max_unadmitted: int, address: str, read_waiting: Callable[[], None]
    ) -> None:
        self.book = ConnectionBook(max_unadmitted)
        self._address = address
        self._read_waiting = read_waiting
        self.monitor: zmq.Socket[bytes] = sock.get_monitor_socket(_EVENTS)
        self._sock = sock
        self.closed = 0
        self.stale = 0
        self._endpoints_closed: list[bytes] = []  # listening endpoints reported closed (unbind)
        self._closing = False
        self._enforcing = False
        self._read_upto = 0  # the last silent victim read ahead for (seq): once each

    def carried(self, fd: int, identity: bytes) -> None:
        if self.book.connection(fd) is None:
            # Its ACCEPTED is still queued behind others (drain takes a batch per recv): take
            # them all now, or the connection would be booked as silent although it spoke.
            self.drain(limit=1 << 30, enforce=False)  # enforced after: it is this one's
        self.book.carried(fd, identity, time.monotonic())

    def vouch(self, identity: bytes) -> None:
        self.book.vouch(identity, time.monotonic())

    def disown(self, identity: bytes) -> None:
        self.book.disown(identity, time.monotonic())
        self._enforce()

    def drain(self, limit: int = _DRAIN_BATCH, *, enforce: bool = True) -> None:
        """Handle up to ``limit`` events waiting on the monitor; close what goes over the
        bound (unless ``enforce`` is False)."""
        for _ in range(limit):
            try:
                frames = self.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                if enforce:
                    self._enforce()  # silent ones may have outlived their grace since
                return
            if len(frames) < 2 or len(frames[0]) < _EVENT.size:
                continue  # not libzmq's monitor format: nothing to learn
            event, fd = _EVENT.unpack_from(frames[0])
            if event == zmq.EVENT_ACCEPTED:
                self._accepted(fd)
                if enforce:
                    self._enforce()  # one at a time: the book never holds more than one over
            elif event == zmq.EVENT_DISCONNECTED:
                self.book.closed(fd)
            elif event == zmq.EVENT_CLOSED:
                self.book.closed(fd)
                self._endpoints_closed.append(frames[1])

    def wait_closed(self, endpoint: str, timeout: float) -> bool:
        """Wait (at most ``timeout`` s) until the listening ``endpoint`` is reported closed."""
        deadline = time.monotonic() + timeout
        wanted = endpoint.encode()
        self._closing = True  # the listener is closing: nothing more to enforce
        while wanted not in self._endpoints_closed:
            left = deadline - time.monotonic()
            if left <= 0 or not self.monitor.poll(max(1, round(left * 1000))):
                return False
            self.drain(limit=1 << 30)
        return True

    def close(self) -> None:
        try:
            self._sock.disable_monitor()
        except zmq.ZMQError:  # the socket is already closed
            pass
        self.monitor.close(linger=0)

    def counts(self) -> dict[str, int]:
        """Connections open now, by standing (``vouched``, ``undecided``, ...)."""
        return {standing.name.lower(): n for standing, n in self.book.counts().items()}

    def _accepted(self, fd: int) -> None:
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:  # already gone: its DISCONNECTED follows
            return
        try:
            check = _describe(sock)
            source = _source(sock, check)
        finally:
            sock.close()  # the duplicate only
        self.book.accepted(fd, source, check, time.monotonic())

    def _enforce(self) -> None:
        if self._enforcing:  # reached again through read_waiting: the outer loop goes on
            return
        self._enforcing = True
        try:
            self._close_over_bound()
        finally:
            self._enforcing = False

    def _close_over_bound(self) -> None:
        while not self._closing and (victim := self.book.peek(time.monotonic())) is not None:
            if victim.standing is Standing.SILENT and victim.seq > self._read_upto:
                self._read_upto = victim.seq  # once per victim: reading ahead is bounded
                self._read_waiting()  # its first message may be waiting: then it is spared
                continue
            chosen = self.book.next_to_close(time.monotonic())
            if chosen is None:
                return
            conn, was = chosen
            if not self._shut(conn):
                self.book.closed(conn.fd)  # not that connection any more: forget the record
                self.stale += 1
                continue
            self.closed += 1
            quiet(log).warning(
                "unadmitted connection closed", conn.source, "listener %s: closed a %s connection from %s: "
                "%d connections carry no admitted peer (max_unadmitted_connections=%d; %d closed so far)",
                self._address, _KIND[was], _show(conn.source), self.book.unadmitted + 1, self.book.max_unadmitted,
                self.closed,
            )  # fmt: skip

    def _shut(self, conn: Connection) -> bool:
        """Shut ``conn``'s fd down if it is still that connection; whether it was."""
        try:
            sock = socket.socket(fileno=os.dup(conn.fd))
        except OSError:
            return False
        try:
            if _describe(sock) != conn.check:
                return False
            sock.shutdown(socket.SHUT_RDWR)  # libzmq reads EOF and closes the connection
            return True
        except OSError:
            return False
        finally:
            sock.close()


def _describe(sock: socket.socket) -> tuple[object, ...]:
    """What tells this connection from another that reuses its fd number."""
    try:
        peer: object = sock.getpeername()
    except OSError:  # the peer is already gone
        peer = None
    return sock.family, sock.type, sock.getsockname(), peer


def _source(sock: socket.socket, check: tuple[object, ...]) -> Hashable:
    """Where a connection comes from: the peer's host; for ipc, its process."""
    if sock.family == socket.AF_UNIX:
        try:
            pid, _uid, _gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
        except OSError:
            return ("pid", None)
        return ("pid", pid)
    peer = check[3]
    return ("host", peer[0] if isinstance(peer, tuple) else None)


def _show(source: Hashable) -> str:
    if isinstance(source, tuple) and len(source) == 2:
        return f"{source[0]} {source[1]}"
    return repr(source)
