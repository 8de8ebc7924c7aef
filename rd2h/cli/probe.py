"""Two real endpoints of one transfer engine, checked one step at a time (``rd2h probe``).

A source process (``rd2h.cli.peer``, role prefill) registers three patterned regions,
each with an unregistered page around it; this process (role decode) registers a
destination and reads from the source. Nothing of rd2h's scheduling is involved: this is
the engine alone, as an application would build it by name.

Every engine call runs in a thread of its own and is waited for at most ``timeout``
seconds, so an engine that hangs fails its check ("no answer within N s") instead of
hanging the probe. A call that never returns cannot be cancelled: the probe then makes no
further engine call, keeps the engine and the destination alive (the call may still write
into it) and names the call in ``ProbeReport.stuck``; its process should exit without
waiting for it (``os._exit``), as the command does.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from rd2h import plugins
from rd2h.cli.peer import GAP, GAP_BYTE, PeerProcess, pattern
from rd2h.errors import BackendError, BackendUnavailableError, ConfigError, PeerGoneError, RegionError, TransferError
from rd2h.interfaces import Region, Session, TransferEngine

__all__ = ["CHECKS", "ProbeConfig", "CheckResult", "ProbeReport", "run_probe"]

#: the checks, in the order they run; each needs the one named in ``_NEEDS`` to have passed
CHECKS = ("registration", "connect", "single_read", "batched_read", "out_of_region", "bandwidth", "dead_peer")
_NEEDS = {"connect": "registration", **{name: "connect" for name in CHECKS[2:]}}

BLOCK = 64 << 10  # bytes per block of the single and the bandwidth read
SMALL_BLOCK = 16 << 10  # bytes per block of the batched read: more descriptors per byte
BATCH_BLOCKS = 384
SENTINEL = 0x5A  # what the destination holds before each read

_log = logging.getLogger(__name__)
_ABANDONED: list[object] = []  # engines and buffers a stuck call may still use: never freed
T = TypeVar("T")


@dataclass(frozen=True)
class ProbeConfig:
    """What to probe. ``size_mib`` is the source's size and the bandwidth read's; ``timeout``
    bounds every engine call (and the source's start). Raises ``ConfigError`` for bad values."""

    engine: str = "local"
    prefill_options: Mapping[str, Any] = field(default_factory=dict)
    decode_options: Mapping[str, Any] = field(default_factory=dict)
    size_mib: int = 64
    timeout: float = 30.0
    seed: int = 0

    def __post_init__(self) -> None:
        if type(self.size_mib) is not int or self.size_mib < 1:
            raise ConfigError(f"size_mib must be an integer >= 1, got {self.size_mib!r}")
        if not isinstance(self.timeout, (int, float)) or not self.timeout > 0:
            raise ConfigError(f"timeout must be a number of seconds > 0, got {self.timeout!r}")

    @property
    def size(self) -> int:
        return self.size_mib << 20

    @property
    def region_sizes(self) -> tuple[int, int, int]:
        return (self.size // 2, self.size // 4, self.size // 4)  # each a multiple of BLOCK


@dataclass(frozen=True)
class CheckResult:
    name: str
    ok: bool
    detail: str  # one line: what was seen, or why it failed
    seconds: float


@dataclass(frozen=True)
class ProbeReport:
    engine: str
    checks: tuple[CheckResult, ...]
    gbps: float | None  # from the bandwidth check, if its read was bit-exact
    stuck: tuple[str, ...] = ()  # engine calls still running when the probe ended

    @property
    def ok(self) -> bool:
        return len(self.checks) == len(CHECKS) and all(c.ok for c in self.checks)

    def to_json(self) -> dict[str, Any]:
        checks = [{"name": c.name, "ok": c.ok, "detail": c.detail, "seconds": c.seconds} for c in self.checks]
        return {"engine": self.engine, "checks": checks, "gbps": self.gbps, "ok": self.ok}


def run_probe(config: ProbeConfig, progress: Callable[[CheckResult], None] | None = None) -> ProbeReport:
    """Run every check of ``CHECKS`` against ``config.engine``; ``progress`` sees each result.

    Raises, before starting any process, ``BackendNotFoundError`` or ``BackendUnavailableError``
    (not installed, or cannot run here); ``ConfigError`` when the engine refuses its decode
    options. Everything else the engine does is a failed check in the report.
    """
    cls = plugins.engine_class(config.engine)
    try:
        available = cls.availability()
    except Exception as exc:  # the contract says it must not raise; say so rather than crash
        raise BackendUnavailableError(f"transfer engine {config.engine!r}: availability() raised {exc!r}") from exc
    if not available.ok:
        raise BackendUnavailableError(f"transfer engine {config.engine!r} cannot run here: {available.reason}")
    return _Probe(config).run(progress or (lambda result: None))


class _Failed(Exception):
    """A check failed; the message is its detail."""


class _Hung(_Failed):
    """An engine call did not return in time."""


class _Bounded:
    """Runs each engine call in a thread of its own and waits at most ``timeout`` seconds.

    The thread is joined when the call returns. One that overruns may sit in native code and
    cannot be stopped: it is left running as a daemon, named in ``stuck``, and no further
    call is made (the engine is in an unknown state).
    """

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.stuck: list[str] = []

    def __call__(self, what: str, fn: Callable[[], T]) -> T:
        if self.stuck:
            raise _Failed(f"not run: {self.stuck[0]} is still running")
        outcome: list[tuple[bool, Any]] = []

        def call() -> None:
            try:
                outcome.append((True, fn()))
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                outcome.append((False, exc))

        thread = threading.Thread(target=call, name=f"rd2h-probe {what}", daemon=True)
        thread.start()
        thread.join(self.timeout)
        if thread.is_alive():
            self.stuck.append(what)
            raise _Hung(f"{what}: no answer within {self.timeout:g} s")
        returned, value = outcome[0]
        if not returned:
            raise value
        return value  # type: ignore[no-any-return]


class _Probe:
    def __init__(self, config: ProbeConfig) -> None:
        self.config = config
        self.call = _Bounded(config.timeout)
        self.engine: TransferEngine | None = None
        self.peer: PeerProcess | None = None
        self.session: Session | None = None
        self.dest = np.empty(0, np.uint8)
        self.source = np.empty(0, np.uint8)  # the source's regions back to back, computed here
        self.gbps: float | None = None

    def run(self, progress: Callable[[CheckResult], None]) -> ProbeReport:
        results: dict[str, CheckResult] = {}
        try:
            for name in CHECKS:
                needs = _NEEDS.get(name)
                if needs is not None and not results[needs].ok:
                    result = CheckResult(name, False, f"not run: {needs} failed", 0.0)
                else:
                    result = self._check(name, getattr(self, name))
                results[name] = result
                progress(result)
        finally:
            self._close()
        return ProbeReport(self.config.engine, tuple(results.values()), self.gbps, tuple(self.call.stuck))

    def _check(self, name: str, check: Callable[[], str]) -> CheckResult:
        started = time.monotonic()
        try:
            ok, detail = True, check()
        except (ConfigError, BackendError):
            raise  # the arguments are wrong, not the engine
        except _Failed as exc:
            ok, detail = False, str(exc)
        except Exception as exc:  # whatever the engine raised is the finding
            ok, detail = False, _describe(exc)
        return CheckResult(name, ok, " ".join(detail.split()), time.monotonic() - started)

    # -- the checks, in order; each returns its detail or raises _Failed -------------------

    def registration(self) -> str:
        c = self.config
        try:
            engine = self.engine = self.call(
                "building the decode engine", lambda: plugins.load_engine(c.engine, "decode", **c.decode_options)
            )
        except TypeError as exc:  # e.g. a required option missing
            raise ConfigError(f"transfer engine {c.engine!r} cannot be built with these options: {exc}") from exc
        try:
            peer = self.peer = PeerProcess(
                c.engine, role="prefill", options=c.prefill_options,
                sizes=c.region_sizes, seed=c.seed, timeout=c.timeout,
            )
        except RuntimeError as exc:
            raise _Failed(f"the source process failed to register: {_first_and_last_line(str(exc))}") from None
        if not peer.metadata or len(peer.regions) != len(c.region_sizes):
            raise _Failed(f"the source published {len(peer.metadata)} B of metadata for {len(peer.regions)} regions")
        self.dest = np.empty(c.size, np.uint8)
        self.dest.fill(SENTINEL)  # faults in every page before anything is timed
        metadata = self.call("register", lambda: engine.register([Region(self.dest.ctypes.data, c.size)]))
        if not isinstance(metadata, bytes):
            raise _Failed(f"register returned {type(metadata).__name__}, not bytes")
        self.source = np.concatenate([pattern(c.seed, i, size) for i, size in enumerate(c.region_sizes)])
        return (
            f"source pid {peer.pid} ({peer.session_id}) registered {len(peer.regions)} regions, {c.size_mib} MiB, "
            f"and sent {len(peer.metadata)} B of metadata; {c.size_mib} MiB destination registered here"
        )

    def connect(self) -> str:
        engine, peer = self._ready()
        session = self.session = self.call("connect", lambda: engine.connect(peer.metadata))
        if session.peer_id != peer.session_id:
            raise _Failed(f"the session names peer {session.peer_id!r}, the source is {peer.session_id!r}")
        covered = [any(r.addr <= a and a + n <= r.end for r in session.peer_regions) for a, n in peer.regions]
        if not all(covered):
            missed = [i for i, ok in enumerate(covered) if not ok]
            raise _Failed(f"the session's regions miss source region(s) {missed}")
        return f"session to {session.peer_id} covers all {len(peer.regions)} source regions"

    def single_read(self) -> str:
        first = self.config.region_sizes[0] // BLOCK  # block 1 of region 1, into slot 1
        self._read_and_verify("single read", np.array([first + 1]), np.array([1]), BLOCK)
        return f"1 block of {BLOCK >> 10} KiB from region 1, bit-exact, rest of the destination untouched"

    def batched_read(self) -> str:
        rng = np.random.default_rng(self.config.seed)
        blocks = self.config.size // SMALL_BLOCK
        count = min(BATCH_BLOCKS, blocks // 2)
        ids = rng.choice(blocks, size=count, replace=False)
        self._read_and_verify("batched read", ids, rng.permutation(blocks)[:count], SMALL_BLOCK)
        return f"{count} random blocks of {SMALL_BLOCK >> 10} KiB from all 3 regions into shuffled slots, bit-exact"

    def out_of_region(self) -> str:
        engine, peer = self._ready()
        end = peer.regions[0][0] + peer.regions[0][1]
        length = min(256, GAP // 2)
        cases = {"inside the gap after region 0": end, "across region 0's end into the gap": end - length // 2}
        refused = []
        for what, remote in cases.items():
            self.dest.fill(SENTINEL)
            arrays = [np.array([x], np.int64) for x in (self.dest.ctypes.data, remote, length)]
            try:
                self.call(f"read {what}", lambda: engine.read_batch(self._session(), *arrays))
            except (RegionError, TransferError) as exc:
                refused.append(f"{type(exc).__name__} {what}")
            except _Failed:
                raise
            except Exception as exc:
                raise _Failed(f"a read {what} raised {_describe(exc)}, not RegionError/TransferError") from None
            else:
                leaked = " and copied the source's unregistered bytes" if GAP_BYTE in self.dest[:length] else ""
                raise _Failed(f"a read {what} returned without error{leaked}")
            self._verify(f"after the refused read {what}", np.full(self.dest.size, SENTINEL, np.uint8))
        return "; ".join(refused) + "; destination untouched"

    def bandwidth(self) -> str:
        blocks = self.config.size // BLOCK
        ids = np.random.default_rng(self.config.seed + 1).permutation(blocks)
        seconds = self._read_and_verify("bandwidth read", ids, np.arange(blocks), BLOCK)
        self.gbps = self.config.size / seconds / 1e9
        return (
            f"{self.gbps:.2f} GB/s: {self.config.size_mib} MiB as {blocks} blocks of {BLOCK >> 10} KiB in shuffled "
            f"order, one read_batch in {seconds * 1e3:.1f} ms, bit-exact"
        )

    def dead_peer(self) -> str:
        _, peer = self._ready()
        peer.kill()
        started = time.monotonic()
        try:
            self._read("read from the killed source", np.array([0]), np.array([0]), BLOCK)
        except _Failed:
            raise
        except TransferError as exc:
            took = time.monotonic() - started
            hint = "" if isinstance(exc, PeerGoneError) else " (PeerGoneError would tell callers the peer is gone)"
            return f"{type(exc).__name__} after {took:.2f} s{hint}: {exc}"
        except Exception as exc:
            raise _Failed(f"a read from the killed source raised {_describe(exc)}, not TransferError") from None
        raise _Failed("a read from the source killed with SIGKILL returned without error")

    # -- helpers ----------------------------------------------------------------------------

    def _ready(self) -> tuple[TransferEngine, PeerProcess]:
        assert self.engine is not None and self.peer is not None, "registration passed"
        return self.engine, self.peer

    def _session(self) -> Session:
        assert self.session is not None, "connect passed"
        return self.session

    def _read(self, what: str, ids: np.ndarray, slots: np.ndarray, block: int) -> float:
        """Read source blocks ``ids`` (numbered across the regions) into destination slots;
        the seconds ``read_batch`` took."""
        engine, peer = self._ready()
        session = self._session()
        per_region = np.array(self.config.region_sizes, np.int64) // block
        ends = np.cumsum(per_region)
        region = np.searchsorted(ends, ids, side="right")
        starts = np.array([addr for addr, _ in peer.regions], np.int64)
        remote = starts[region] + (ids - (ends - per_region)[region]) * block
        local = self.dest.ctypes.data + slots.astype(np.int64) * block
        lengths = np.full(len(ids), block, np.int64)

        def read() -> float:
            started = time.perf_counter()
            engine.read_batch(session, local, remote, lengths)
            return time.perf_counter() - started

        return self.call(what, read)

    def _read_and_verify(self, what: str, ids: np.ndarray, slots: np.ndarray, block: int) -> float:
        self.dest.fill(SENTINEL)
        seconds = self._read(what, ids, slots, block)
        want = np.full(self.dest.size, SENTINEL, np.uint8)
        want.reshape(-1, block)[slots] = self.source.reshape(-1, block)[ids]
        self._verify(what, want)
        return seconds

    def _verify(self, what: str, want: np.ndarray) -> None:
        if not np.array_equal(self.dest, want):
            bad = np.flatnonzero(self.dest != want)
            raise _Failed(
                f"{what}: {len(bad)} bytes differ, first at destination offset {bad[0]} "
                f"(got {self.dest[bad[0]]:#04x}, expected {want[bad[0]]:#04x})"
            )

    def _close(self) -> None:
        if self.engine is not None:
            if not self.call.stuck:
                try:
                    self.call("close", self.engine.close)
                except Exception as exc:  # reported, not raised: the checks are the result
                    _log.warning("closing the %s engine failed: %s", self.config.engine, _describe(exc))
            if self.call.stuck:
                _ABANDONED.extend((self.engine, self.session, self.dest))
        if self.peer is not None:
            self.peer.close()


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _first_and_last_line(text: str) -> str:
    """The peer's failure: what PeerProcess says, and the last line of the peer's stderr."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0] if len(lines) < 2 else f"{lines[0]} {lines[-1]}"
