"""The Prefill end: one connection per Decode address, made on first send, written on the
calling thread.

``send`` and ``disconnect`` may run on any thread while another blocks in ``recv``
(``concurrent_send``): one lock covers the connection table and every socket call, and
``recv`` waits in ``poll`` outside it. The sockets are level-triggered, so a reply that
arrives while a send holds the lock is still reported to the waiting ``poll``: no kick is
needed, except when the set of connections changes (a pipe makes ``recv`` look again).
"""

from __future__ import annotations

import functools
import logging
import math
import secrets
import select
import socket
import threading
import time
from collections import deque
from typing import ClassVar

from rd2h.errors import ChannelError
from rd2h.interfaces import Dialer
from rd2h.quiet_log import quiet
from rd2h.wake_pipe import WakePipe
from rd2h_tcp.addresses import parse
from rd2h_tcp.busy_poll import poll_briefly
from rd2h_tcp.framing import IDENTITY_BYTES, MAGIC, FrameReader, encode
from rd2h_tcp.settings import Settings

__all__ = ["TcpDialer"]

log = logging.getLogger("rd2h_tcp")

_READ_BYTES = 256 << 10
_POLL_IN = select.POLLIN | select.POLLPRI


class _Link:
    __slots__ = ("sock", "fd", "address", "reader")

    def __init__(self, sock: socket.socket, address: str, limit: int) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.address = address
        self.reader = FrameReader(limit, len(MAGIC))


class TcpDialer(Dialer):
    """Connects to each Decode address on first send (bounded by ``send_timeout``) and greets
    it with this dialer's identity, fixed for its life: a reconnect after ``disconnect`` or a
    Decode restart is the same peer to the listener.

    A connection the listener closed is noticed by ``recv`` (end of file), or by the next
    ``send`` (the kernel's refusal), which then connects again once and sends the frame over
    the new connection. A frame written just as Decode goes away is lost, as on any
    connection; rd2h's replies and deadlines settle what it named."""

    concurrent_send: ClassVar[bool] = True

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._identity = b"tcp-" + secrets.token_hex((IDENTITY_BYTES - 4) // 2).encode()
        self._lock = threading.Lock()  # the tables below and every socket call
        self._links: dict[str, _Link] = {}
        self._by_fd: dict[int, _Link] = {}
        self._ready: deque[tuple[str, bytes]] = deque()  # frames read, not yet returned
        self._closed = False
        self._version = 0  # bumped when a link comes or goes: recv rebuilds its poll set
        self._polled = -1  # recv's thread only
        self._poller = select.poll()
        self._wake = WakePipe()  # a kick: recv looks again; a wake: recv returns None
        self._inbox = memoryview(bytearray(_READ_BYTES))  # every recv lands here, under the lock (see _read)
        self._busy_poll = settings.busy_poll
        self._busy_until = 0.0  # recv polls without sleeping until then: busy_poll after the last frame

    @property
    def identity(self) -> bytes:
        return self._identity

    def send(self, address: str, payload: bytes) -> None:
        """Write one frame to ``address``. Raises ``FrameTooLargeError``, ``ChannelError`` for a
        malformed address, a refused or timed-out connect, or a Decode that takes none of the
        frame's bytes for ``send_timeout``. Thread-safe."""
        data = encode(payload, self._settings.max_frame_bytes)
        with self._lock:
            self._check_open()
            link = self._links.get(address)
            if link is not None:
                try:
                    self._write(link, data)
                    return
                except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError):
                    # Decode closed this connection (restarted, or shut it): nothing of the
                    # frame left, so it goes over a new connection
                    self._drop(link)
                except OSError as exc:
                    self._drop(link)
                    raise ChannelError(f"send to {address} failed: {exc}") from exc
        link = self._connect(address)  # outside the lock: a slow connect delays no reply
        with self._lock:
            self._check_open(link)
            current = self._links.get(address)
            if current is not None:  # another thread connected meanwhile: use that one
                link.sock.close()
                link = current
            else:
                self._add(link)
            try:
                self._write(link, data)
            except OSError as exc:
                self._drop(link)
                raise ChannelError(f"send to {address} failed: {exc}") from exc

    def _write(self, link: _Link, data: bytes) -> None:  # under the lock
        if self._busy_poll:
            self._busy_until = time.monotonic() + self._busy_poll
        try:
            sent = link.sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        if sent == len(data):
            return
        # The socket buffer is full: Decode is not reading. Wait for room, bounded.
        view = memoryview(data)[sent:]
        deadline = time.monotonic() + self._settings.send_timeout
        poller = select.poll()
        poller.register(link.fd, select.POLLOUT)
        while view:
            left = deadline - time.monotonic()
            if left <= 0 or not poller.poll(math.ceil(left * 1000)):
                self._drop(link)  # part of a frame may be on the wire: this stream is done
                raise ChannelError(
                    f"cannot send to {link.address}: it took no bytes for {self._settings.send_timeout:.1f} s "
                    "(is its loop running?); the connection is closed and the next send connects again"
                )
            try:
                sent = link.sock.send(view)
            except (BlockingIOError, InterruptedError):
                continue
            view = view[sent:]

    def _connect(self, address: str) -> _Link:
        parsed = parse(address)
        sock = socket.socket(parsed.family, socket.SOCK_STREAM)
        try:
            sock.settimeout(self._settings.send_timeout)
            sock.connect(parsed.target)
            sock.setblocking(False)
            if parsed.family != socket.AF_UNIX:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a frame is a message: send it now
            sock.send(MAGIC + self._identity)  # 24 bytes into an empty buffer
        except (TimeoutError, socket.timeout) as exc:
            sock.close()
            raise ChannelError(f"cannot connect to {address}: no answer in {self._settings.send_timeout:.1f} s") from exc
        except OSError as exc:
            sock.close()
            raise ChannelError(f"cannot connect to {address}: {exc.strerror or exc}") from exc
        return _Link(sock, address, self._settings.max_frame_bytes)

    def recv(self, timeout: float) -> tuple[str, bytes] | None:
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            with self._lock:
                self._check_open()
                if self._ready:
                    return self._ready.popleft()
                if self._polled != self._version:  # a link came or went: wait on the new set
                    self._polled = self._version
                    self._poller = select.poll()
                    self._poller.register(self._wake.fd, select.POLLIN)
                    for fd in self._by_fd:
                        self._poller.register(fd, _POLL_IN)
                poller = self._poller
            events: list[tuple[int, int]] = []
            if self._busy_poll:  # a reply to what was just sent is likely microseconds away: wait for it awake
                events = poll_briefly(functools.partial(poller.poll, 0), min(self._busy_until, deadline))
            if not events:
                left = deadline - time.monotonic()
                events = poller.poll(max(0, math.ceil(left * 1000)))
            woken = False
            with self._lock:
                self._check_open()
                for fd, _ in events:
                    if fd == self._wake.fd:
                        woken = self._wake.drain()
                        continue
                    link = self._by_fd.get(fd)
                    if link is not None:
                        self._read(link)
                if woken:
                    return None
                if self._ready:
                    return self._ready.popleft()
            if not events and time.monotonic() >= deadline:
                return None

    def _read(self, link: _Link) -> None:  # under the lock
        # ``recv(n)`` would allocate n bytes a call (~25 us for 256 KiB here): one buffer, and a copy of what came
        inbox = self._inbox
        try:
            n = link.sock.recv_into(inbox)
            data = inbox[:n].tobytes()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            log.debug("connection to %s failed: %s", link.address, exc)
            self._drop(link)
            return
        if not data:
            log.debug("%s closed the connection", link.address)
            self._drop(link)  # the next send connects again
            return
        reader = link.reader
        for payload in reader.feed(data):
            self._ready.append((link.address, payload))
        if self._busy_poll:
            self._busy_until = time.monotonic() + self._busy_poll
        if reader.error is not None:
            quiet(log).warning(
                "not rd2h tcp", link.address, "closed the connection to %s: it sent %s (is it a zmq endpoint? "
                "both ends must use the same control channel)", link.address, reader.error,
            )  # fmt: skip
            self._drop(link)

    def wakeup(self) -> None:
        """Make a ``recv`` blocked in another thread return ``None`` now. Thread-safe."""
        self._wake.wake()

    def disconnect(self, address: str) -> None:
        """Close the connection to ``address``. Unknown: no-op. Thread-safe."""
        with self._lock:
            link = self._links.get(address)
            if link is not None:
                self._drop(link)
            self._ready = deque(item for item in self._ready if item[0] != address)

    def _add(self, link: _Link) -> None:  # under the lock
        self._links[link.address] = link
        self._by_fd[link.fd] = link
        self._version += 1
        self._wake.kick()  # a recv in another thread starts waiting on this connection too

    def _drop(self, link: _Link) -> None:  # under the lock
        if self._links.get(link.address) is link:
            del self._links[link.address]
            del self._by_fd[link.fd]
            self._version += 1
            self._wake.kick()
        link.sock.close()

    def close(self) -> None:
        """Close every connection. What was sent is delivered by the kernel (a normal close,
        not a reset). Call it once no other thread uses the dialer."""
        with self._lock:
            if self._closed:
                return
            for link in list(self._links.values()):
                self._drop(link)
            self._closed = True
            self._wake.close()

    def _check_open(self, link: _Link | None = None) -> None:
        if self._closed:
            if link is not None:
                link.sock.close()
            raise ChannelError("dialer is closed")
