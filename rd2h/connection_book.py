"""Which connections of a channel's listener to close: pure bookkeeping, no sockets.

Shared by the channels whose listener pays for each connection (an fd): the zmq channel
(``rd2h_zmq.connection_watch`` feeds it libzmq's monitor events) and the tcp channel (its
listener owns the sockets). A channel plugin uses it from here, never from another plugin.

A zmq ROUTER accepts every connection and keeps it (and its fd) for as long as the peer does;
a DEALER reconnects by itself. So the bound is a policy over the connections open now:
connections that do not carry a peer Decode admitted (``vouch``) are capped. Past a quarter
of the cap (``soft``) the book closes those that had their chance: refused, forgotten or
replaced ones, and those silent for ``grace`` seconds (a Prefill's first message may still
be on its way: a burst of connections delays libzmq's handshakes). Past the cap itself
(``max_unadmitted``) it closes one whatever its age. Which one is chosen so that strangers
pay before anyone else:

1. from the *source* (the peer's host; for ipc, its process) holding the most such
   connections: a flood from one host never closes another host's connection;
2. within it, by class: connections whose peer Decode refused or forgot (``disown``) and
   connections whose identity moved to a newer connection (a reconnect with the same
   routing id leaves the old one open and unroutable) go first; then connections that
   never carried a message; then those whose peer spoke and is still being decided (a
   Prefill in its handshake, whose replies must not be lost);
3. within a class, the one there longest.

A connection carrying a vouched identity is never chosen. The glue (the listener) feeds it
each accepted and closed connection and the source fd of each message, and closes what
``next_to_close`` returns.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field

__all__ = ["Connection", "ConnectionBook", "Standing"]

REMEMBER_DISOWNED = 4096  # identities remembered as disowned (their reconnections go first)


class Standing(enum.IntEnum):
    """Where a connection stands; the order is the order in which they are closed."""

    DISOWNED = 0  # its peer was refused or forgotten, or its identity moved to another connection
    SILENT = 1  # no message carried yet
    UNDECIDED = 2  # its peer spoke; Decode has not admitted or refused it yet
    VOUCHED = 3  # its peer is admitted: never closed
    CLOSING = 4  # chosen and closed; waiting for libzmq to report it gone


_CAPPED = (Standing.DISOWNED, Standing.SILENT, Standing.UNDECIDED)


@dataclass(eq=False, slots=True)
class Connection:
    fd: int
    source: Hashable
    check: object  # what the glue compares before closing (the fd may have been reused)
    seq: int  # accepted after every connection with a lower one
    since: float = 0.0  # when it took its standing
    identity: bytes | None = None
    standing: Standing = Standing.SILENT


@dataclass(slots=True)
class _Source:
    # per capped standing: fd -> connection, oldest first
    queues: tuple[OrderedDict[int, Connection], ...] = field(
        default_factory=lambda: tuple(OrderedDict() for _ in _CAPPED)
    )
    count: int = 0


class ConnectionBook:
    """The connections of one listener and which to close. Not thread-safe: the listener's
    thread owns it. ``max_unadmitted`` must be a positive int and ``grace`` a number of
    seconds >= 0 (ValueError otherwise). Times are the caller's clock, in seconds."""

    def __init__(
        self, max_unadmitted: int, grace: float = 1.0, remember_disowned: int = REMEMBER_DISOWNED
    ) -> None:
        if isinstance(max_unadmitted, bool) or not isinstance(max_unadmitted, int) or max_unadmitted <= 0:
            raise ValueError(f"max_unadmitted must be a positive int, got {max_unadmitted!r}")
        if not grace >= 0:
            raise ValueError(f"grace must be a number of seconds >= 0, got {grace!r}")
        self.max_unadmitted = max_unadmitted
        self.soft = max(1, max_unadmitted // 4)
        self.grace = grace
        self._remember = remember_disowned
        self._by_fd: dict[int, Connection] = {}
        self._carrier: dict[bytes, int] = {}  # identity -> fd of the connection it came over last
        self._vouched: set[bytes] = set()
        self._disowned: OrderedDict[bytes, None] = OrderedDict()
        self._sources: dict[Hashable, _Source] = {}
        self.unadmitted = 0  # connections in a capped standing
        self.last_seq = 0  # of the connection accepted last

    # -- what happened -------------------------------------------------------------------

    def accepted(self, fd: int, source: Hashable, check: object, now: float) -> None:
        """libzmq accepted a connection on ``fd``."""
        if fd in self._by_fd:  # closed without an event; the number is reused
            self.closed(fd)
        self.last_seq += 1
        conn = self._by_fd[fd] = Connection(fd, source, check, self.last_seq, now)
        self._enter(conn, Standing.SILENT)

    def closed(self, fd: int) -> None:
        """The connection on ``fd`` is gone (libzmq reported it, or it failed its check)."""
        conn = self._by_fd.pop(fd, None)
        if conn is None:
            return
        self._leave(conn)
        if conn.identity is not None and self._carrier.get(conn.identity) == fd:
            del self._carrier[conn.identity]

    def carried(self, fd: int, identity: bytes, now: float) -> None:
        """A message from ``identity`` arrived over ``fd``. Cheap when nothing changes: it
        runs for every message."""
        conn = self._by_fd.get(fd)
        if conn is None or conn.identity == identity or conn.standing is Standing.CLOSING:
            return
        if conn.identity is not None and self._carrier.get(conn.identity) == fd:
            del self._carrier[conn.identity]
        previous = self._carrier.get(identity)
        if previous is not None:  # the identity moved here: the old connection is a leftover
            old = self._by_fd.get(previous)
            if old is not None:
                old.identity = None
                if old.standing is not Standing.CLOSING:
                    self._move(old, Standing.DISOWNED, now)
        self._carrier[identity] = fd
        conn.identity = identity
        self._move(conn, self._standing_of(identity), now)

    def vouch(self, identity: bytes, now: float) -> None:
        """Decode admitted ``identity``: the connection carrying it is never closed."""
        self._vouched.add(identity)
        self._disowned.pop(identity, None)
        self._restand(identity, now)

    def disown(self, identity: bytes, now: float) -> None:
        """Decode refused or forgot ``identity``: its connection (and any reconnection with
        the same identity) is among the first closed."""
        self._vouched.discard(identity)
        self._disowned[identity] = None
        self._disowned.move_to_end(identity)
        while len(self._disowned) > self._remember:
            self._disowned.popitem(last=False)
        self._restand(identity, now)

    # -- what to do ----------------------------------------------------------------------

    def peek(self, now: float) -> Connection | None:
        """The connection ``next_to_close`` would close now, or None."""
        if self.unadmitted <= self.soft:
            return None
        source = max(self._sources.values(), key=lambda s: s.count)  # the biggest holder pays
        conn = next(iter(next(queue for queue in source.queues if queue).values()))
        if self.unadmitted > self.max_unadmitted:
            return conn  # the bound itself: whatever its age
        if conn.standing is Standing.DISOWNED:
            return conn
        if conn.standing is Standing.SILENT and now - conn.since >= self.grace:
            return conn
        return None  # a peer still deciding, or one whose first message may be on its way

    def next_to_close(self, now: float) -> tuple[Connection, Standing] | None:
        """The connection to close now (marked CLOSING) and the standing it had, or None."""
        conn = self.peek(now)
        if conn is None:
            return None
        was = conn.standing
        self._move(conn, Standing.CLOSING, now)
        return conn, was

    def standing(self, fd: int) -> Standing | None:
        conn = self._by_fd.get(fd)
        return None if conn is None else conn.standing

    def connection(self, fd: int) -> Connection | None:
        return self._by_fd.get(fd)

    def __len__(self) -> int:
        return len(self._by_fd)

    def counts(self) -> dict[Standing, int]:
        counts = dict.fromkeys(Standing, 0)
        for conn in self._by_fd.values():
            counts[conn.standing] += 1
        return counts

    # -- internals -----------------------------------------------------------------------

    def _standing_of(self, identity: bytes) -> Standing:
        if identity in self._vouched:
            return Standing.VOUCHED
        if identity in self._disowned:
            return Standing.DISOWNED
        return Standing.UNDECIDED

    def _restand(self, identity: bytes, now: float) -> None:
        fd = self._carrier.get(identity)
        conn = None if fd is None else self._by_fd.get(fd)
        if conn is not None and conn.standing is not Standing.CLOSING:
            self._move(conn, self._standing_of(identity), now)

    def _move(self, conn: Connection, standing: Standing, now: float) -> None:
        if conn.standing is standing:
            return
        self._leave(conn)
        conn.since = now
        self._enter(conn, standing)

    def _enter(self, conn: Connection, standing: Standing) -> None:
        conn.standing = standing
        if standing not in _CAPPED:
            return
        source = self._sources.get(conn.source)
        if source is None:
            source = self._sources[conn.source] = _Source()
        source.queues[standing][conn.fd] = conn
        source.count += 1
        self.unadmitted += 1

    def _leave(self, conn: Connection) -> None:
        if conn.standing not in _CAPPED:
            return
        source = self._sources[conn.source]
        del source.queues[conn.standing][conn.fd]
        source.count -= 1
        self.unadmitted -= 1
        if source.count == 0:
            del self._sources[conn.source]
