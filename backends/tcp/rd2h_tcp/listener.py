"""The Decode end: one listening socket and its connections, served by one ``epoll`` on the
thread that calls ``recv`` (Decode's loop). No other thread: a frame reaches Decode in one
``epoll_wait`` and one ``recv``, a reply leaves in one ``send``.

Threads: a listener belongs to the thread that calls ``recv``; ``send``, ``vouch`` and
``disown`` run there too (the Sink does so). ``close()`` it from that thread, or from another
once that loop has stopped.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import select
import socket
import struct
import time
from collections import deque
from collections.abc import Hashable

from rd2h.connection_book import ConnectionBook, Standing
from rd2h.errors import ChannelError, PortInUseError
from rd2h.interfaces import Listener
from rd2h.quiet_log import quiet
from rd2h_tcp.addresses import Address, show
from rd2h_tcp.busy_poll import poll_briefly
from rd2h_tcp.framing import IDENTITY_BYTES, MAGIC, FrameReader, encode
from rd2h_tcp.settings import Settings

__all__ = ["TcpListener"]

log = logging.getLogger("rd2h_tcp")

_READ_BYTES = 256 << 10  # one recv per readable connection and wake-up: others are read in turn
_ACCEPT_BATCH = 64  # connections accepted per wake-up: the frames waiting are not held up long
_BACKLOG = 512
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_IN = select.EPOLLIN | select.EPOLLRDHUP
_OUT = select.EPOLLOUT
_KIND = {Standing.DISOWNED: "refused, forgotten or replaced", Standing.SILENT: "silent", Standing.UNDECIDED: "undecided"}


class _Conn:
    """One accepted connection."""

    __slots__ = (
        "sock", "fd", "source", "reader", "identity", "spoke", "frames", "queued", "in_ready",
        "out", "out_bytes", "mask", "closed", "read_ahead",
    )

    def __init__(self, sock: socket.socket, source: Hashable, limit: int) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.source = source
        self.reader = FrameReader(limit, len(MAGIC) + IDENTITY_BYTES)
        self.identity: bytes | None = None  # from the greeting
        self.spoke = False  # carried a frame: its identity routes replies here
        self.frames: deque[bytes] = deque()  # received, not yet taken by recv
        self.queued = 0  # their bytes
        self.in_ready = False
        self.out: deque[memoryview] = deque()  # replies the socket buffer had no room for
        self.out_bytes = 0
        self.mask = _IN
        self.closed = False
        self.read_ahead = False


class TcpListener(Listener):
    """Bound at construction. ``recv`` yields ``(identity, payload)`` in turn from every peer
    with frames waiting; ``send`` replies and never blocks: a reply the peer's socket buffer
    has no room for waits here (``high_water_mark`` frames, ``max_queued_bytes``), and beyond
    that is dropped, counted in ``dropped`` and raised as ``ChannelError``. Held replies are
    written by this listener's own calls (``recv`` when the socket drains, the next ``send``):
    there is no thread to write them while nobody calls it.

    Counters: ``dropped`` replies; ``refused`` connections closed for what they sent (not an
    rd2h tcp peer, a frame over ``max_frame_bytes``, an empty frame); ``connections_closed``
    closed to bound the connections of peers Decode did not admit; ``paused``: times a peer's
    reading stopped because ``max_queued_bytes`` of its frames waited for ``recv``."""

    def __init__(self, settings: Settings, address: str, parsed: Address) -> None:
        self._settings = settings
        self._closed = False
        self.dropped = 0
        self.refused = 0
        self.connections_closed = 0
        self.paused = 0  # times a peer's reading was paused, its max_queued_bytes waiting for recv
        self._unix_path: str | None = None
        self._unix_inode = 0
        sock = socket.socket(parsed.family, socket.SOCK_STREAM)
        try:
            if parsed.family == socket.AF_UNIX:
                self._bind_unix(sock, address, str(parsed.target))
            else:
                # a restarted Decode binds again at once, though its old connections linger in TIME_WAIT;
                # Linux still refuses a second listener on the port (EADDRINUSE)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                _bind(sock, address, parsed.target)
            sock.listen(_BACKLOG)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._family = parsed.family
        self._address = show(parsed.family, sock.getsockname())
        self._lfd = sock.fileno()
        self._epoll = select.epoll()
        self._epoll.register(self._lfd, select.EPOLLIN)
        self._conns: dict[int, _Conn] = {}
        self._peers: dict[bytes, _Conn] = {}  # identity -> the connection its replies go to
        self._ready: deque[_Conn] = deque()  # connections with frames waiting, in turn
        self._book = ConnectionBook(settings.max_unadmitted_connections)
        self._resume_below = max(1, settings.max_queued_bytes // 2)
        self._inbox = memoryview(bytearray(_READ_BYTES))  # every recv lands here (see _read)
        self._busy_poll = settings.busy_poll
        self._busy_until = 0.0  # recv polls without sleeping until then: busy_poll after the last frame
        self._poll_now = functools.partial(self._epoll.poll, 0)

    def _bind_unix(self, sock: socket.socket, address: str, path: str) -> None:
        try:
            _bind(sock, address, path)
        except PortInUseError:
            # a socket file is there: a live listener's (in use) or a dead one's (replace it)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.settimeout(1.0)
                try:
                    probe.connect(path)
                except (ConnectionRefusedError, FileNotFoundError):
                    pass
                except OSError as exc:
                    raise ChannelError(f"cannot listen on {address}: {path} exists and is not a socket ({exc})") from exc
                else:
                    raise
            os.unlink(path)
            _bind(sock, address, path)
        self._unix_path = path
        self._unix_inode = os.stat(path).st_ino

    @property
    def address(self) -> str:
        return self._address

    # -- receiving -----------------------------------------------------------------------

    def recv(self, timeout: float) -> tuple[bytes, bytes] | None:
        if self._closed:
            raise ChannelError(f"listener on {self._address} is closed")
        if self._ready:
            return self._take()
        deadline = time.monotonic() + max(0.0, timeout)
        wait = max(0.0, timeout)
        found: list[tuple[int, int]] = []
        if self._busy_poll:  # awake until busy_poll after the last frame (none since: at once)
            found = poll_briefly(self._poll_now, min(self._busy_until, deadline))
            wait = max(0.0, deadline - time.monotonic())
        while True:
            for fd, events in found or self._epoll.poll(wait):
                if fd == self._lfd:
                    self._accept()
                    continue
                conn = self._conns.get(fd)
                if conn is None:
                    continue
                if events & _OUT:
                    self._flush(conn)
                if events & ~_OUT and not conn.closed:
                    self._read(conn)
            found = []
            if self._book.unadmitted > self._book.soft:
                self._enforce()  # silent connections may have outlived their grace since
            if self._ready:
                return self._take()
            wait = deadline - time.monotonic()
            if wait <= 0:
                return None

    def _take(self) -> tuple[bytes, bytes]:
        conn = self._ready.popleft()
        payload = conn.frames.popleft()
        conn.queued -= len(payload)
        if conn.frames:
            self._ready.append(conn)  # round robin: one flooding peer cannot starve the others
        else:
            conn.in_ready = False
        if not conn.mask & select.EPOLLIN and not conn.closed and conn.queued < self._resume_below:
            self._set_mask(conn, conn.mask | _IN)
        return conn.identity, payload  # type: ignore[return-value]

    def _accept(self) -> None:
        for _ in range(_ACCEPT_BATCH):
            try:
                sock, peer = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and friends: the connection waits in the backlog
                quiet(log).warning("accept", self._address, "listener %s: accept failed: %s", self._address, exc)
                return
            sock.setblocking(False)
            if self._family != socket.AF_UNIX:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(sock, _source(sock, peer, self._family), self._settings.max_frame_bytes)
            try:
                sock.send(MAGIC)  # 8 bytes into an empty socket buffer
            except OSError:
                sock.close()
                continue
            self._conns[conn.fd] = conn
            self._epoll.register(conn.fd, conn.mask)
            self._book.accepted(conn.fd, conn.source, None, time.monotonic())
            self._enforce()  # one at a time: the book never holds more than one over

    def _read(self, conn: _Conn) -> None:
        # into one buffer kept for the listener's life: ``recv(n)`` allocates n bytes a call and
        # gives back what the message did not fill; for 256 KiB that took ~25 us a message here
        inbox = self._inbox
        try:
            n = conn.sock.recv_into(inbox)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        if not n:
            self._close(conn)
            return
        data = inbox[:n].tobytes()
        reader = conn.reader
        frames = reader.feed(data)
        if frames:
            self._arrived(conn, frames)
        if reader.error is not None:
            self.refused += 1
            quiet(log).warning(
                "refused", conn.source, "listener %s: closed a connection from %s that sent %s (%d refused so far)",
                self._address, _show(conn.source), reader.error, self.refused,
            )  # fmt: skip
            self._close(conn)

    def _arrived(self, conn: _Conn, frames: list[bytes]) -> None:
        identity = conn.reader.identity
        assert identity is not None  # frames follow the greeting
        if not conn.spoke:
            conn.spoke = True
            conn.identity = identity
            old = self._peers.get(identity)
            self._peers[identity] = conn
            self._book.carried(conn.fd, identity, time.monotonic())
            if old is not None and old is not conn:
                self._close(old)  # a reconnect of the same dialer: the old connection is a leftover
        conn.frames.extend(frames)
        conn.queued += sum(map(len, frames))
        if self._busy_poll:
            self._busy_until = time.monotonic() + self._busy_poll
        if not conn.in_ready:
            conn.in_ready = True
            self._ready.append(conn)
        if conn.queued >= self._settings.max_queued_bytes and conn.mask & select.EPOLLIN:
            self.paused += 1
            self._set_mask(conn, conn.mask & ~_IN)  # read again once recv took half of it

    # -- sending -------------------------------------------------------------------------

    def send(self, peer: bytes, payload: bytes) -> None:
        if self._closed:
            raise ChannelError(f"listener on {self._address} is closed")
        data = encode(payload, self._settings.max_frame_bytes)
        conn = self._peers.get(peer)
        if conn is None:
            raise ChannelError(f"peer {peer!r} is not connected to {self._address}")
        if conn.out:  # earlier replies still wait: they go first, as far as the socket takes them
            self._flush(conn)
            if conn.closed:
                raise ChannelError(f"peer {peer!r} on {self._address} is gone")
        if conn.out:
            self._hold(conn, peer, memoryview(data))
            return
        try:
            sent = conn.sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as exc:
            self._close(conn)
            raise ChannelError(f"peer {peer!r} on {self._address} is gone: {exc}") from exc
        if sent < len(data):
            self._hold(conn, peer, memoryview(data)[sent:])
        if self._busy_poll:
            self._busy_until = time.monotonic() + self._busy_poll  # the peer's next frame is likely near

    def _hold(self, conn: _Conn, peer: bytes, rest: memoryview) -> None:
        settings = self._settings
        if len(conn.out) >= settings.high_water_mark or conn.out_bytes + len(rest) > settings.max_queued_bytes:
            if len(rest) != len(rest.obj):  # type: ignore[arg-type]
                # part of this frame is on the wire: the rest must follow, or the stream is corrupt
                self._close(conn)
            self.dropped += 1
            raise ChannelError(
                f"reply to peer {peer!r} on {self._address} dropped: {len(conn.out)} replies "
                f"({conn.out_bytes} bytes) wait for it and it reads none ({self.dropped} dropped so far)"
            )
        conn.out.append(rest)
        conn.out_bytes += len(rest)
        if not conn.mask & _OUT:
            self._set_mask(conn, conn.mask | _OUT)

    def _flush(self, conn: _Conn) -> None:
        while conn.out:
            head = conn.out[0]
            try:
                sent = conn.sock.send(head)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self._close(conn)
                return
            conn.out_bytes -= sent
            if sent < len(head):
                conn.out[0] = head[sent:]
                return
            conn.out.popleft()
        self._set_mask(conn, conn.mask & ~_OUT)

    # -- the connection bound ------------------------------------------------------------

    def vouch(self, peer: bytes) -> None:
        """Decode admitted ``peer``: its connection is never closed to bound the others."""
        self._book.vouch(peer, time.monotonic())

    def disown(self, peer: bytes) -> None:
        """Decode refused or forgot ``peer``: its connection is among the first closed once
        more than ``max_unadmitted_connections`` carry no admitted peer."""
        self._book.disown(peer, time.monotonic())
        self._enforce()

    def connections(self) -> dict[str, int]:
        """The connections open now by standing (``vouched``, ``undecided``, ``silent``, ``disowned``)."""
        return {standing.name.lower(): n for standing, n in self._book.counts().items() if standing is not Standing.CLOSING}

    def _enforce(self) -> None:
        book = self._book
        while not self._closed and (victim := book.peek(time.monotonic())) is not None:
            conn = self._conns.get(victim.fd)
            if conn is None:  # cannot happen: every close tells the book; forget it all the same
                book.closed(victim.fd)
                continue
            if victim.standing is Standing.SILENT and not conn.read_ahead:
                conn.read_ahead = True  # once: its first frame may be waiting unread; then it is spared
                self._read(conn)
                continue
            chosen = book.next_to_close(time.monotonic())
            if chosen is None:
                return
            _, was = chosen
            self._close(conn)
            self.connections_closed += 1
            quiet(log).warning(
                "unadmitted connection closed", conn.source, "listener %s: closed a %s connection from %s: "
                "%d connections carry no admitted peer (max_unadmitted_connections=%d; %d closed so far)",
                self._address, _KIND[was], _show(conn.source), book.unadmitted + 1, book.max_unadmitted,
                self.connections_closed,
            )  # fmt: skip

    # -- closing -------------------------------------------------------------------------

    def _set_mask(self, conn: _Conn, mask: int) -> None:
        if mask != conn.mask:
            conn.mask = mask
            self._epoll.modify(conn.fd, mask)

    def _close(self, conn: _Conn) -> None:
        """Close one connection. Frames it delivered before stay for ``recv``; replies to it
        raise ``ChannelError`` from now on."""
        if conn.closed:
            return
        conn.closed = True
        del self._conns[conn.fd]
        self._book.closed(conn.fd)
        if conn.identity is not None and self._peers.get(conn.identity) is conn:
            del self._peers[conn.identity]
        try:
            self._epoll.unregister(conn.fd)
        except OSError:
            pass
        conn.sock.close()
        conn.out.clear()

    def close(self) -> None:
        """Close every connection and the listening socket; the address is free when this returns."""
        if self._closed:
            return
        self._closed = True
        for conn in list(self._conns.values()):
            self._close(conn)
        self._ready.clear()
        self._epoll.close()
        self._sock.close()
        if self._unix_path is not None:
            try:  # only our own file: another listener may have replaced it meanwhile
                if os.stat(self._unix_path).st_ino == self._unix_inode:
                    os.unlink(self._unix_path)
            except OSError:
                pass


def _bind(sock: socket.socket, address: str, target: object) -> None:
    try:
        sock.bind(target)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise PortInUseError(errno.EADDRINUSE, f"cannot listen on {address}: address already in use") from exc
        raise ChannelError(f"cannot listen on {address}: {exc.strerror or exc}") from exc


def _source(sock: socket.socket, peer: object, family: int) -> Hashable:
    """Where a connection comes from: the peer's host; for a unix socket, its process."""
    if family == socket.AF_UNIX:
        try:
            pid, _uid, _gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
        except OSError:
            return ("pid", None)
        return ("pid", pid)
    return ("host", peer[0] if isinstance(peer, tuple) else None)


def _show(source: Hashable) -> str:
    if isinstance(source, tuple) and len(source) == 2:
        return f"{source[0]} {source[1]}"
    return repr(source)
