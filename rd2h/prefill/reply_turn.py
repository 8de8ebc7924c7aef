"""Who reads Decode's replies on Prefill: the sender thread, or the compute thread waiting for its slots.

A layer's storage slots are freed by Decode's replies. While the compute path waits for
them (``Source.wait_for_layer_send``) it reads the replies itself, so the reply wakes the
thread that needs it rather than the sender thread, which would then have to wake it: one
thread switch fewer per layer. Between its waits the compute thread keeps the role, so the
sender thread is neither woken to give it up nor to take it back while layers keep coming;
replies meanwhile wait in the socket, read by the next wait. The sender takes the role back
once the caller has left it unused for ``idle_seconds``, or at once when the caller gives
it back (``give_back``: it waits for requests to finish, or closes), so replies never wait
longer than that for a reader. Only one thread is ever inside the dialer's ``recv``.

Runtime, not pure: threads.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from rd2h.errors import RD2HError
from rd2h.interfaces import Dialer

__all__ = ["ReplyTurn"]

log = logging.getLogger("rd2h.prefill.source")

_SENDER, _CALLER, _KEPT = "sender", "caller", "kept"  # who holds the role (None: nobody)

Handler = Callable[[str, bytes], None]


class ReplyTurn:
    """The right to call ``dialer.recv``, passed between the sender thread and callers.

    ``sender_turn`` is the sender thread's wait: it reads (and handles) one reply when the
    role is free, else it waits on the role. ``caller_turn`` is a caller's wait for
    ``done()``: it takes the role (asking the sender to leave ``recv`` if it is in it), reads
    and handles one reply, and keeps the role. ``wake`` makes the sender thread look at its
    own work now, wherever it waits.
    """

    def __init__(self, dialer: Dialer, idle_seconds: float) -> None:
        self._dialer = dialer
        self._idle = idle_seconds
        self._cond = threading.Condition()
        self._holder: str | None = None
        self._kept_since = 0.0
        self._wanted = 0  # callers waiting for the role
        self.caller_reads = 0  # replies read by callers (for tests and benchmarks)

    @property
    def holder(self) -> str | None:
        with self._cond:
            return self._holder

    def wake(self) -> None:
        """The sender thread has work: make its wait (on the socket or on the role) end now."""
        self._dialer.wakeup()
        with self._cond:
            self._cond.notify_all()

    def give_back(self) -> None:
        """The caller stops reading between waits: the sender thread reads from now on."""
        with self._cond:
            if self._holder == _KEPT:
                self._holder = None
                self._cond.notify_all()

    def sender_turn(self, timeout: float, handle: Handler) -> None:
        """Read and handle one reply within ``timeout`` seconds if the role is free (or kept
        unused for ``idle_seconds``); else wait for the role as long, reading nothing."""
        with self._cond:
            if self._holder == _KEPT and not self._wanted and time.monotonic() - self._kept_since >= self._idle:
                self._holder = None
            if self._holder is not None or self._wanted:
                self._cond.wait(timeout)
                return
            self._holder = _SENDER
        try:
            item = self._dialer.recv(timeout)
            if item is not None:
                handle(*item)
        finally:
            self._release(None)

    def caller_turn(self, timeout: float, handle: Handler, done: Callable[[], bool]) -> None:
        """Wait at most ``timeout`` seconds for one reply and handle it, unless ``done()``
        (checked while waiting for the role and before reading). The role is kept after.
        Never raises: a handler's error is logged, a dialer that fails (closed) is waited out."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._wanted += 1
            try:
                kicked = False
                while self._holder not in (None, _KEPT):
                    if done():
                        return
                    if self._holder == _SENDER and not kicked:  # it waits in recv: make it return
                        self._dialer.wakeup()
                        kicked = True
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return
                    self._cond.wait(left)
                self._holder = _CALLER
            finally:
                self._wanted -= 1
        broken = False
        try:
            if not done():
                item = self._dialer.recv(max(0.0, deadline - time.monotonic()))
                if item is not None:
                    self.caller_reads += 1
                    handle(*item)
        except RD2HError as exc:  # the dialer closed under the caller: wait, never spin, never raise
            log.debug("reading replies on the caller's thread failed: %s", exc)
            broken = True
        except Exception:  # what a Decode sent must not raise into the compute path
            log.exception("error handling a reply on the caller's thread")
        finally:
            self._release(_KEPT)
        if broken:
            with self._cond:
                self._cond.wait(max(0.0, deadline - time.monotonic()))

    def _release(self, to: str | None) -> None:
        with self._cond:
            self._holder = to
            self._kept_since = time.monotonic()
            if self._wanted:  # a caller waits for the role; the sender is never woken for it
                self._cond.notify_all()
