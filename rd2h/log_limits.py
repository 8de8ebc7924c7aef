"""How often a repeated warning is logged (pure: no logging, no threads, no clock reads).

A peer can make a runtime warn once per message it sends: a flood of malformed frames or of
replies that cannot be delivered once produced 215,787 lines in one run. :class:`LogLimiter`
decides, per *(reason, peer)*, which occurrences become a log line:

- the first occurrence of a key is logged at once;
- later ones within ``interval`` seconds of the key's last line are only counted;
- the first occurrence after that is logged with the count of those not logged since the
  key's previous line; a count whose interval ran out with no such occurrence is logged as
  its last occurrence with the count of the others (:meth:`LogLimiter.due`). Nothing goes
  unreported, only unrepeated.

So each key costs at most one line per interval however fast its peer sends, and a key's
lines plus the counts they carry add up to every occurrence. Keys are bounded too: past
``max_keys``, a new peer's occurrences are counted under ``(reason, OTHER_PEERS)``, so a
flood of identities costs one key per reason. Keys idle for an interval are forgotten.

Every call takes ``now`` (seconds, any monotonic origin); :class:`rd2h.quiet_log.QuietLog`
feeds it a clock and writes the lines.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

__all__ = ["OTHER_PEERS", "Line", "LogLimiter"]

OTHER_PEERS = "<other peers>"  # the peer of every key that did not fit under max_keys


@dataclass(frozen=True, slots=True)
class Line:
    """One occurrence to log now, and the ``suppressed`` occurrences of its key that were not
    logged in the ``seconds`` since the key's previous line. ``detail`` is what the caller
    passed with the occurrence."""

    reason: str
    peer: Hashable
    suppressed: int
    seconds: float
    detail: object = None


@dataclass(slots=True)
class _Key:
    logged_at: float  # when its last line was written
    pending: int = 0  # occurrences since then that were not logged
    detail: object = None  # the last pending occurrence's detail


class LogLimiter:
    """Per *(reason, peer)*: at most one line per ``interval`` seconds, with counts.

    Raises ValueError for an interval that is not positive or ``max_keys`` below 1.
    """

    def __init__(self, interval: float = 10.0, max_keys: int = 1024) -> None:
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not interval > 0:
            raise ValueError(f"interval must be a positive number of seconds, got {interval!r}")
        if isinstance(max_keys, bool) or not isinstance(max_keys, int) or max_keys < 1:
            raise ValueError(f"max_keys must be a positive int, got {max_keys!r}")
        self.interval = float(interval)
        self.max_keys = max_keys
        self._keys: dict[tuple[str, Hashable], _Key] = {}
        self._next_due = float("inf")  # no key can be due before this: due() is O(1) until then
        self.suppressed = 0  # occurrences counted and not (yet) logged, over the limiter's life

    def __len__(self) -> int:
        return len(self._keys)

    def hit(self, reason: str, peer: Hashable, now: float, detail: object = None) -> Line | None:
        """One occurrence: the line to log now, or None when it is only counted."""
        key = (reason, peer)
        entry = self._keys.get(key)
        if entry is None and len(self._keys) >= self.max_keys:
            peer = OTHER_PEERS  # bounded memory whatever the number of peers
            key = (reason, peer)
            entry = self._keys.get(key)
        if entry is None:
            self._keys[key] = _Key(now)
            self._next_due = min(self._next_due, now + self.interval)
            return Line(reason, peer, 0, 0.0, detail)
        if now - entry.logged_at < self.interval:
            entry.pending += 1
            entry.detail = detail
            self.suppressed += 1
            return None
        line = Line(reason, peer, entry.pending, now - entry.logged_at, detail)
        self.suppressed -= entry.pending
        entry.logged_at, entry.pending, entry.detail = now, 0, None
        self._next_due = min(self._next_due, now + self.interval)
        return line

    def due(self, now: float) -> list[Line]:
        """Counts whose interval ran out with no occurrence to carry them: one line per key
        (``detail`` is its last occurrence's). Keys idle for an interval are forgotten."""
        if now < self._next_due:
            return []
        lines: list[Line] = []
        next_due = float("inf")
        for key, entry in list(self._keys.items()):
            ends = entry.logged_at + self.interval
            if now < ends:
                next_due = min(next_due, ends)
            elif entry.pending:
                # the line is the last occurrence counted; it carries the others' count
                lines.append(Line(key[0], key[1], entry.pending - 1, now - entry.logged_at, entry.detail))
                self.suppressed -= entry.pending
                entry.logged_at, entry.pending, entry.detail = now, 0, None
                next_due = min(next_due, now + self.interval)
            else:  # quiet for a whole interval: its next occurrence is a first one again
                del self._keys[key]
        self._next_due = next_due
        return lines
