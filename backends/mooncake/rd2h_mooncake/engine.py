"""rd2h's transfer engine over Mooncake Transfer Engine, peer to peer (no etcd, no metadata server).

Each engine runs one ``mooncake.engine.TransferEngine`` initialized with ``P2PHANDSHAKE``: it
listens on an RPC port of its own, and a reader names its peer by ``"host:port"``. Prefill
registers its cache and sends the blob that ``register`` returns; Decode registers its
destinations, ``connect``s and reads.

Mooncake checks neither end of a read against what was registered (on TCP it writes into any
local address), answers every failure with ``-1``, fails a batch at once when more entries
than its per-peer queue holds are pending, and stalls on a stopped peer until its own
timeouts fire. So this engine checks both ends itself, splits batches under the queue
limit, sets mooncake's timeouts from its options, bounds every native call, and tells a
gone peer from a silent one by asking the peer's port afterwards.
"""

from __future__ import annotations

import ipaddress
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from rd2h.engine_support import (
    answers_at,
    bounded_call,
    breaks_session_on_timeout,
    check_read,
    check_region_kinds,
    goes_quiet,
)
from rd2h.errors import BackendUnavailableError, ConfigError, PeerGoneError, TransferError, TransferTimeout
from rd2h.interfaces import Availability, Capability, MemoryKinds, Region, Session, TransferEngine
from rd2h.layout.regions import HOST, RegionSet, merge_by_kind
from rd2h_mooncake import _metadata, _native

__all__ = ["MooncakeEngine", "MooncakeSession"]

log = logging.getLogger("rd2h_mooncake")

Int64Array = npt.NDArray[np.int64]

_ROLES = ("prefill", "decode")
_PROTOCOLS = ("tcp", "rdma")
_OPTIONS = (
    "hostname, protocol, device_name, timeout, transfer_timeout_s, progress_timeout_s, max_queued_per_peer"
)
DEFAULT_TIMEOUT = 30.0
PROBE_TIMEOUT_S = 2.0  # how long a failed read waits to learn whether the peer still answers


def _location(kind: str) -> str:
    """Mooncake's name for where memory of ``kind`` lives: ``"cpu:0"`` for host memory (it
    needs no NUMA node to move it), the kind itself for a GPU (``"cuda:0"``)."""
    return "cpu:0" if kind == HOST else kind


class MooncakeSession(Session):
    """A peer's handshake address and its registered regions."""

    def __init__(self, engine: MooncakeEngine, peer_id: str, regions: list[tuple[int, int]]) -> None:
        self.engine = engine
        self._peer_id = peer_id
        self.bounds = RegionSet(regions)
        self._regions = tuple(Region(a, n) for a, n in self.bounds)
        self.closed = False
        self.broken = ""  # why reads are refused after a read overran its bound

    @property
    def peer_id(self) -> str:
        return self._peer_id

    @property
    def peer_regions(self) -> tuple[Region, ...]:
        return self._regions

    def close(self) -> None:
        self.closed = True


def _positive_int(name: str, value: object) -> int:
    if type(value) is not int or value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return value


class MooncakeEngine(TransferEngine):
    """Cross-host pull through Mooncake Transfer Engine (TCP here; RDMA where the NICs are).

    Options:

    - ``hostname``: the IPv4 address peers reach this engine at (default ``127.0.0.1``: set it
      for cross-host use); ``protocol``: ``"tcp"`` or ``"rdma"``; ``device_name``: RDMA NICs
      (mooncake's own syntax, empty for TCP);
    - ``timeout``: seconds a ``read_batch`` (or any other mooncake call) may take in all;
    - mooncake's own bounds, process-wide (``ConfigError`` if two engines of a process
      disagree): ``transfer_timeout_s`` (``MC_TRANSFER_TIMEOUT``), ``progress_timeout_s``
      (``MC_TCP_PROGRESS_TIMEOUT_SEC``, how long a silent peer stalls a read; mooncake's
      default is 30 s) and ``max_queued_per_peer`` (``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER``;
      batches are split into parts of at most this many descriptors).

    Keep ``transfer_timeout_s`` and ``progress_timeout_s`` below ``timeout``, so that mooncake
    gives up by itself and nothing is still in flight when ``read_batch`` raises.
    """

    name = "mooncake"
    capabilities = (
        Capability.READ_FROM_HOST
        | Capability.WRITE_TO_HOST
        | Capability.CROSS_HOST
        | Capability.NEEDS_REGISTERED_DESTINATIONS
    )

    @classmethod
    def availability(cls) -> Availability:
        ok, reason = _native.environment()
        return Availability(ok, reason)

    @classmethod
    def memory_kinds(cls) -> MemoryKinds:
        """Host memory, and CUDA memory both ways with a CUDA build of mooncake installed
        (``mooncake-transfer-engine``, ``-cuda13``, ``-efa``): mooncake registers a GPU buffer
        under its location (``"cuda:N"``) and its transports copy to and from it. The
        ``-non-cuda`` wheel moves host memory only (``_native.device_types``)."""
        kinds = frozenset({HOST, *_native.device_types()})
        return MemoryKinds(kinds, kinds)

    def __init__(
        self,
        role: str,
        *,
        hostname: str = "127.0.0.1",
        protocol: str = "tcp",
        device_name: str = "",
        timeout: float = DEFAULT_TIMEOUT,
        transfer_timeout_s: int = 10,
        progress_timeout_s: int = 5,
        max_queued_per_peer: int = 2048,
        **unknown: object,
    ) -> None:
        if unknown:
            raise ConfigError(
                f"unknown option(s) for the mooncake engine: {', '.join(sorted(unknown))} (known: {_OPTIONS})"
            )
        if role not in _ROLES:
            raise ConfigError(f"role must be one of {_ROLES}, got {role!r}")
        try:
            ipaddress.IPv4Address(hostname)
        except (ipaddress.AddressValueError, TypeError):
            raise ConfigError(f"hostname must be an IPv4 address peers can reach, got {hostname!r}") from None
        if protocol not in _PROTOCOLS:
            raise ConfigError(f"protocol must be one of {_PROTOCOLS}, got {protocol!r}")
        if not isinstance(device_name, str):
            raise ConfigError(f"device_name must be a string, got {device_name!r}")
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0:
            raise ConfigError(f"timeout must be a number of seconds > 0, got {timeout!r}")
        knobs = _native.Knobs(
            _positive_int("transfer_timeout_s", transfer_timeout_s),
            _positive_int("progress_timeout_s", progress_timeout_s),
            _positive_int("max_queued_per_peer", max_queued_per_peer),
        )
        ok, reason = _native.environment()
        if not ok:
            raise BackendUnavailableError(f"the mooncake engine cannot run here: {reason}")
        _native.apply(knobs)
        mc = _native.import_engine()
        self.role = role
        self.hostname = hostname
        self.protocol = protocol
        self.timeout = float(timeout)
        self.knobs = knobs
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when a read leaves mooncake
        self._active = 0
        self._closed = False
        self._bounds = RegionSet()
        self._regions: list[Region] = []  # everything registered, merged kind by kind
        self._native_regions: dict[int, tuple[int, str]] = {}  # addr -> (length, location), as mooncake holds them
        self._peer_locks: dict[str, threading.Lock] = {}
        te = mc.TransferEngine()
        rc = bounded_call(
            "mooncake", "initialize", lambda: te.initialize(hostname, "P2PHANDSHAKE", protocol, device_name), self.timeout
        )
        if rc != 0:
            raise TransferError(
                f"mooncake initialize({hostname}, P2PHANDSHAKE, {protocol}, {device_name!r}) failed (rc {rc}); "
                "its log on stderr says why"
            )
        self._te: Any = te
        self._session_id = f"{hostname}:{te.get_rpc_port()}"

    # -- identity and registration ------------------------------------------------------

    @property
    def session_id(self) -> str:
        return self._session_id

    def register(self, regions: Sequence[Region]) -> bytes:
        """Add regions; returns metadata covering all of them. Each is registered with
        mooncake under its location: ``"cpu:0"`` for host memory, its kind (``"cuda:0"``)
        for device memory.

        Raises ``TransferError`` for memory of a kind this build of mooncake does not move
        (``memory_kinds``), a closed engine or a refusal by mooncake.
        """
        check_region_kinds(self, regions)
        with self._lock:
            self._check_open()
            merged = merge_by_kind([*self._regions, *regions])
            bounds = RegionSet([*self._bounds, *((r.addr, r.length) for r in regions)])
            self._sync_native({r.addr: (r.length, _location(r.kind)) for r in merged})
            self._bounds, self._regions = bounds, merged
            return _metadata.encode(self._session_id, list(bounds))

    def _sync_native(self, wanted: dict[int, tuple[int, str]]) -> None:
        """Make mooncake's registrations equal ``wanted`` (merged ranges replace their parts)."""
        te = self._te
        for addr, entry in list(self._native_regions.items()):
            if wanted.get(addr) != entry:
                rc = bounded_call("mooncake", "unregister_memory", lambda a=addr: te.unregister_memory(a), self.timeout)
                if rc != 0:
                    raise TransferError(f"mooncake unregister_memory({addr:#x}) failed (rc {rc})")
                del self._native_regions[addr]
        for addr, (length, location) in wanted.items():
            if addr not in self._native_regions:
                rc = bounded_call(
                    "mooncake", "register_memory",
                    lambda a=addr, n=length, at=location: te.register_memory(a, n, at), self.timeout,
                )  # fmt: skip
                if rc != 0:
                    raise TransferError(f"mooncake register_memory({addr:#x}, {length}, {location!r}) failed (rc {rc})")
                self._native_regions[addr] = (length, location)

    def connect(self, peer_metadata: bytes) -> MooncakeSession:
        """A session to the engine that produced ``peer_metadata``.

        Raises ``TransferError`` for a malformed blob, ``PeerGoneError`` when nothing answers
        at the peer's handshake address.
        """
        self._check_open()
        peer_id, regions = _metadata.decode(peer_metadata)
        if not answers_at(peer_id, min(self.timeout, PROBE_TIMEOUT_S)):
            raise PeerGoneError(f"no mooncake engine answers at {peer_id}")
        return MooncakeSession(self, peer_id, regions)

    # -- reading ------------------------------------------------------------------------

    def read_batch(
        self, session: Session, local_addrs: Int64Array, remote_addrs: Int64Array, lengths: Int64Array
    ) -> None:
        """Read every ``[remote_addrs[i], +lengths[i])`` of the peer into ``local_addrs[i]``.

        Raises ``RegionError`` (nothing read) for a range outside the peer's or this engine's
        registered regions; ``PeerGoneError`` when the peer no longer answers;
        ``TransferTimeout`` when mooncake reported no progress or the call ran past
        ``timeout`` (the session then refuses reads: the native call may still be writing);
        ``TransferError`` otherwise, including bad arrays and a closed engine or session.
        """
        self._check_open()
        n = check_read(self, session, self._bounds, local_addrs, remote_addrs, lengths)
        if n == 0:
            return
        start = time.monotonic()
        peer_lock = self._enter(session.peer_id)
        with breaks_session_on_timeout(session):
            rc, at = self._read_bounded(session.peer_id, peer_lock, local_addrs, remote_addrs, lengths, start)
        if rc != 0:
            self._raise_failure(session, rc, at, n, time.monotonic() - start)

    def _enter(self, peer_id: str) -> threading.Lock:
        """Count a read in and take the peer's lock: one batch per peer at a time keeps the
        entries mooncake queues for that peer under ``max_queued_per_peer``."""
        with self._lock:
            self._check_open()
            peer_lock = self._peer_locks.setdefault(peer_id, threading.Lock())
            self._active += 1
        if not peer_lock.acquire(timeout=self.timeout):
            self._leave()
            raise TransferTimeout(f"an earlier read from {peer_id} is still inside mooncake after {self.timeout} s")
        return peer_lock

    def _leave(self) -> None:
        with self._lock:
            self._active -= 1
            self._idle.notify_all()

    def _read_bounded(
        self,
        peer_id: str,
        peer_lock: threading.Lock,
        local_addrs: Int64Array,
        remote_addrs: Int64Array,
        lengths: Int64Array,
        start: float,
    ) -> tuple[int, int]:
        te, step = self._te, self.knobs.max_queued_per_peer

        def parts() -> tuple[int, int]:
            # runs in the bounded thread; the lock and the count are released when mooncake
            # lets go, even after the caller gave up waiting
            try:
                for lo in range(0, len(lengths), step):
                    hi = lo + step
                    rc = te.batch_transfer_sync_read(
                        peer_id, local_addrs[lo:hi].tolist(), remote_addrs[lo:hi].tolist(), lengths[lo:hi].tolist()
                    )
                    if rc != 0:
                        return int(rc), lo
                return 0, len(lengths)
            finally:
                peer_lock.release()
                self._leave()

        remaining = self.timeout - (time.monotonic() - start)
        return bounded_call("mooncake", "batch_transfer_sync_read", parts, remaining)

    def _raise_failure(self, session: MooncakeSession, rc: int, at: int, n: int, took: float) -> None:
        where = f"mooncake read of {n} ranges from {session.peer_id} failed (rc {rc}, part from range {at})"
        if goes_quiet(session.peer_id, within=PROBE_TIMEOUT_S):
            raise PeerGoneError(f"{where}: nothing answers at {session.peer_id} any more")
        bound = min(self.knobs.progress_timeout_s, self.knobs.transfer_timeout_s)
        if took >= 0.9 * bound:
            raise TransferTimeout(f"{where} after {took:.1f} s: the peer made no progress within mooncake's {bound} s")
        raise TransferError(f"{where} after {took:.3f} s; mooncake's log on stderr says why")

    # -- lifetime -----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError("the mooncake engine is closed")

    def close(self) -> None:
        """Wait (up to ``timeout``) for reads inside mooncake, then unregister everything.

        Idempotent; never raises. If a read is still stuck, the registrations are left in
        place (mooncake may still write there) and the native engine goes when that read does.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            stuck = not self._idle.wait_for(lambda: self._active == 0, self.timeout)
        if stuck:
            log.warning("mooncake engine %s closed with a read still inside mooncake", self._session_id)
        else:
            try:
                self._sync_native({})
            except TransferError as exc:
                log.warning("mooncake engine %s: %s", self._session_id, exc)
        self._te = None  # the native engine shuts down when its last reference goes

    def __enter__(self) -> MooncakeEngine:
        return self

    def __repr__(self) -> str:
        state = "closed" if self._closed else self._session_id
        return f"<MooncakeEngine {self.role} {self.protocol} {state}>"
