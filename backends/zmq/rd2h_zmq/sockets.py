"""The ROUTER listener and the DEALER dialer (their shared context is in ``context``).

Framing (as the reference implementation does it, so either side can talk to its peers):
a sender puts one payload frame on the wire; a listener replies ``(identity, b"", payload)``;
receivers skip empty delimiter frames. A message with more than one non-empty frame is
not ours and is dropped with a warning.

Identity: without CURVE a listener names a peer by its routing id. With CURVE it names it
by the client's public key (Z85, 40 bytes) followed by the routing id, so a peer holding
another key that takes over a routing id (ROUTER_HANDOVER) is another peer to Decode.
Handover stays on: with it off, libzmq refuses a reconnect that races the old connection's
close and eats its first frame (measured: one reconnect in three lost its mf_meta).

Threads: zmq sockets are not thread-safe. A listener belongs to the one thread that runs
its loop; ``close()`` it from that thread, or from another once that loop has stopped. A
dialer uses each socket under that connection's own lock, so a Prefill can announce from the
compute thread while its sender thread waits for replies, and a Decode that does not read
delays no other (see ``ZmqDialer`` and ``rd2h_zmq.outbox``). The shared context itself is
thread-safe.
"""

from __future__ import annotations

import errno
import logging
import secrets
import select
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, ClassVar

import zmq

from rd2h.errors import ChannelError, FrameTooLargeError, PortInUseError
from rd2h.interfaces import Dialer, Listener
from rd2h.quiet_log import quiet
from rd2h.wake_pipe import WakePipe
from rd2h_zmq.connection_watch import ConnectionWatch
from rd2h_zmq.context import SharedContext
from rd2h_zmq.outbox import LATE, Connection, FailureReport, Writer
from rd2h_zmq.settings import Settings

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["SharedContext", "ZmqListener", "ZmqDialer"]

log = logging.getLogger("rd2h_zmq")

# libzmq compares ZMQ_MAXMSGSIZE with the frame on the wire, which under CURVE carries a
# box header and MAC; leave room for it so a payload of exactly max_frame_bytes passes.
_WIRE_OVERHEAD = 256
_CLOSE_LINGER_MS = 500  # what a closing dialer gives its queued frames to leave
_UNBIND_WAIT = 1.0  # seconds close() waits for libzmq to release a listening port
_KEY_BYTES = 40  # a Z85 CURVE public key, as libzmq's ZAP handler names the peer (User-Id)
# what a listener reads ahead of its loop to learn which connections spoke (connection_watch)
_READ_AHEAD_FRAMES = 1024
_READ_AHEAD_BYTES = 64 << 20


def _check_frame(payload: bytes, limit: int) -> int:
    size = memoryview(payload).nbytes
    if size > limit:
        raise FrameTooLargeError(f"frame of {size} bytes is above max_frame_bytes={limit}")
    if size == 0:
        # Receivers skip empty frames (they are delimiters), so an empty payload would vanish.
        raise ValueError("payload must not be empty")
    return size


def _payload(frames: Sequence[bytes], source: object) -> bytes | None:
    """The one non-empty frame of a message, or None (delimiters only, or not our framing)."""
    parts = [frame for frame in frames if frame]
    if len(parts) == 1:
        return parts[0]
    if parts:
        quiet(log).warning(
            "not one frame", source, "dropped a %d-part message from %r: expected one payload frame", len(parts), source
        )
    return None


def _common_options(sock: zmq.Socket[bytes], settings: Settings, address: str, receive_hwm: int | None = None) -> None:
    if "[" in address:
        sock.setsockopt(zmq.IPV6, 1)  # a bracketed IPv6 literal; plain IPv4 stays IPv4-only
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, settings.high_water_mark)
    sock.setsockopt(zmq.RCVHWM, settings.high_water_mark if receive_hwm is None else receive_hwm)
    sock.setsockopt(zmq.SNDTIMEO, settings.send_timeout_ms)
    sock.setsockopt(zmq.MAXMSGSIZE, settings.max_frame_bytes + _WIRE_OVERHEAD)


def _deadline_ms(deadline: float) -> int:
    return max(0, round((deadline - time.monotonic()) * 1000))


def _wait_readable(poller: select.poll, timeout_ms: int) -> list[tuple[int, int]]:
    """Block in ``poll`` (its own frame, so a sampling profiler can tell waiting from work)."""
    return poller.poll(timeout_ms)


class ZmqListener(Listener):
    """A ROUTER bound at construction. ``recv`` yields ``(identity, payload)``; ``send``
    replies ``(identity, b"", payload)`` and raises ``ChannelError`` if the peer is gone.

    ``send`` never blocks: each peer has its own queue of ``high_water_mark`` frames, and a
    reply to a peer whose queue is full (it does not read) is dropped, counted in
    ``dropped`` and raised as ``ChannelError``; other peers are not slowed. A peer may queue
    ``receive_high_water_mark`` frames here (bounded bytes, see ``max_queued_bytes``).

    Connections are bounded too (``rd2h_zmq.connection_watch``): the listener watches every
    connection libzmq accepts and the connection each message came over, and keeps at most
    ``max_unadmitted_connections`` that carry no peer Decode admitted (``vouch``), shutting
    strangers' down first (``rd2h.connection_book``). A
    vouched peer's connection is never shut. ``vouch`` and ``disown`` run on the listener's
    thread, like ``recv``."""

    def __init__(self, settings: Settings, shared: SharedContext, address: str) -> None:
        self._settings = settings
        self._shared = shared
        self._closed = False
        self.dropped = 0  # replies dropped because the peer's queue was full
        curve = settings.curve
        self._curve = curve is not None
        context = shared.acquire(authenticate=curve is not None)
        sock = context.socket(zmq.ROUTER)
        try:
            _common_options(sock, settings, address, settings.receive_high_water_mark)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unknown peer: EHOSTUNREACH, not silence
            sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting dialer takes its identity back
            if curve is not None:
                sock.curve_secretkey = curve.secret
                sock.curve_publickey = curve.public
                sock.curve_server = True
            sock.bind(address)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            shared.release()
            if exc.errno == zmq.EADDRINUSE:
                raise PortInUseError(errno.EADDRINUSE, f"cannot listen on {address}: address already in use") from exc
            raise ChannelError(f"cannot listen on {address}: {exc.strerror}") from exc
        except BaseException:
            sock.close(linger=0)
            shared.release()
            raise
        self._sock = sock
        self._address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._poller = zmq.Poller()
        self._poller.register(sock, zmq.POLLIN)
        self._early: deque[tuple[tuple[bytes, bytes], int]] = deque()  # read ahead: (item, size)
        self._early_bytes = 0
        # inproc connections hold no fd, and libzmq reports none of them
        self._watch = None
        if not self._address.startswith("inproc://"):
            self._watch = ConnectionWatch(
                sock, settings.max_unadmitted_connections, self._address, self._read_waiting
            )
            self._poller.register(self._watch.monitor, zmq.POLLIN)

    @property
    def address(self) -> str:
        return self._address

    def recv(self, timeout: float) -> tuple[bytes, bytes] | None:
        self._check_open()
        deadline = time.monotonic() + max(0.0, timeout)
        watch = self._watch
        while True:
            if self._early:  # read ahead by the watch, before closing a silent connection
                item, size = self._early.popleft()
                self._early_bytes -= size
                return item
            ready = self._poller.poll(_deadline_ms(deadline))
            if watch is not None:
                watch.drain()  # first: a message's fd is then known (accepted before it came)
            if ready or self._early:
                item = self._take()
                if item is not None:
                    return item
            if time.monotonic() >= deadline:
                return None

    def _take(self) -> tuple[bytes, bytes] | None:
        """The next message read ahead or waiting with one payload, or None if none is."""
        if self._early:
            item, size = self._early.popleft()
            self._early_bytes -= size
            return item
        while True:
            try:
                item = self._read()
            except zmq.Again:
                return None
            if item is not None:
                return item

    def _read_waiting(self) -> None:
        """Read ahead what is waiting (bounded), so the watch learns which connections spoke."""
        while len(self._early) < _READ_AHEAD_FRAMES and self._early_bytes < _READ_AHEAD_BYTES:
            try:
                item = self._read()
            except zmq.Again:
                return
            if item is not None:
                size = len(item[1])
                self._early.append((item, size))
                self._early_bytes += size

    def _read(self) -> tuple[bytes, bytes] | None:
        """One message from the ROUTER: ``(identity, payload)``, or None if it is dropped.
        Raises ``zmq.Again`` when none is waiting."""
        # Frames, not bytes: each names the connection it came over (ZMQ_SRCFD).
        frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
        routing_id = frames[0].bytes
        identity = routing_id
        if self._curve:
            key = frames[-1].get("User-Id")  # set by the ZAP handler: the client's public key
            if not isinstance(key, str) or len(key) != _KEY_BYTES:
                quiet(log).warning("no key", routing_id, "dropped a frame from %r without a CURVE key", routing_id)
                return None
            identity = key.encode("ascii") + routing_id
        if self._watch is not None:
            self._watch.carried(frames[-1].get(zmq.SRCFD), identity)
        payload = _payload([f.bytes for f in frames[1:]], routing_id)
        return None if payload is None else (identity, payload)

    def vouch(self, peer: bytes) -> None:
        """Decode admitted ``peer``: its connection is never closed to bound the others."""
        if self._watch is not None:
            self._watch.vouch(peer)

    def disown(self, peer: bytes) -> None:
        """Decode refused or forgot ``peer``: its connection is among the first closed once
        more than ``max_unadmitted_connections`` carry no admitted peer."""
        if self._watch is not None:
            self._watch.disown(peer)

    @property
    def connections_closed(self) -> int:
        """Connections this listener shut because they were over the bound."""
        return 0 if self._watch is None else self._watch.closed

    def connections(self) -> dict[str, int]:
        """The connections open now by standing (``vouched``, ``undecided``, ``silent``,
        ``disowned``, ``closing``); empty for inproc, which has none."""
        return {} if self._watch is None else self._watch.counts()

    def peer_key(self, peer: bytes) -> str | None:
        """The CURVE public key (Z85) the peer authenticated with; None without CURVE."""
        return peer[:_KEY_BYTES].decode("ascii") if self._curve else None

    def send(self, peer: bytes, payload: bytes) -> None:
        self._check_open()
        _check_frame(payload, self._settings.max_frame_bytes)
        routing_id = peer[_KEY_BYTES:] if self._curve else peer
        try:
            # Never block: this is Decode's only loop thread, and one peer that does not read
            # must not delay the replies to every other peer.
            self._sock.send_multipart([routing_id, b"", payload], flags=zmq.NOBLOCK, copy=False)
        except zmq.Again as exc:
            self.dropped += 1
            raise ChannelError(
                f"reply to peer {peer!r} on {self._address} dropped: it has {self._settings.high_water_mark} "
                f"frames queued and reads none ({self.dropped} dropped so far)"
            ) from exc
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                raise ChannelError(f"peer {peer!r} is not connected to {self._address}") from exc
            raise ChannelError(f"send to {peer!r} on {self._address} failed: {exc.strerror}") from exc

    def close(self) -> None:
        """Unbind and close. The port is free for a new ``listen`` when this returns."""
        if self._closed:
            return
        self._closed = True
        self._poller.unregister(self._sock)
        self._unbind()
        self._sock.close(linger=0)
        self._shared.release()

    def _unbind(self) -> None:
        # libzmq closes a listening socket later, on its I/O thread; while other sockets keep
        # the context alive, a re-listen on this address right after close() would race it.
        # Unbind and wait (bounded) for the monitor to report the listening fd closed.
        watch = self._watch
        if watch is None:
            return  # inproc endpoints are released synchronously
        self._poller.unregister(watch.monitor)
        try:
            self._sock.unbind(self._address)
            if not watch.wait_closed(self._address, _UNBIND_WAIT):
                log.warning("listening socket %s not reported closed within %.1f s", self._address, _UNBIND_WAIT)
        except zmq.ZMQError as exc:
            log.debug("unbind %s: %s", self._address, exc)
        finally:
            watch.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ChannelError(f"listener on {self._address} is closed")


class ZmqDialer(FailureReport, Dialer):
    """One DEALER per Decode address, connected on first send. Its routing id is fixed for
    the dialer's life, so a reconnect after ``disconnect`` is the same peer to the listener.

    ``send`` and ``disconnect`` may be called from any thread while another blocks in
    ``recv`` (``concurrent_send``): a lock covers the table only, each socket is used under its
    connection's own lock, and ``recv`` waits outside every lock on the sockets' notification
    fds (``zmq.FD``). Such an fd only says "look again" and any call may consume it, so whoever
    finds a message waiting kicks the waiting ``recv`` through a pipe. A send never waits for a
    Decode, and one whose frame waited ``send_timeout`` is failed alone (``rd2h_zmq.outbox``),
    reported once: by ``take_failures``, or by the next send to it raising ``ChannelError``."""

    concurrent_send: ClassVar[bool] = True

    def __init__(self, settings: Settings, shared: SharedContext) -> None:
        self._settings = settings
        self._shared = shared
        self._context = shared.acquire(authenticate=False)
        self._closed = False
        self._routing_id = b"rd2h-" + secrets.token_hex(8).encode()
        self._lock = threading.Lock()  # the tables below, never a socket call
        self._connections: dict[str, Connection] = {}
        self._failed: dict[str, str] = {}  # why a connection was failed, for the next send there
        self._fds: tuple[int, ...] = ()  # the sockets' notification fds, rebuilt on (dis)connect
        # recv's thread only: the poll set it waits on, and the fds it was made for
        self._poller = select.poll()
        self._polled: tuple[int, ...] | None = None
        self._next = 0  # where recv starts looking, so one busy endpoint cannot starve others
        # A kick makes a blocked recv look again; it returns None only when ``wakeup()``
        # asked for that, not for a kick from a send.
        self._wake = WakePipe()
        self._writer = Writer(self._failed_connection, self._wake.kick)

    @property
    def routing_id(self) -> bytes:
        return self._routing_id

    def send(self, address: str, payload: bytes) -> None:
        """Queue one frame for ``address``. Raises ``FrameTooLargeError``, ``ChannelError`` for
        a malformed address, a connection failed since the last send (see the class) or one
        whose outbox is full. Thread-safe; never waits for another connection's Decode."""
        _check_frame(payload, self._settings.max_frame_bytes)
        while True:
            with self._lock:
                self._check_open()
                failure = self._failed.pop(address, None)
                if failure is not None:
                    raise ChannelError(failure)
                connection = self._connections.get(address) or self._connect(address)
            try:
                with connection.lock:
                    if connection.closed:  # dropped by another thread meanwhile: connect again
                        continue
                    connection.send(payload)
                    # the send may have consumed the fd's signal of a reply that arrived meanwhile
                    waiting = connection.look()
            except ChannelError:
                with self._lock:
                    self._take(connection)  # a full outbox shut it
                self._wake.kick()
                raise
            if waiting:
                self._wake.kick()
            return

    def waiting(self, address: str) -> int:
        """Frames ``send`` took for ``address`` that wait for room in libzmq's queue (0: none)."""
        with self._lock:
            connection = self._connections.get(address)
        if connection is None:
            return 0
        with connection.lock:
            return len(connection.outbox)

    def recv(self, timeout: float) -> tuple[str, bytes] | None:
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            with self._lock:
                self._check_open()
                order = list(self._connections.values())
                if self._fds != self._polled:  # a socket came or went: wait on the new set
                    self._polled = self._fds
                    self._poller = select.poll()
                    for fd in (*self._fds, self._wake.fd):
                        self._poller.register(fd, select.POLLIN)
            item = self._take_waiting(order)
            if item is not None:
                return item
            ready = _wait_readable(self._poller, _deadline_ms(deadline))
            if any(fd == self._wake.fd for fd, _ in ready):
                if self._wake.drain():
                    return None
            elif not ready and time.monotonic() >= deadline:
                return None

    def _take_waiting(self, order: list[Connection]) -> tuple[str, bytes] | None:
        """The next message waiting on any socket, round robin."""
        for step in range(len(order)):
            index = (self._next + step) % len(order)
            connection = order[index]
            with connection.lock:
                while not connection.closed and connection.look():
                    try:
                        frames = connection.sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    payload = _payload(frames, connection.address)
                    if payload is not None:
                        self._next = index + 1
                        return connection.address, payload
        return None

    def wakeup(self) -> None:
        """Make a ``recv`` blocked in another thread return ``None`` now. Thread-safe."""
        self._wake.wake()

    def disconnect(self, address: str) -> None:
        """Close the connection to ``address``, dropping what is queued and a failure not yet
        raised. Unknown: no-op. Thread-safe."""
        with self._lock:
            self._failed.pop(address, None)
            connection = self._take(self._connections.get(address))
        if connection is not None:
            self._wake.kick()  # a recv waiting on the closed socket's fd looks at the new set
            with connection.lock:
                connection.shut()

    def _failed_connection(self, connection: Connection, why: str) -> None:
        """The writer found ``connection`` broken, or its head frame past its deadline: drop it,
        and have the next send there raise the latter. One hold of the lock for both, so a
        ``disconnect`` meanwhile drops the failure with the connection, never leaves it behind."""
        with self._lock:
            if self._take(connection) is not None and why == LATE:
                self._failed[connection.address] = (
                    f"cannot send to {connection.address}: {self._settings.high_water_mark} frames are queued and "
                    f"the endpoint took none in {self._settings.send_timeout_ms} ms (is it running?); its "
                    "connection was closed with what waited for it, and the next send connects again"
                )
        (self._wake.wake if why == LATE else self._wake.kick)()  # recv looks again; LATE: returns, to be asked
        with connection.lock:
            connection.shut()

    def _take(self, connection: Connection | None) -> Connection | None:  # under the lock
        """Take ``connection`` out of the table (None: not there); the caller then kicks recv."""
        if connection is None or self._connections.get(connection.address) is not connection:
            return None
        del self._connections[connection.address]
        self._fds = tuple(c.fd for c in self._connections.values())
        return connection

    def close(self) -> None:
        """Close every connection; frames still queued get ``_CLOSE_LINGER_MS`` to leave (the
        last ``settled`` notices are sent just before a Prefill closes), those still in an
        outbox one last try to join them. Call it once no other thread uses the dialer."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            connections = list(self._connections.values())
            self._connections.clear()
            self._fds = ()
        self._writer.close()
        now = time.monotonic()
        for connection in connections:
            with connection.lock:
                if connection.flush(now) is None and connection.outbox:
                    log.debug("closing: %d frames to %s dropped unsent", len(connection.outbox), connection.address)
                connection.shut(_CLOSE_LINGER_MS)
        self._wake.close()
        self._shared.release()

    def _connect(self, address: str) -> Connection:  # under the lock
        sock = self._context.socket(zmq.DEALER)
        try:
            _common_options(sock, self._settings, address)
            sock.setsockopt(zmq.ROUTING_ID, self._routing_id)
            curve = self._settings.curve
            if curve is not None:
                sock.curve_secretkey = curve.secret
                sock.curve_publickey = curve.public
                sock.curve_serverkey = curve.server_public
            sock.connect(address)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise ChannelError(f"cannot connect to {address}: {exc.strerror}") from exc
        except BaseException:
            sock.close(linger=0)
            raise
        connection = Connection(sock, address, self._settings, self._writer)
        self._connections[address] = connection
        self._fds = (*self._fds, connection.fd)
        self._wake.kick()  # a recv in another thread starts waiting on this socket too
        return connection

    def _check_open(self) -> None:
        if self._closed:
            raise ChannelError("dialer is closed")
