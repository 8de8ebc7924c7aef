"""Same-host pull: Decode copies straight out of the Prefill process with ``process_vm_readv``.

One copy, no shared-memory setup on the Prefill side. The Prefill side registers its
regions and answers on a proof socket (``_proof``): the Decode side believes the pid and the
regions of the metadata only once the process at the other end of that socket proves them,
and the Prefill lets that reader alone ptrace it where Yama asks. Then Decode reads batches.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import NoReturn

import numpy as np
import numpy.typing as npt

from rd2h.engine_support import check_read_arrays, check_region_kinds
from rd2h.errors import (
    BackendUnavailableError,
    ConfigError,
    PeerGoneError,
    RegionError,
    TransferError,
    TransferTimeout,
)
from rd2h.interfaces import Availability, Capability, Region, Session, TransferEngine
from rd2h.layout.regions import RegionSet
from rd2h_local import _iov, _metadata, _proof, _sys
from rd2h_local._bounds import FastBounds

__all__ = ["LocalEngine", "LocalSession"]

Int64Array = npt.NDArray[np.int64]

_ROLES = ("prefill", "decode")
# Batches up to this size are copied on the calling thread. `bench/local_engine.py --sweep`
# on 2 cores: at 2 MiB one and two threads tie, at 4 MiB two threads are 1.5x faster.
DEFAULT_PARALLEL_THRESHOLD = 2 << 20
DEFAULT_TIMEOUT = 30.0


class LocalSession(Session):
    """A connection to one peer process on this host."""

    def __init__(self, info: _metadata.PeerInfo, handle: _sys.ProcessHandle, proof: _proof.Proof) -> None:
        self._info = info
        self._handle = handle
        self._proof = proof  # held open: its end tells the Prefill to revoke our ptrace grant
        self.bounds = RegionSet(info.regions)
        self.fast_bounds = FastBounds(self.bounds)
        self._regions = _as_regions(self.bounds)
        self.closed = False

    @property
    def peer_id(self) -> str:
        return f"local:{self._info.hostname}:{self._info.pid}"

    @property
    def peer_regions(self) -> tuple[Region, ...]:
        return self._regions

    @property
    def pid(self) -> int:
        return self._info.pid

    def peer_exited(self) -> bool:
        return self._handle.exited()

    def close(self) -> None:
        self.closed = True
        self._handle.close()
        self._proof.close()


def _unknown_options(unknown: dict[str, object]) -> ConfigError:
    known = "threads, parallel_threshold_bytes, timeout, ptracer"
    return ConfigError(f"unknown option(s) for the local engine: {', '.join(sorted(unknown))} (known: {known})")


class LocalEngine(TransferEngine):
    """Transfer engine for Prefill and Decode on one host (one Linux kernel, one pid namespace).

    Options: ``threads`` (copy threads for big batches; default ``min(4, cpu_count)``),
    ``parallel_threshold_bytes`` (batches above it are split across the threads) and
    ``timeout`` (seconds a ``read_batch`` or a ``connect`` may take). ``ptracer`` (Prefill,
    where Yama's ptrace_scope is 1): ``"peer"`` lets only the Decode process that proved
    itself on the proof socket read this one; ``"any"`` every same-user process (the old,
    weaker behaviour); ``"none"`` nobody (Decode then needs CAP_SYS_PTRACE). Unknown options
    raise ``ConfigError``.
    Host memory only (``memory_kinds()``: process_vm_readv cannot touch accelerator memory);
    device memory needs another engine or host staging.
    """

    name = "local"
    # Destinations are checked against registered regions, so they must be registered.
    capabilities = (
        Capability.READ_FROM_HOST
        | Capability.WRITE_TO_HOST
        | Capability.NEEDS_REGISTERED_DESTINATIONS
        | Capability.PROVES_PEER
        | Capability.CONCURRENT_CONNECT  # connect shares only the lock-guarded session list
    )

    @classmethod
    def availability(cls) -> Availability:
        ok, reason = _sys.syscall_available()
        return Availability(ok, reason)

    def __init__(
        self,
        role: str,
        *,
        threads: int | None = None,
        parallel_threshold_bytes: int = DEFAULT_PARALLEL_THRESHOLD,
        timeout: float = DEFAULT_TIMEOUT,
        ptracer: str = "peer",
        **unknown: object,
    ) -> None:
        if unknown:
            raise _unknown_options(unknown)
        if role not in _ROLES:
            raise ConfigError(f"role must be one of {_ROLES}, got {role!r}")
        if threads is None:
            threads = min(4, os.cpu_count() or 1)
        if type(threads) is not int or threads < 1:
            raise ConfigError(f"threads must be a positive integer, got {threads!r}")
        if type(parallel_threshold_bytes) is not int or parallel_threshold_bytes < 0:
            raise ConfigError(f"parallel_threshold_bytes must be an integer >= 0, got {parallel_threshold_bytes!r}")
        if not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ConfigError(f"timeout must be a number of seconds > 0, got {timeout!r}")
        if ptracer not in _proof.PTRACER_MODES:
            raise ConfigError(f"ptracer must be one of {_proof.PTRACER_MODES}, got {ptracer!r}")
        ok, reason = _sys.syscall_available()
        if not ok:
            raise BackendUnavailableError(f"the local engine cannot run here: {reason}")
        self.role = role
        self.threads = threads
        self.parallel_threshold_bytes = parallel_threshold_bytes
        self.timeout = float(timeout)
        self._boot_id = _sys.boot_id()
        self._hostname = _sys.hostname()
        self._pidns = _sys.pid_namespace()
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._bounds = RegionSet()
        self._fast_bounds = FastBounds(self._bounds)
        self._sessions: list[LocalSession] = []
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False
        self.ptracer = ptracer
        self._witness: _proof.Witness | None = None  # Prefill: made by the first register
        self.proofs = _proof.ProofLoad()  # Decode: the proofs connect waits on, kept fair

    # -- identity and registration ------------------------------------------------------

    @property
    def session_id(self) -> str:
        return f"local:{self._hostname}:{self._pid}"

    @property
    def registered_regions(self) -> tuple[Region, ...]:
        """Every registered region, merged where they overlap or touch."""
        return _as_regions(self._bounds)

    def register(self, regions: Sequence[Region]) -> bytes:
        """Add host regions; returns metadata covering all of them. ``TransferError`` for
        device memory or a closed engine."""
        self._check_open()
        check_region_kinds(self, regions)  # process_vm_readv moves host memory only
        with self._lock:
            self._bounds = RegionSet([*self._bounds, *((r.addr, r.length) for r in regions)])
            self._fast_bounds = FastBounds(self._bounds)
            if self.role == "prefill" and self._witness is None:
                self._witness = _proof.Witness(self._proven_regions, self.ptracer)
            info = _metadata.PeerInfo(
                self._boot_id,
                self._hostname,
                self._pidns,
                self._pid,
                _sys.start_time(self._pid),
                _as_regions(self._bounds),
                "" if self._witness is None else self._witness.name,
                b"" if self._witness is None else self._witness.token,
            )
        return _metadata.encode(info)

    def _proven_regions(self) -> list[tuple[int, int]]:
        """What the witness tells a reader: this process's registration now."""
        with self._lock:
            return list(self._bounds)

    def connect(self, peer_metadata: bytes) -> LocalSession:
        """Open a session to the process that produced ``peer_metadata``.

        Believes nothing the blob declares until the process it names proves it on its proof
        socket: that it is that process (``SO_PEERCRED``) and that it registered every region
        the blob names. Raises ``TransferError`` for a malformed blob, a peer on another host
        or in another pid namespace, a blob the named process does not prove, or a peer we may
        not read; ``PeerGoneError`` when it is not running. Connects may run at once, fairly:
        one process has at most a few proofs waiting, and past ``proofs.max_waiting`` a new
        proof cuts the oldest short (``_proof.ProofLoad``; docs/security.md).
        """
        self._check_open()
        info = _metadata.decode(peer_metadata)
        if info.boot_id != self._boot_id:
            raise TransferError(
                f"the local engine is same-host only: the peer runs on {info.hostname!r} "
                f"(boot id {info.boot_id}), this process on {self._hostname!r} (boot id {self._boot_id}); "
                "choose a cross-host transfer engine (e.g. memfabric) for Prefill and Decode on different machines"
            )
        if info.pid_namespace is not None and self._pidns is not None and info.pid_namespace != self._pidns:
            raise TransferError(
                f"the peer (pid {info.pid} on {info.hostname!r}) is in another pid namespace: the local engine "
                "needs both processes in one (e.g. containers sharing the host pid namespace)"
            )
        try:
            handle = _sys.ProcessHandle(info.pid, info.start_time)
        except ProcessLookupError:
            raise PeerGoneError(f"peer process {info.pid} on {info.hostname!r} is not running") from None
        try:
            proof = self._prove(info)
        except BaseException:
            handle.close()
            raise
        session = LocalSession(info, handle, proof)
        try:
            self._probe(session)
        except BaseException:
            session.close()
            raise
        with self._lock:
            if self._closed:
                session.close()
                raise TransferError("the local engine is closed")
            self._sessions = [s for s in self._sessions if not s.closed]
            self._sessions.append(session)
        return session

    def _prove(self, info: _metadata.PeerInfo) -> _proof.Proof:
        if not info.proof_socket:
            raise TransferError(
                f"the metadata of process {info.pid} names no proof socket (a Decode-role engine's, or "
                "an older rd2h-local's): nothing it declares can be believed"
            )
        deadline = time.monotonic() + min(self.timeout, 10.0)
        proof = _proof.verify(info.proof_socket, info.proof_token, info.pid, deadline, self.proofs)
        try:
            try:
                proven = RegionSet(proof.regions)
            except ValueError as exc:
                raise TransferError(f"process {info.pid} proved malformed regions: {exc}") from None
            for addr, length in RegionSet(info.regions):
                if not proven.covers(addr, length):
                    raise TransferError(
                        f"the metadata of process {info.pid} declares [{addr:#x}, +{length}), which that "
                        "process did not register: refused (a peer may name only its own registered memory)"
                    )
        except BaseException:
            proof.close()
            raise
        return proof

    def _probe(self, session: LocalSession) -> None:
        """Read one byte now, so a permission problem shows at connect, not at the first layer."""
        if not session.peer_regions:
            return
        scratch = np.zeros(1, dtype=np.uint8)
        pair = _iov.build(
            np.array([scratch.ctypes.data], dtype=np.int64),
            np.array([session.peer_regions[0].addr], dtype=np.int64),
            np.array([1], dtype=np.int64),
        )
        _iov.copy(session.pid, pair, time.monotonic() + self.timeout)

    # -- reading ------------------------------------------------------------------------

    def read_batch(
        self, session: Session, local_addrs: Int64Array, remote_addrs: Int64Array, lengths: Int64Array
    ) -> None:
        """Copy every ``[remote_addrs[i], +lengths[i])`` of the peer to ``local_addrs[i]``.

        Raises ``RegionError`` (nothing copied) for a range outside the peer's or this
        engine's registered regions; ``PeerGoneError`` when the peer died (also when it
        died during the read); ``TransferTimeout`` past ``timeout``; ``TransferError``
        otherwise, including bad arrays and a closed engine or session.
        """
        self._check_open()
        if not isinstance(session, LocalSession):
            raise TransferError(f"not a local-engine session: {type(session).__name__}")
        if session.closed:
            raise PeerGoneError(f"the session to {session.peer_id} is closed")
        n = check_read_arrays(local_addrs, remote_addrs, lengths, positive_lengths=False)
        if n == 0:
            return
        # Both sides are checked before a descriptor is built: nothing is copied on failure.
        deadline = time.monotonic() + self.timeout
        small = False
        if n <= FastBounds.SMALL:  # a tiny layer: in Python ints, no numpy call (each costs 1-3 us)
            local, remote, sizes = local_addrs.tolist(), remote_addrs.tolist(), lengths.tolist()
            if not (session.fast_bounds.few_inside(remote, sizes) and self._fast_bounds.few_inside(local, sizes)):
                self._refuse(session, local_addrs, remote_addrs, lengths)
            small = self.threads == 1 or sum(sizes) <= self.parallel_threshold_bytes
        elif not (
            session.fast_bounds.many_inside(remote_addrs, lengths) and self._fast_bounds.many_inside(local_addrs, lengths)
        ):
            self._refuse(session, local_addrs, remote_addrs, lengths)
        if small:
            _iov.copy_small(session.pid, local, remote, sizes, deadline)
        else:
            pair = _iov.build(local_addrs, remote_addrs, lengths)
            if self.threads > 1 and pair.nbytes > self.parallel_threshold_bytes:
                self._copy_parallel(session.pid, pair, deadline)
            else:
                _iov.copy(session.pid, pair, deadline)
        if session.peer_exited():
            raise PeerGoneError(f"peer process {session.pid} exited during the read; its data is not used")

    def _refuse(self, session: LocalSession, local_addrs: Int64Array, remote_addrs: Int64Array, lengths: Int64Array) -> NoReturn:
        """Raise the error that explains why the fast check said no."""
        if int(lengths.min()) <= 0:
            raise TransferError(f"every length must be > 0 (found {int(lengths.min())})")
        session.bounds.check(remote_addrs, lengths, f"remote range from {session.peer_id}")
        self._bounds.check(local_addrs, lengths, "local destination")
        raise RegionError("a range lies outside the registered regions")  # the two checks disagree: refuse

    def _copy_parallel(self, pid: int, pair: _iov.IovPair, deadline: float) -> None:
        shares = _iov.split(pair, self.threads)
        stop = [False]
        pool = self._get_pool()
        try:
            futures: list[Future[None]] = [pool.submit(_iov.copy, pid, s, deadline, stop) for s in shares[1:]]
        except RuntimeError:  # the pool was shut down by a concurrent close()
            raise TransferError("the local engine is closed") from None
        first: BaseException | None = None
        try:
            _iov.copy(pid, shares[0], deadline, stop)
        except BaseException as exc:
            first = exc
            stop[0] = True
        # Wait for every share even after a failure: the caller may reuse the destinations
        # as soon as we return, so no thread of ours may still be writing into them. Only a
        # syscall stuck past the deadline (cannot be cancelled) escapes this.
        _, pending = wait(futures, timeout=max(0.0, deadline - time.monotonic()) + 1.0)
        if pending:
            stop[0] = True
            raise TransferTimeout(f"read from process {pid} did not finish within {self.timeout} s")
        if first is not None:
            raise first
        for f in futures:
            exc = f.exception()
            if exc is not None:
                raise exc

    def _get_pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._closed:
                raise TransferError("the local engine is closed")
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self.threads - 1, thread_name_prefix="rd2h-local")
            return self._pool

    # -- lifetime -----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError("the local engine is closed")

    def close(self) -> None:
        """Close every session and join the copy threads. Idempotent."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
            sessions, self._sessions = self._sessions, []
            witness, self._witness = self._witness, None
        if witness is not None:
            witness.close()
        if pool is not None:
            pool.shutdown(wait=True)
        for s in sessions:
            s.close()

    def __enter__(self) -> LocalEngine:
        return self




def _as_regions(bounds: RegionSet) -> tuple[Region, ...]:
    return tuple(Region(addr, length) for addr, length in bounds)
