"""Warnings a peer can repeat, written at most once per interval per (reason, peer), with counts.

The runtimes and the zmq channel warn about what a peer sends (a malformed frame, a reply that
cannot be delivered, a refused readiness). Each such warning goes through a :class:`QuietLog`:

    quiet(log).warning("malformed", identity, "rank %d: dropped a malformed message from %r: %s",
                       rank, identity, exc)

The first occurrence per *(reason, peer)* is logged as it is; later ones in the same interval
are counted, and the next line of that key says how many were not logged, e.g.
``... (and 48213 more like this in the last 10.0 s)``. A count left when its interval ends is
written by the next call on the same QuietLog, or by :meth:`QuietLog.flush` (loops call it).
The decisions are :class:`rd2h.log_limits.LogLimiter`'s (pure); this module adds the clock, a
lock (several threads warn through one logger) and the logger.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable

from rd2h.clock import Clock, monotonic
from rd2h.log_limits import Line, LogLimiter

__all__ = ["QuietLog", "quiet", "flush_shared", "DEFAULT_INTERVAL"]

DEFAULT_INTERVAL = 10.0  # seconds between two lines of one (reason, peer)
_MORE = " (and %d more like this in the last %.1f s)"


class QuietLog:
    """A logger whose warnings are limited per *(reason, peer)*; see the module's docstring.

    ``interval`` and ``max_keys`` are the :class:`~rd2h.log_limits.LogLimiter`'s (ValueError
    when not positive). Thread-safe.
    """

    def __init__(
        self, logger: logging.Logger, *, interval: float = DEFAULT_INTERVAL, max_keys: int = 1024,
        clock: Clock = monotonic,
    ) -> None:
        self.logger = logger
        self._limiter = LogLimiter(interval, max_keys)
        self.clock = clock  # read once per call; replaceable (a test moves time instead of sleeping)
        self._lock = threading.Lock()

    @property
    def interval(self) -> float:
        return self._limiter.interval

    @property
    def suppressed(self) -> int:
        """Occurrences counted and not yet written in a line's count."""
        with self._lock:
            return self._limiter.suppressed

    def warning(self, reason: str, peer: Hashable, msg: str, *args: object) -> bool:
        """Log ``msg % args`` at WARNING unless its key logged within the interval; whether it did."""
        return self.log(logging.WARNING, reason, peer, msg, *args)

    def error(self, reason: str, peer: Hashable, msg: str, *args: object) -> bool:
        return self.log(logging.ERROR, reason, peer, msg, *args)

    def log(self, level: int, reason: str, peer: Hashable, msg: str, *args: object) -> bool:
        if not self.logger.isEnabledFor(level):
            return False  # nothing would be written: no need to count either
        with self._lock:
            now = self.clock()
            # an exception is kept as its text: its traceback holds the frames of the call that
            # failed, and those a peer's message (up to 16 MiB), for as long as the key lives
            kept = tuple(str(a) if isinstance(a, BaseException) else a for a in args)
            line = self._limiter.hit(reason, peer, now, (level, msg, kept))
            due = self._limiter.due(now)
        for pending in due:
            self._write(pending)
        if line is not None:
            self._write(line)
        return line is not None

    def flush(self) -> int:
        """Write the counts whose interval ran out; how many lines that took."""
        with self._lock:
            due = self._limiter.due(self.clock())
        for line in due:
            self._write(line)
        return len(due)

    def _write(self, line: Line) -> None:
        level, msg, args = line.detail  # type: ignore[misc]
        if line.suppressed:
            self.logger.log(level, msg + _MORE, *args, line.suppressed, line.seconds)
        else:
            self.logger.log(level, msg, *args)


_shared: dict[str, QuietLog] = {}
_shared_lock = threading.Lock()


def quiet(logger: logging.Logger) -> QuietLog:
    """The process's QuietLog for ``logger`` (made on first use, real time, default interval)."""
    found = _shared.get(logger.name)
    if found is None:
        with _shared_lock:
            found = _shared.setdefault(logger.name, QuietLog(logger))
    return found


def flush_shared() -> int:
    """Flush every QuietLog :func:`quiet` made (the runtimes' loops call it on their cadence,
    so a count left at the end of a flood is written even if that logger never warns again);
    how many lines that took."""
    with _shared_lock:
        logs = list(_shared.values())
    return sum(q.flush() for q in logs)
