"""Handshakes off Decode's loop: a Prefill's ``connect`` runs on a helper thread.

A transfer engine's ``connect`` may wait on the peer: the local engine asks the Prefill
process to prove who it is, and a Prefill whose interpreter is busy (or a peer that never
answers) keeps it waiting up to its bound, 10 s. Run on the loop, that wait delays every
reply to every other peer (measured: 2.8 s under load in the vLLM tests). For an engine that
declares ``Capability.CONCURRENT_CONNECT`` the sink starts the handshake here and goes on;
frames the peer sends meanwhile wait in its queue and are handled, in order, once the
handshake ends. Engines that do not declare it connect on the loop, as before.

The loop thread owns everything here but the helper threads' calls to ``connect``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from rd2h.errors import RD2HError, TransferError
from rd2h.interfaces import Session
from rd2h.layout.layers import LayerLayout
from rd2h.wire import protocol

__all__ = ["Handshake", "Admissions"]

log = logging.getLogger("rd2h.decode.sink")

# Bounds: a flood of handshakes costs at most this many threads, pending entries and frames.
MAX_THREADS = 4
MAX_PENDING = 64
MAX_HELD_FRAMES = 1024  # frames one peer may send before its handshake ends
MAX_HELD_BYTES = 32 << 20  # and their bytes (a frame may be 16 MiB: frames alone bound nothing)


@dataclass(eq=False, slots=True)
class Handshake:
    """One peer's handshake: its mf_meta, what ``connect`` gave (a Session or the error),
    and the frames it sent meanwhile."""

    meta: protocol.MfMeta
    layers: dict[str, LayerLayout]
    future: Future[Session]
    held: list[bytes] = field(default_factory=list)
    held_bytes: int = 0
    dropped: int = 0
    started: float = field(default_factory=time.monotonic)  # how long it took is a metric

    def result(self) -> Session | RD2HError:
        """The session, or the failure (an unexpected exception becomes a TransferError)."""
        try:
            return self.future.result()
        except RD2HError as exc:
            return exc
        except Exception as exc:  # noqa: BLE001 - an engine's bug must not kill the loop
            return TransferError(f"connect failed: {type(exc).__name__}: {exc}")


class Admissions:
    """Handshakes in progress, keyed by the peer's channel identity."""

    def __init__(self, rank: int) -> None:
        self._rank = rank
        self._pending: dict[bytes, Handshake] = {}
        self._pool: ThreadPoolExecutor | None = None

    def __bool__(self) -> bool:
        return bool(self._pending)

    def __contains__(self, identity: object) -> bool:
        return identity in self._pending

    def start(
        self, identity: bytes, meta: protocol.MfMeta, layers: dict[str, LayerLayout], connect: Callable[[], Session]
    ) -> bool:
        """Run ``connect`` on a helper thread for ``identity``; False when ``MAX_PENDING``
        handshakes are in progress already (the caller refuses this one)."""
        if len(self._pending) >= MAX_PENDING:
            return False
        if self._pool is None:
            self._pool = ThreadPoolExecutor(MAX_THREADS, thread_name_prefix=f"rd2h-admit-{self._rank}")
        self._pending[identity] = Handshake(meta, layers, self._pool.submit(connect))
        return True

    def hold(self, identity: bytes, frame: bytes) -> None:
        """Keep a frame of a peer whose handshake is in progress (dropped past the bounds:
        a readiness dropped here is never answered, and Prefill's reply timeout fails it)."""
        handshake = self._pending[identity]
        if len(handshake.held) < MAX_HELD_FRAMES and handshake.held_bytes + len(frame) <= MAX_HELD_BYTES:
            handshake.held.append(frame)
            handshake.held_bytes += len(frame)
            return
        handshake.dropped += 1
        if handshake.dropped == 1:
            log.warning("rank %d: %r sent more than %d frames or %d MiB before its handshake ended; "
                        "dropping the rest", self._rank, identity, MAX_HELD_FRAMES, MAX_HELD_BYTES >> 20)

    def wait_any(self, timeout: float) -> bool:
        """Block until a handshake in progress ended, ``timeout`` seconds at most; whether
        one did (False too when none is in progress)."""
        if not self._pending:
            return False
        done, _ = wait([h.future for h in self._pending.values()], timeout, return_when=FIRST_COMPLETED)
        return bool(done)

    def finished(self) -> list[tuple[bytes, Handshake]]:
        """The handshakes that ended, removed from those in progress."""
        done = [(i, h) for i, h in self._pending.items() if h.future.done()]
        for identity, _ in done:
            del self._pending[identity]
        return done

    def close(self) -> None:
        """Wait for the handshakes running (each bounded by the engine), close what they
        opened. Idempotent."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        for handshake in self._pending.values():
            if not handshake.future.cancelled():
                result = handshake.result()
                if not isinstance(result, RD2HError):
                    result.close()
        self._pending.clear()
