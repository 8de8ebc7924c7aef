"""Handshakes off Decode's loop: a Prefill's ``connect`` runs on a helper thread.

A transfer engine's ``connect`` may wait on the peer: the local engine asks the Prefill
process to prove who it is, and a Prefill whose interpreter is busy (or a peer that never
answers) keeps it waiting up to its bound, 10 s. Run on the loop, that wait delays every
reply to every other peer (measured: 2.8 s under load in the vLLM tests). For an engine that
declares ``Capability.CONCURRENT_CONNECT`` the sink starts the handshake here and goes on;
frames the peer sends meanwhile wait in its queue and are handled, in order, once the
handshake ends. Engines that do not declare it connect on the loop, as before.

Fairness (issue 19): a handshake never queues behind another. Each one in progress has a
thread of its own (``MAX_PENDING`` of them at most), so a Prefill that answers its proof is
admitted in its own proof time while strangers hang; the engine bounds how long and how
many of them may hang (the local engine: 4 per process, 32 in all, the oldest cut short).
Memory has one budget: what peers send before their handshake ends is held within
``MAX_HELD_BYTES`` each and ``MAX_HELD_TOTAL`` in all; past the total, the peer that holds
the most loses what it holds (a peer sending a few small frames never does).

The loop thread owns everything here but the helper threads' calls to ``connect``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from rd2h.errors import RD2HError, TransferError
from rd2h.interfaces import Session
from rd2h.layout.layers import LayerLayout
from rd2h.wire import protocol

__all__ = ["Handshake", "Admissions", "bare"]

log = logging.getLogger("rd2h.decode.sink")

# Bounds: a flood of handshakes costs at most this many threads, pending entries and frames.
MAX_PENDING = 64  # handshakes in progress; each has its thread: none waits for another's
MAX_HELD_FRAMES = 1024  # frames one peer may send before its handshake ends
MAX_HELD_BYTES = 32 << 20  # and their bytes (a frame may be 16 MiB: frames alone bound nothing)
MAX_HELD_TOTAL = 64 << 20  # held by every peer together (64 x 32 MiB was 2 GiB)
# Once what was held (at its peak at least this much) is handled, glibc is asked to return
# the freed memory: 8 hanging peers left Decode 66 MB above its start without it, 2 with it.
TRIM_AFTER = 8 << 20


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
    evicted: bool = False  # lost its held frames to the total budget: the rest are dropped too
    started: float = field(default_factory=time.monotonic)  # how long it took is a metric

    def result(self) -> Session | RD2HError:
        """The session, or the failure (an unexpected exception becomes a TransferError),
        without its traceback: a refusal is kept as long as the peer, and a traceback through
        this method would keep this handshake and every frame it held alive with it."""
        try:
            return self.future.result()
        except RD2HError as exc:
            return bare(exc)
        except Exception as exc:  # noqa: BLE001 - an engine's bug must not kill the loop
            return TransferError(f"connect failed: {type(exc).__name__}: {exc}")


def bare(exc: RD2HError) -> RD2HError:
    """``exc`` without its traceback and chained exceptions, to be kept for a peer's life:
    their frames hold what the failing call held (a peer's frames, up to 16 MiB each)."""
    exc.__cause__ = exc.__context__ = None
    return exc.with_traceback(None)


class Admissions:
    """Handshakes in progress, keyed by the peer's channel identity."""

    def __init__(self, rank: int) -> None:
        self._rank = rank
        self._pending: dict[bytes, Handshake] = {}
        self._pool: ThreadPoolExecutor | None = None
        self.held_bytes = 0  # held by every handshake in progress: at most MAX_HELD_TOTAL
        self._held_peak = 0  # the most held since memory was last given back
        self.dropped = 0  # frames dropped in all (a count for the logs and tests)

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
            self._pool = ThreadPoolExecutor(MAX_PENDING, thread_name_prefix=f"rd2h-admit-{self._rank}")
        self._pending[identity] = Handshake(meta, layers, self._pool.submit(connect))
        return True

    def hold(self, identity: bytes, frame: bytes) -> None:
        """Keep a frame of a peer whose handshake is in progress (dropped past the bounds:
        a readiness dropped here is never answered, and Prefill's reply timeout fails it)."""
        handshake = self._pending[identity]
        size = len(frame)
        fits = (
            not handshake.evicted
            and len(handshake.held) < MAX_HELD_FRAMES
            and handshake.held_bytes + size <= MAX_HELD_BYTES
            and self._make_room(handshake, size)
        )
        if fits:
            handshake.held.append(frame)
            handshake.held_bytes += size
            self.held_bytes += size
            self._held_peak = max(self._held_peak, self.held_bytes)
            return
        self._drop(identity, handshake, 1)

    def _make_room(self, handshake: Handshake, size: int) -> bool:
        """Whether ``size`` more bytes fit the total, after taking what the biggest holders
        hold while each holds more than ``handshake`` would."""
        while self.held_bytes + size > MAX_HELD_TOTAL:
            identity, biggest = max(self._pending.items(), key=lambda item: item[1].held_bytes)
            if biggest is handshake or biggest.held_bytes <= handshake.held_bytes + size:
                return False
            self._release(biggest)
            biggest.evicted = True
            self._drop(identity, biggest, len(biggest.held))
            biggest.held = []
        return True

    def _release(self, handshake: Handshake) -> None:
        self.held_bytes -= handshake.held_bytes
        handshake.held_bytes = 0

    def _drop(self, identity: bytes, handshake: Handshake, frames: int) -> None:
        first = handshake.dropped == 0
        handshake.dropped += frames
        self.dropped += frames
        if first:
            log.warning(
                "rank %d: %r sent more than %d frames or %d MiB before its handshake ended, or more than its "
                "share of the %d MiB all handshakes may hold; dropping %d frame(s) and the rest it sends until then",
                self._rank, identity, MAX_HELD_FRAMES, MAX_HELD_BYTES >> 20, MAX_HELD_TOTAL >> 20, frames,
            )  # fmt: skip

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
        for identity, handshake in done:
            del self._pending[identity]
            self._release(handshake)  # its frames now belong to the caller, who handles them
        return done

    def give_back(self) -> bool:
        """Call once the frames ``finished`` returned are handled: when nothing is held any
        more and much was, return the freed memory to the system (glibc keeps freed pages in
        its arenas otherwise). Whether it did."""
        if self.held_bytes or self._held_peak < TRIM_AFTER:
            return False
        self._held_peak = 0
        return _malloc_trim()

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
        self.held_bytes = 0


_libc: ctypes.CDLL | None = None


def _malloc_trim() -> bool:
    """glibc's ``malloc_trim(0)``: give every arena's free pages back; False where there is none."""
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(_libc.malloc_trim(0))
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to give back this way
        return False
