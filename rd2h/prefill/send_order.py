"""Prefill's writes to its control channel, in the order its send tracker recorded them.

A tracker call records what it sends (readiness awaiting a reply, an mf_meta awaiting its ACK)
under the Source's lock; the frames are written after, outside that lock, as a send may block
for the channel's send timeout and the lock's waiters need it meanwhile. Were nothing else to
order them, another thread could record and write its own frames in between: a Decode's
META_REQUIRED sends again every readiness in flight to it, one whose first write is still to
come included, and that late original, coming after the new mf_meta, has Decode read the layer
twice and answer it twice; the second answer then stands for a later readiness of the layer
(replies are paired in send order) that Decode has not read, whose slots are released or whose
step counts as answered. A send that raised and is reported to the tracker only later could
likewise fail a readiness recorded after it.

So recording and writing are one *turn*: a lock taken before the tracker's lock and held until
the call's frames are written and every send that raised is reported to the tracker. Frames
reach the dialer in the order the tracker recorded them, and the readiness a failed send and
the frames skipped after it carried are still the last of their layers at that endpoint when
reported (nothing was recorded since). A turn blocks for its own sends (each bounded by the
channel's send timeout), never for a reply: the thread that reads replies takes a turn only to
handle one it has read. The lock order is the turn, then the tracker's lock; a thread holding
the tracker's lock never waits for a turn.

Runtime, not pure: a lock and the dialer.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from rd2h.clock import Clock
from rd2h.errors import RD2HError
from rd2h.interfaces import Dialer
from rd2h.prefill.send_tracker import Effects, SendTracker
from rd2h.quiet_log import QuietLog

__all__ = ["SendOrder"]

log = logging.getLogger("rd2h.prefill.source")


class SendOrder:
    """Runs tracker calls and writes what they produce, one turn at a time.

    ``lock`` guards ``tracker`` and is notified after each call; ``meta_frame`` is the object the
    tracker sends as its mf_meta (it carries no readiness); ``released`` releases the slots an
    effect lists. ``turn`` is the lock a caller holds to record and write in one turn itself
    (:meth:`carry_out`).
    """

    def __init__(
        self, *, rank: int, dialer: Dialer, tracker: SendTracker, lock: threading.Condition, clock: Clock,
        quiet: QuietLog, meta_frame: bytes, released: Callable[[Effects], None],
    ) -> None:  # fmt: skip
        self.turn = threading.Lock()
        self._rank, self._dialer, self._tracker, self._lock, self._clock = rank, dialer, tracker, lock, clock
        self._quiet, self._meta, self._released = quiet, meta_frame, released

    def feed(self, call: Callable[..., Effects], *args: Any) -> Effects:
        """Run one tracker call (``now`` last) under the tracker's lock, wake its waiters, and
        write what it produced, in one turn."""
        with self.turn:
            return self._run(call, *args)

    def carry_out(self, effects: Effects) -> None:
        """Write ``effects``' frames in order, drop its connections, release its slots. The caller
        holds the turn in which the tracker produced them. A send that raises: the endpoint's
        remaining frames are skipped, and each readiness not written is reported unsent."""
        failed: set[str] = set()
        for at, (address, _, frame) in enumerate(effects.sends):
            if address in failed:
                continue
            try:
                self._dialer.send(address, frame)
            except RD2HError as exc:  # this endpoint missed these layers; the others did not
                failed.add(address)
                self._quiet.error(
                    "send failed", address, "Prefill rank %d: could not send to %s: %s", self._rank, address, exc
                )
                unsent = [layer for a, layer, f in effects.sends[at:] if a == address and f is not self._meta]
                self._run(self._unsent, address, unsent, exc)
        for address in (*effects.disconnects, *effects.forgotten):
            self._dialer.disconnect(address)
        if effects.forgotten:
            log.debug("Prefill rank %d: forgot unused Decode endpoints %s", self._rank, effects.forgotten)
        self._released(effects)

    def _run(self, call: Callable[..., Effects], *args: Any) -> Effects:
        with self._lock:
            effects = call(*args, self._clock())
            notices = self._tracker.take_notices()
            self._lock.notify_all()
        self.carry_out(effects)
        self._tell(notices)
        return effects

    def _unsent(self, address: str, layers: list[int], error: RD2HError, now: float) -> Effects:
        """Report the readiness not written to ``address``, last first: each is then the last one
        of its layer there, which is the one ``send_failed`` takes."""
        effects = Effects()
        for layer_idx in reversed(layers):
            effects.released += self._tracker.send_failed(address, layer_idx, error, now).released
        return effects

    def _tell(self, notices: list[tuple[str, bytes]]) -> None:
        """Send how requests ended; a failure is only logged (Decode fails them at their deadline)."""
        for address, frame in notices:
            try:
                self._dialer.send(address, frame)
            except RD2HError as exc:
                self._quiet.warning(
                    "notice lost", address, "Prefill rank %d: could not tell %s how requests ended: %s",
                    self._rank, address, exc,
                )  # fmt: skip
