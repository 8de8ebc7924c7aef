"""Ids a Prefill announced before Decode expected them (Decode side, pure).

A readiness naming an id that is not (yet) expected is refused. When the ``expect`` comes
later (a rendezvous race), Prefill has already failed the request for want of a reply and
will not send its bytes again: the tracker fails it at once instead of letting it wait for
its deadline. The ids are remembered with who announced them (what those peers proved), so
an ``expect`` bound to another Prefill ignores an announcement a stranger made. Bounded in
count and in age: a flood of unknown ids costs at most ``limit`` entries.
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["EarlyAnnouncements"]


class EarlyAnnouncements:
    """Recently refused early ids: ``id -> (first seen, identities its announcers proved)``."""

    def __init__(self, limit: int = 4096, seconds: float = 120.0) -> None:
        self.limit, self.seconds = limit, seconds
        self._ids: OrderedDict[str, tuple[float, frozenset[str]]] = OrderedDict()

    def note(self, ext_id: str, now: float, proven: frozenset[str]) -> None:
        """A peer that proved ``proven`` announced ``ext_id`` before it was expected."""
        earlier = self._ids.get(ext_id)
        self._ids[ext_id] = (now, proven if earlier is None else earlier[1] | proven)
        self._ids.move_to_end(ext_id)
        while len(self._ids) > self.limit:
            self._ids.popitem(last=False)

    def pop(self, ext_id: str) -> frozenset[str] | None:
        """What the peers that announced ``ext_id`` early proved (forgotten now); None if none did."""
        entry = self._ids.pop(ext_id, None)
        return None if entry is None else entry[1]

    def prune(self, now: float) -> None:
        """Forget what is older than ``seconds``."""
        while self._ids and now - next(iter(self._ids.values()))[0] > self.seconds:
            self._ids.popitem(last=False)

    def __len__(self) -> int:
        return len(self._ids)
