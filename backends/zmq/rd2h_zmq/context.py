"""The one ``zmq.Context`` a channel's listeners and dialers share."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator

__all__ = ["SharedContext"]

log = logging.getLogger("rd2h_zmq")


class SharedContext:
    """One ``zmq.Context`` (one I/O thread) for every socket of a channel, made on first
    use and terminated when the last user releases it; with CURVE, the ZAP authenticator
    thread lives and dies with it."""

    def __init__(self, authorized_dir: Path | None) -> None:
        self._authorized_dir = authorized_dir
        self._lock = threading.Lock()
        self._context: zmq.Context[zmq.Socket[bytes]] | None = None
        self._authenticator: ThreadAuthenticator | None = None
        self._users = 0

    def acquire(self, *, authenticate: bool) -> zmq.Context[zmq.Socket[bytes]]:
        with self._lock:
            if self._context is None:
                self._context = zmq.Context(io_threads=1)
            self._users += 1
            context = self._context
            if authenticate and self._authenticator is None:
                try:
                    authenticator = ThreadAuthenticator(context, log=log.getChild("zap"))
                    authenticator.start()
                    authenticator.configure_curve(domain="*", location=str(self._authorized_dir))
                except Exception:
                    self._users -= 1
                    self._maybe_term()
                    raise
                self._authenticator = authenticator
            return context

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            self._maybe_term()

    @property
    def active(self) -> bool:
        return self._context is not None

    def _maybe_term(self) -> None:
        if self._users > 0 or self._context is None:
            return
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None
        # Every socket is closed with LINGER 0 before release, so term() returns at once.
        self._context.term()
        self._context = None
