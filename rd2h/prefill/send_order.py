"""Prefill's writes to its control channel: per Decode endpoint, in the order its send tracker
recorded them; one endpoint's writes never wait for another's.

A tracker call records what it sends (readiness awaiting a reply, an mf_meta awaiting its ACK)
under the Source's lock, and the frames are written after, outside that lock, as a send may
block for the channel's send timeout (a Decode that does not read). Two orders matter:

- Frames to one endpoint leave in the order the tracker recorded them. Else a Decode's
  META_REQUIRED, which sends again every readiness in flight to it after one mf_meta, could be
  written before an original readiness recorded earlier and not yet written: that original,
  coming after the new mf_meta, has Decode read the layer twice and answer it twice, the extra
  answer standing for a later readiness of the layer (replies are paired in send order) that
  Decode has not read.
- Nothing to one endpoint waits for a write to another: a Decode whose socket buffer is full
  must not delay the layers announced to the others, nor the handling of their replies.

So each endpoint has an *outbox*, a FIFO of its frames, filled while the tracker's lock is
held by the call that recorded them (:meth:`SendOrder.queue`): the outbox's order is the
tracker's. One writer at a time empties an outbox: a thread of its own when the dialer sends
from any thread (``Dialer.concurrent_send``), lingering a while for more; else the thread that
queued, once it has left the tracker's lock (it is then the only thread that records). A
thread that records never writes to a socket while others wait for it, and a write blocked on
one Decode holds only that Decode's outbox.

A send that raises: the endpoint's readiness and mf_meta queued after it are not written, and
each readiness not written is reported unsent to the tracker, last first, which takes the last
readiness of that layer there. That is the one meant as long as nothing of that endpoint was
recorded after it but what waits in the outbox, so the report is made under the tracker's
lock, taking the waiting frames out. An mf_meta or a disconnect starts a new *epoch* of the
outbox: the tracker has sent again (META_REQUIRED) or abandoned (reply timeout) what was in
flight before it, so a frame of an earlier epoch that fails is skipped with the rest of its
epoch and reported to no one. Notices (how requests ended) only log a failure.

Lock order: the tracker's lock, then the outboxes' mutex; a writer holds neither while it
writes, and takes the tracker's lock only holding nothing (to report a failure).

Runtime, not pure: locks, threads and the dialer.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rd2h.clock import Clock
from rd2h.errors import RD2HError
from rd2h.interfaces import Dialer
from rd2h.prefill.send_tracker import Effects, SendTracker
from rd2h.quiet_log import QuietLog

__all__ = ["SendOrder"]

log = logging.getLogger("rd2h.prefill.source")

_READY, _META, _NOTICE, _DISCONNECT = "readiness", "mf_meta", "notice", "disconnect"
_LINGER_SECONDS = 10.0  # an idle writer thread waits this long for more before it ends


@dataclass(slots=True)
class _Entry:
    kind: str
    frame: bytes
    layer: int
    epoch: int


class _Outbox:
    """One endpoint's frames not yet written, and who writes them (under the mutex)."""

    __slots__ = ("entries", "epoch", "writer", "writing", "more")

    def __init__(self, mutex: threading.Lock) -> None:
        self.entries: deque[_Entry] = deque()
        self.epoch = 0
        self.writer = False  # a thread empties it
        self.writing = False  # an entry taken out is being written
        self.more = threading.Condition(mutex)  # entries came: the lingering writer goes on


class SendOrder:
    """Queues what tracker calls produce in per-endpoint outboxes and writes them, each in order.

    ``lock`` guards ``tracker`` and is notified after each call; ``meta_frame`` is the object the
    tracker sends as its mf_meta (it carries no readiness); ``released`` releases the slots an
    effect lists. A caller that makes a tracker call itself holds ``lock`` through :meth:`queue`
    and calls :meth:`settle` after leaving it.
    """

    def __init__(
        self, *, rank: int, dialer: Dialer, tracker: SendTracker, lock: threading.Condition, clock: Clock,
        quiet: QuietLog, meta_frame: bytes, released: Callable[[Effects], None],
    ) -> None:  # fmt: skip
        self._rank, self._dialer, self._tracker, self._lock, self._clock = rank, dialer, tracker, lock, clock
        self._quiet, self._meta, self._released = quiet, meta_frame, released
        self._threads = dialer.concurrent_send  # else every write is on the thread that queued it
        self._mutex = threading.Lock()  # the outboxes; taken after the tracker's lock, never before
        self._boxes: dict[str, _Outbox] = {}
        self._drained = threading.Condition(self._mutex)  # a writer finished an entry
        self._closed = False

    def feed(self, call: Callable[..., Effects], *args: Any) -> Effects:
        """Run one tracker call (``now`` last) under the tracker's lock, wake its waiters, queue
        what it produced, then settle it."""
        with self._lock:
            effects = call(*args, self._clock())
            self.queue(effects)
            self._lock.notify_all()
        self.settle(effects)
        return effects

    def queue(self, effects: Effects) -> None:
        """Queue ``effects``' frames, its disconnects and the tracker's notices, each in its
        endpoint's outbox. The caller holds the tracker's lock since the call that produced them."""
        notices = self._tracker.take_notices()
        with self._mutex:
            for address, layer_idx, frame in effects.sends:
                meta = frame is self._meta
                self._put(address, _Entry(_META if meta else _READY, frame, layer_idx, 0), new_epoch=meta)
            for address in (*effects.disconnects, *effects.forgotten):
                self._put(address, _Entry(_DISCONNECT, b"", -1, 0), new_epoch=True)
            for address, frame in notices:
                self._put(address, _Entry(_NOTICE, frame, -1, 0), new_epoch=False)

    def settle(self, effects: Effects) -> None:
        """After the tracker's lock is left: release ``effects``' slots and, without writer
        threads, write everything queued on this thread."""
        if not self._threads:
            self._write_queued()
        if effects.forgotten:
            log.debug("Prefill rank %d: forgot unused Decode endpoints %s", self._rank, effects.forgotten)
        self._released(effects)

    def carry_out(self, effects: Effects) -> None:
        """Queue and settle ``effects`` of a tracker call made by a caller that holds no other
        thread's order to keep (one thread, as in unit tests)."""
        with self._lock:
            self.queue(effects)
        self.settle(effects)

    def backlog(self, address: str) -> int:
        """Entries waiting in ``address``'s outbox, not counting one being written."""
        with self._mutex:
            box = self._boxes.get(address)
            return 0 if box is None else len(box.entries)

    def wait_written(self, timeout: float) -> bool:
        """Block until every outbox is empty and no write is under way, ``timeout`` s at most."""
        with self._mutex:
            return self._drained.wait_for(
                lambda: not any(b.entries or b.writing for b in self._boxes.values()), timeout
            )

    def close(self, timeout: float) -> None:
        """Let the writers finish what is queued (``timeout`` s at most), then drop the rest and
        stop them. Before the dialer closes."""
        self.wait_written(timeout)
        with self._mutex:
            self._closed = True
            for box in self._boxes.values():
                box.entries.clear()
                box.more.notify_all()

    # -- writers ----------------------------------------------------------------------------

    def _put(self, address: str, entry: _Entry, *, new_epoch: bool) -> None:  # under the mutex
        box = self._boxes.get(address)
        if box is None:
            box = self._boxes[address] = _Outbox(self._mutex)
        if new_epoch:
            box.epoch += 1
        entry.epoch = box.epoch
        box.entries.append(entry)
        box.more.notify()
        if self._threads and not box.writer and not self._closed:
            box.writer = True
            name = f"rd2h-send-{self._rank}-{address}"
            threading.Thread(target=self._serve, args=(address, box, _LINGER_SECONDS), name=name, daemon=True).start()

    def _write_queued(self) -> None:
        """Without writer threads: empty every outbox no other thread is emptying."""
        while True:
            with self._mutex:
                found = next(((a, b) for a, b in self._boxes.items() if b.entries and not b.writer), None)
                if found is None:
                    return
                found[1].writer = True
            self._serve(*found, 0.0)

    def _serve(self, address: str, box: _Outbox, linger: float) -> None:
        """Write ``box``'s entries in order until it stays empty for ``linger`` seconds."""
        while True:
            with self._mutex:
                if not box.entries and linger > 0 and not self._closed:
                    box.more.wait(linger)
                if not box.entries or self._closed:
                    box.writer = False
                    if not box.entries and self._boxes.get(address) is box:
                        del self._boxes[address]  # a later frame makes a new one (epochs start over)
                    self._drained.notify_all()
                    return
                entry = box.entries.popleft()
                box.writing = True
            try:
                self._write(address, box, entry)
            except Exception:  # the writer must outlive any one failure, or its endpoint hears nothing more
                log.exception("Prefill rank %d: error writing to %s", self._rank, address)
            finally:
                with self._mutex:
                    box.writing = False
                    self._drained.notify_all()

    def _write(self, address: str, box: _Outbox, entry: _Entry) -> None:
        if entry.kind == _DISCONNECT:
            self._dialer.disconnect(address)
            return
        try:
            self._dialer.send(address, entry.frame)
        except RD2HError as exc:
            if entry.kind == _NOTICE:  # Decode fails the requests at their deadline
                self._quiet.warning(
                    "notice lost", address, "Prefill rank %d: could not tell %s how requests ended: %s",
                    self._rank, address, exc,
                )  # fmt: skip
                return
            self._quiet.error(
                "send failed", address, "Prefill rank %d: could not send to %s: %s", self._rank, address, exc
            )
            self._failed(address, box, entry, exc)

    def _failed(self, address: str, box: _Outbox, entry: _Entry, error: RD2HError) -> None:
        """``entry``'s send raised: skip the rest of its epoch; report its readiness if the
        epoch is current (see the module docstring)."""
        with self._lock:
            with self._mutex:
                kept: deque[_Entry] = deque()
                skipped: list[_Entry] = []
                for waiting in box.entries:
                    same = waiting.epoch == entry.epoch and waiting.kind in (_READY, _META)
                    (skipped.append if same else kept.append)(waiting)
                box.entries = kept
                current = entry.epoch == box.epoch
            effects = Effects()
            if current:
                unsent = [e.layer for e in (entry, *skipped) if e.kind == _READY]
                effects = self._unsent(address, unsent, error, self._clock())
                self.queue(effects)
                self._lock.notify_all()
        self._released(effects)

    def _unsent(self, address: str, layers: list[int], error: RD2HError, now: float) -> Effects:
        """Report the readiness not written to ``address``, last first: each is then the last one
        of its layer there, which is the one ``send_failed`` takes."""
        effects = Effects()
        for layer_idx in reversed(layers):
            effects.released += self._tracker.send_failed(address, layer_idx, error, now).released
        return effects
