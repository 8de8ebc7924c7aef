"""The Prefill end: one connection per Decode address, made on first send, written on the
calling thread while its socket has room.

``send`` and ``disconnect`` may run on any thread while another blocks in ``recv``
(``concurrent_send``). A lock covers the connection table only; each connection has its own
(``rd2h_tcp.outbox.Link``) over its socket and outbox, so a Decode that does not read delays
no send, reply or disconnect of another, and a send never waits: what the socket has no room
for waits in that connection's outbox for the dialer's writer thread (``rd2h_tcp.outbox``).
``recv`` waits in ``poll`` outside every lock. The sockets are level-triggered, so a reply
that arrives while a send holds a connection is still reported to the waiting ``poll``: no
kick is needed, except when the set of connections changes (a pipe makes ``recv`` look again).
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
from rd2h_tcp.framing import IDENTITY_BYTES, MAGIC, encode
from rd2h_tcp.outbox import LATE, FailureReport, Link, Writer
from rd2h_tcp.settings import Settings

__all__ = ["TcpDialer"]

log = logging.getLogger("rd2h_tcp")

_READ_BYTES = 256 << 10
_POLL_IN = select.POLLIN | select.POLLPRI
_RESET = (BrokenPipeError, ConnectionResetError, ConnectionAbortedError)


class TcpDialer(FailureReport, Dialer):
    """Connects to each Decode address on first send (bounded by ``send_timeout``) and greets
    it with this dialer's identity, fixed for its life: a reconnect after ``disconnect`` or a
    Decode restart is the same peer to the listener.

    A connection the listener closed is noticed by ``recv`` (end of file), or by the next
    ``send`` (the kernel's refusal), which then connects again once and sends the frame over
    the new connection. A frame written just as Decode goes away is lost, as on any
    connection; rd2h's replies and deadlines settle what it named.

    A send never waits for a Decode: what its socket has no room for waits in that
    connection's outbox, in order (``rd2h_tcp.outbox``). A Decode that leaves a frame there
    unwritten for ``send_timeout`` has its connection closed and what waited dropped; that is
    reported once, by ``take_failures`` (``recv`` is woken to have it asked) or by the next send
    to it raising ``ChannelError`` saying so, whichever comes first, and the send after connects
    again. A send that would have more than ``max_queued_bytes`` wait there fails the connection
    so at once."""

    concurrent_send: ClassVar[bool] = True

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._identity = b"tcp-" + secrets.token_hex((IDENTITY_BYTES - 4) // 2).encode()
        self._lock = threading.Lock()  # the tables below, never a socket call
        self._links: dict[str, Link] = {}
        self._by_fd: dict[int, Link] = {}
        self._failed: dict[str, str] = {}  # why a connection was failed, for the next send there
        self._ready: deque[tuple[str, bytes]] = deque()  # frames read, not yet returned
        self._closed = False
        self._version = 0  # bumped when a link comes or goes: recv rebuilds its poll set
        self._polled = -1  # recv's thread only
        self._poller = select.poll()
        self._wake = WakePipe()  # a kick: recv looks again; a wake: recv returns None
        self._inbox = memoryview(bytearray(_READ_BYTES))  # every recv lands here (recv's thread only)
        self._writer = Writer(self._failed_link)
        self._busy_poll = settings.busy_poll
        self._busy_until = 0.0  # recv polls without sleeping until then: busy_poll after the last frame

    @property
    def identity(self) -> bytes:
        return self._identity

    def send(self, address: str, payload: bytes) -> None:
        """Write one frame to ``address``, or queue it behind what waits there. Raises
        ``FrameTooLargeError``, ``ChannelError`` for a malformed address, a refused or timed-out
        connect, a connection failed since the last send (see the class) or one whose outbox is
        full. Thread-safe; never waits for another connection's Decode."""
        data = encode(payload, self._settings.max_frame_bytes)
        if self._busy_poll:
            self._busy_until = time.monotonic() + self._busy_poll
        while True:
            with self._lock:
                self._check_open()
                failure = self._failed.pop(address, None)
                link = self._links.get(address)
            if failure is not None:
                raise ChannelError(failure)
            if link is None:
                break
            try:
                if self._write(link, data):
                    return
                # closed since: look again, as the writer may have failed it (raised now, not a send later)
            except _RESET:
                # Decode closed this connection (restarted, or shut it): nothing waited before
                # this frame and none of it left, so it goes over a new connection
                self._drop(link)
                break
            except OSError as exc:
                self._drop(link)
                raise ChannelError(f"send to {address} failed: {exc}") from exc
        link = self._adopt(self._connect(address))  # connect outside every lock: it delays no one
        try:
            if self._write(link, data):
                return
        except OSError as exc:
            self._drop(link)
            raise ChannelError(f"send to {address} failed: {exc}") from exc
        raise ChannelError(f"send to {address} failed: the connection closed as it was made")

    def waiting(self, address: str) -> int:
        """Bytes ``send`` took for ``address`` that wait for room in its socket (0: none)."""
        with self._lock:
            link = self._links.get(address)
        if link is None:
            return 0
        with link.lock:
            return link.queued_bytes

    def _write(self, link: Link, data: bytes) -> bool:
        """False if ``link`` was closed meanwhile. A full outbox: the link is dropped, and raised."""
        try:
            with link.lock:
                if link.closed:
                    return False
                link.send(data)
                return True
        except ChannelError:
            self._drop(link)
            raise

    def _adopt(self, link: Link) -> Link:
        """List a new connection, unless another thread listed one meanwhile: then use that."""
        with self._lock:
            current = self._links.get(link.address)
            if not self._closed and (current is None or current.closed):
                if current is not None:
                    self._unlist(current)
                self._links[link.address] = link
                self._by_fd[link.fd] = link
                self._changed()
                return link
        link.sock.close()
        self._check_open()
        assert current is not None
        return current

    def _failed_link(self, link: Link, why: str) -> None:
        """The writer found ``link`` broken, or its head frame past its deadline: drop it, and
        report the latter (``take_failures``, or the next send there raises it), waking ``recv``
        so that the Prefill asks now."""
        late = False
        with self._lock:
            if self._links.get(link.address) is link:
                self._unlist(link)
                if why == LATE:  # else Decode closed it: the next send just connects again
                    late = True
                    self._failed[link.address] = (
                        f"cannot send to {link.address}: it took no bytes of a frame for "
                        f"{self._settings.send_timeout:.1f} s (is its loop running?); its connection was closed "
                        "with what waited for it, and the next send connects again"
                    )
        with link.lock:
            link.shut(abort=why == LATE)
        if late:
            self._wake.wake()

    def _connect(self, address: str) -> Link:
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
            timeout = self._settings.send_timeout
            raise ChannelError(f"cannot connect to {address}: no answer in {timeout:.1f} s") from exc
        except OSError as exc:
            sock.close()
            raise ChannelError(f"cannot connect to {address}: {exc.strerror or exc}") from exc
        return Link(sock, address, self._settings, self._writer)

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
            readable: list[Link] = []
            with self._lock:
                self._check_open()
                for fd, _ in events:
                    if fd == self._wake.fd:
                        woken = self._wake.drain()
                        continue
                    link = self._by_fd.get(fd)
                    if link is not None:
                        readable.append(link)
            arrived = [(link, self._read(link)) for link in readable]
            with self._lock:
                for link, payloads in arrived:
                    if payloads and self._links.get(link.address) is link:  # not disconnected meanwhile
                        self._ready.extend((link.address, payload) for payload in payloads)
                item = self._ready.popleft() if self._ready and not woken else None
            for link, _ in arrived:
                if link.reader.error is not None:  # the frames before the fault are kept
                    self._drop(link)
            if woken:
                return None
            if item is not None:
                return item
            if not events and time.monotonic() >= deadline:
                return None

    def _read(self, link: Link) -> list[bytes]:
        """The frames completed by what ``link`` has for us (recv's thread only)."""
        # ``recv(n)`` would allocate n bytes a call (~25 us for 256 KiB here): one buffer, and a copy of what came
        inbox = self._inbox
        with link.lock:
            n = -1  # a failed or closed connection
            if not link.closed:  # else shut by another thread, which unlists it too
                try:
                    n = link.sock.recv_into(inbox)
                except (BlockingIOError, InterruptedError):
                    return []
                except OSError as exc:
                    log.debug("connection to %s failed: %s", link.address, exc)
            data = inbox[:n].tobytes() if n > 0 else None
        if data is None:
            if n == 0:
                log.debug("%s closed the connection", link.address)
            self._drop(link)  # the next send connects again
            return []
        reader = link.reader
        payloads = reader.feed(data)
        if self._busy_poll:
            self._busy_until = time.monotonic() + self._busy_poll
        if reader.error is not None:
            quiet(log).warning(
                "not rd2h tcp", link.address, "closed the connection to %s: it sent %s (is it a zmq endpoint? "
                "both ends must use the same control channel)", link.address, reader.error,
            )  # fmt: skip
        return payloads

    def wakeup(self) -> None:
        """Make a ``recv`` blocked in another thread return ``None`` now. Thread-safe."""
        self._wake.wake()

    def disconnect(self, address: str) -> None:
        """Close the connection to ``address``, dropping what waits for it and a failure not yet
        raised. Unknown: no-op. Thread-safe."""
        with self._lock:
            link = self._links.get(address)
            if link is not None:
                self._unlist(link)
            self._failed.pop(address, None)
            self._ready = deque(item for item in self._ready if item[0] != address)
        if link is not None:
            with link.lock:
                link.shut()

    def _drop(self, link: Link) -> None:
        with self._lock:
            if self._links.get(link.address) is link:
                self._unlist(link)
        with link.lock:
            link.shut()

    def _unlist(self, link: Link) -> None:  # under the lock
        del self._links[link.address]
        if self._by_fd.get(link.fd) is link:  # a closed link's fd may be another's now
            del self._by_fd[link.fd]
        self._changed()

    def _changed(self) -> None:  # under the lock
        self._version += 1
        self._wake.kick()  # a recv in another thread waits on the new set of connections

    def close(self) -> None:
        """Close every connection. What was written is delivered by the kernel (a normal close,
        not a reset); what still waits in an outbox gets one last write, the rest is dropped
        (its Decode was not reading). Call it once no other thread uses the dialer."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            links = list(self._links.values())
            self._links.clear()
            self._by_fd.clear()
        self._writer.close()
        now = time.monotonic()
        for link in links:
            with link.lock:
                if not link.closed:
                    link.flush(now)
                if link.outbox:
                    log.debug("closing: %d frames to %s dropped unwritten", len(link.outbox), link.address)
                link.shut()
        self._wake.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ChannelError("dialer is closed")
