"""``memory``: a control channel inside one process, for tests that need no sockets or sleeps.

Addresses are ``memory://name``; ``memory://`` picks a fresh name, as port 0 does for TCP.
Bound names live in one process-wide registry, so any two channel objects of the process
reach each other. It keeps the zmq channel's semantics: a dialer has one identity for its
life; frames sent before a listener binds wait and are delivered when it binds (as zmq's
connect queues them); a restarted listener is reached again by the next send; a reply to a
peer that is not connected raises ``ChannelError``; ``disconnect`` drops what is queued;
``wakeup`` makes a blocked ``recv`` return None. Frames are copied into immutable ``bytes``,
so sender and receiver share nothing. Blocking waits on a Condition: no polling.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from typing import ClassVar, Generic, TypeVar

from rd2h.errors import ChannelError, ConfigError, FrameTooLargeError, PortInUseError
from rd2h.interfaces import ControlChannel, Dialer, Listener

__all__ = ["MemoryChannel", "MemoryListener", "MemoryDialer"]

SCHEME = "memory://"
_BACKLOG = 1000  # frames that may wait for a listener, like zmq's high-water mark
_LOCK = threading.Lock()  # guards the registry and every link between listeners and dialers
_BOUND: dict[str, MemoryListener] = {}
_WAITING: dict[str, set[tuple[MemoryDialer, str]]] = {}  # name -> dialers with frames for it
_IDS = itertools.count(1)
K = TypeVar("K")


def _name(address: str) -> str:
    if not isinstance(address, str) or not address.startswith(SCHEME):
        raise ChannelError(f"memory channel addresses look like {SCHEME}name, got {address!r}")
    return address[len(SCHEME):]


def _frame(payload: bytes, limit: int) -> bytes:
    data = bytes(payload)  # a private, immutable copy (bytes itself is already immutable)
    if len(data) > limit:
        raise FrameTooLargeError(f"frame of {len(data)} bytes is above max_frame_bytes={limit}")
    return data


class _Inbox(Generic[K]):
    """Frames for one receiver, and the wait for them."""

    def __init__(self) -> None:
        self.ready = threading.Condition(threading.Lock())
        self.frames: collections.deque[tuple[K, bytes]] = collections.deque()
        self.woken = self.closed = False

    def put(self, key: K, payload: bytes) -> None:
        with self.ready:
            self.frames.append((key, payload))
            self.ready.notify()

    def get(self, timeout: float, what: str) -> tuple[K, bytes] | None:
        deadline = time.monotonic() + max(0.0, timeout)
        with self.ready:
            while not (self.frames or self.woken or self.closed):
                left = deadline - time.monotonic()
                if left <= 0 or not self.ready.wait(left):
                    break
            if self.closed:
                raise ChannelError(f"{what} is closed")
            if self.woken:
                self.woken = False
                return None
            return self.frames.popleft() if self.frames else None

    def wake(self, *, close: bool = False) -> None:
        with self.ready:
            self.woken, self.closed = True, self.closed or close
            self.ready.notify_all()

    def drop(self, key: K) -> None:
        with self.ready:
            self.frames = collections.deque(f for f in self.frames if f[0] != key)


class MemoryListener(Listener):
    """The Decode end: owns ``memory://name`` until closed."""

    def __init__(self, name: str, max_frame_bytes: int) -> None:
        self._address, self._limit = SCHEME + name, max_frame_bytes
        self._inbox: _Inbox[bytes] = _Inbox()
        self._peers: dict[bytes, tuple[MemoryDialer, str]] = {}  # identity -> (dialer, its address)

    @property
    def address(self) -> str:
        return self._address

    def recv(self, timeout: float) -> tuple[bytes, bytes] | None:
        return self._inbox.get(timeout, f"listener on {self._address}")

    def send(self, peer: bytes, payload: bytes) -> None:
        data = _frame(payload, self._limit)
        with _LOCK:
            if self._inbox.closed:
                raise ChannelError(f"listener on {self._address} is closed")
            link = self._peers.get(peer)
            if link is None:
                raise ChannelError(f"peer {peer!r} is not connected to {self._address}")
            link[0]._deliver(link[1], data)

    def close(self) -> None:
        with _LOCK:
            if _BOUND.get(_name(self._address)) is self:
                del _BOUND[_name(self._address)]
            self._peers.clear()  # dialers notice on their next send and wait for a new listener
        self._inbox.wake(close=True)

    def _deliver(self, dialer: MemoryDialer, address: str, data: bytes) -> None:  # under _LOCK
        if len(data) > self._limit:  # as zmq does: the oversized frame is dropped, the peer cut off
            self._peers.pop(dialer.identity, None)
            dialer._links.pop(address, None)
            return
        self._peers[dialer.identity] = (dialer, address)
        self._inbox.put(dialer.identity, data)


class MemoryDialer(Dialer):
    """The Prefill end: one link per listener address, made on first send. Every link is
    changed under one lock, so sends may come from any thread."""

    concurrent_send: ClassVar[bool] = True

    def __init__(self, max_frame_bytes: int) -> None:
        self.identity = b"memory-%d" % next(_IDS)
        self._limit = max_frame_bytes
        self._inbox: _Inbox[str] = _Inbox()
        self._links: dict[str, MemoryListener] = {}  # address -> the listener instance reached
        self._backlog: dict[str, list[bytes]] = {}  # address -> frames waiting for a listener

    def send(self, address: str, payload: bytes) -> None:
        data, name = _frame(payload, self._limit), _name(address)
        with _LOCK:
            if self._inbox.closed:
                raise ChannelError("dialer is closed")
            listener = _BOUND.get(name)
            if self._links.get(address) is not listener:  # first send, or the listener restarted
                self._links.pop(address, None)
            if listener is None:
                waiting = self._backlog.setdefault(address, [])
                if len(waiting) >= _BACKLOG:
                    raise ChannelError(f"cannot send to {address}: {_BACKLOG} frames wait and nobody listens there")
                waiting.append(data)
                _WAITING.setdefault(name, set()).add((self, address))
                return
            self._links[address] = listener
            listener._deliver(self, address, data)

    def recv(self, timeout: float) -> tuple[str, bytes] | None:
        return self._inbox.get(timeout, "dialer")

    def wakeup(self) -> None:
        self._inbox.wake()

    def disconnect(self, address: str) -> None:
        with _LOCK:
            listener = self._links.pop(address, None)
            link = listener._peers.get(self.identity) if listener is not None else None
            if listener is not None and link is not None and link[1] == address:
                del listener._peers[self.identity]
            self._backlog.pop(address, None)
            if address.startswith(SCHEME):
                _WAITING.get(_name(address), set()).discard((self, address))
        self._inbox.drop(address)

    def close(self) -> None:
        for address in {*self._links, *self._backlog}:
            self.disconnect(address)
        self._inbox.wake(close=True)

    def _deliver(self, address: str, data: bytes) -> None:
        self._inbox.put(address, data)

    def _attach(self, address: str, listener: MemoryListener) -> None:  # under _LOCK
        self._links[address] = listener
        for data in self._backlog.pop(address, ()):
            listener._deliver(self, address, data)


class MemoryChannel(ControlChannel):
    """In-process control channel. Option: ``max_frame_bytes`` (64 MiB), the largest frame
    sent or accepted (``FrameTooLargeError`` on send; an oversized frame arriving is dropped
    and its sender cut off, as zmq does). Anything else raises ``ConfigError``."""

    name: ClassVar[str] = "memory"

    def __init__(self, *, max_frame_bytes: int = 64 << 20, **unknown: object) -> None:
        if unknown:
            raise ConfigError(f"unknown memory channel option(s): {', '.join(sorted(unknown))}; known: max_frame_bytes")
        if isinstance(max_frame_bytes, bool) or not isinstance(max_frame_bytes, int) or max_frame_bytes <= 0:
            raise ConfigError(f"max_frame_bytes must be a positive int, got {max_frame_bytes!r}")
        self._limit = max_frame_bytes

    def listen(self, address: str) -> MemoryListener:
        """Bind ``memory://name`` now (``memory://`` picks a fresh name). Raises PortInUseError."""
        name = _name(address) or f"auto-{next(_IDS)}"
        with _LOCK:
            if name in _BOUND:
                raise PortInUseError(f"{SCHEME}{name} is in use by another listener of this process")
            listener = _BOUND[name] = MemoryListener(name, self._limit)
            for dialer, dialed in _WAITING.pop(name, ()):
                dialer._attach(dialed, listener)
        return listener

    def dialer(self) -> MemoryDialer:
        return MemoryDialer(self._limit)
