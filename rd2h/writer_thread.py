"""The thread a dialer writes waiting frames on: one per dialer, started when a frame first waits.

A dialer's send writes on the calling thread while its connection's socket takes the bytes;
what the socket has no room for waits in that connection's outbox, and the connection joins
this thread's set (``add``) until its outbox is empty again (``discard``). The thread waits in
``poll`` on the connections' fds and on a ``WakePipe`` (``kick``: look again now), at most
until the earliest connection's ``deadline`` (when its head frame must have left), and then
hands each connection in the set to the backend's ``serve`` (write what it can, fail what
waited too long). ``close`` stops the thread; what waits stays in the connections.
``serve`` reports a connection to drop as ``LATE`` (a frame waited past ``send_timeout``) or
``BROKEN`` (the socket failed); the dialer keeps why it failed a ``LATE`` one for its
``take_failures`` (``FailureReport``) or the next send there, whichever comes first.

Locks: the writer's own lock covers its set and starting the thread. It is taken under a
connection's lock (``add``/``discard`` from the connection's own calls), never the other way:
the thread holds no lock of its own while it serves a connection.
"""

from __future__ import annotations

import abc
import math
import select
import threading
import time
from typing import Generic, Protocol, TypeVar

from rd2h.wake_pipe import WakePipe

__all__ = ["BROKEN", "LATE", "Drained", "FailureReport", "WriterThread"]

LATE = "late"  # a frame waited past send_timeout
BROKEN = "broken"  # the socket failed


class Drained(Protocol):
    """A connection the writer drains: an fd to poll and when its head frame must have left."""

    fd: int
    deadline: float


C = TypeVar("C", bound=Drained)


class WriterThread(abc.ABC, Generic[C]):
    """The set of connections with frames waiting, and the thread that serves them.

    ``events``: what to poll each connection's fd for; ``look_again``: seconds the thread waits
    at most while connections are in the set (None: until the earliest deadline), for an fd
    whose signal may be consumed elsewhere."""

    def __init__(self, name: str, events: int, look_again: float | None = None) -> None:
        self._name = name
        self._events = events
        self._look_again = look_again
        self._lock = threading.Lock()  # the set below, and starting the thread
        self._connections: set[C] = set()
        self._wake = WakePipe()
        self._thread: threading.Thread | None = None
        self._closed = False

    @abc.abstractmethod
    def serve(self, connection: C, now: float) -> None:
        """Write what waits on ``connection`` and report what failed; called on the thread,
        with no lock held, for each connection in the set after each wait."""

    def add(self, connection: C) -> None:  # under the connection's lock
        """Drain ``connection`` from now on (the thread starts with the first one)."""
        with self._lock:
            if self._closed:
                return
            self._connections.add(connection)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        self._wake.kick()

    def discard(self, connection: C) -> None:  # under the connection's lock
        with self._lock:
            self._connections.discard(connection)

    def kick(self) -> None:
        """Look at every connection again now."""
        self._wake.kick()

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
                connections = list(self._connections)
            self._wait(connections)
            now = time.monotonic()
            for connection in connections:
                self.serve(connection, now)

    def _wait(self, connections: list[C]) -> None:
        """Until a connection's fd signals, a kick, or the earliest deadline (or look_again)."""
        poller = select.poll()
        poller.register(self._wake.fd, select.POLLIN)
        timeout = -1
        if connections:
            for connection in connections:
                poller.register(connection.fd, self._events)
            left = min(c.deadline for c in connections) - time.monotonic()
            if self._look_again is not None:
                left = min(self._look_again, left)
            timeout = max(0, math.ceil(left * 1000))
        poller.poll(timeout)
        self._wake.drain()

    def close(self) -> None:
        """Stop the thread (what waits stays in the connections)."""
        with self._lock:
            self._closed = True
            thread = self._thread
        self._wake.kick()
        if thread is not None:
            thread.join()
        self._wake.close()


class FailureReport:
    """``Dialer.take_failures`` for a dialer that keeps the connections its writer failed
    (``LATE``) and no send has raised yet in ``_failed`` (address: why), under its ``_lock``."""

    _failed: dict[str, str]
    _lock: threading.Lock

    def take_failures(self) -> dict[str, str]:
        """Connections failed since the last call, with why; consumed. Thread-safe."""
        if not self._failed:  # the Prefill asks on every turn: no lock while there is none
            return {}
        with self._lock:
            failures, self._failed = self._failed, {}
        return failures
