"""Decode pulls KV cache from Prefill through memfabric-hybrid's ``TransferEngine``.

Role arrangement (memfabric-hybrid 1.3.0, found by experiment; see the README): the rd2h
Prefill side initializes memfabric with role ``"Prefill"``, the Decode side with role
``"Decode"``, and both with ``store_server_role="Prefill"``. A Prefill engine is then
passive: it serves a config store at its own session address and answers reads. A Decode
engine initiates batched reads against a Prefill session and reaches its store on the first
read. (With the default ``store_server_role="Decode"`` only the Prefill side could start
transfers, the push model; Decode reading failed with "session not found".)
"""

from __future__ import annotations

import ipaddress
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from rd2h.engine_support import breaks_session_on_timeout, check_read, check_region_kinds
from rd2h.errors import ConfigError, PeerGoneError, PortError, TransferError
from rd2h.interfaces import HOST_ONLY, Availability, Capability, MemoryKinds, Region, Session, TransferEngine
from rd2h.layout.regions import RegionSet
from rd2h_memfabric import _metadata, _native

__all__ = ["MemFabricEngine", "MemFabricSession"]

Int64Array = npt.NDArray[np.int64]

_ROLES = ("prefill", "decode")
DEFAULT_TIMEOUT = 30.0
# A legacy peer's registered regions are unknown: its session may name any address below 2**63.
_UNPROVEN_END = 2**63 - 1
_ALL_KINDS = MemoryKinds(frozenset({"host", "npu"}), frozenset({"host", "npu"}))


class MemFabricSession(Session):
    """A Decode engine's connection to one Prefill engine (memfabric connects on first read)."""

    def __init__(self, engine: MemFabricEngine, peer_id: str, regions: list[tuple[int, int]]) -> None:
        self.engine = engine
        self._peer_id = peer_id
        self.bounds = RegionSet(regions)
        self._regions = tuple(Region(a, n) for a, n in self.bounds)
        self.closed = False
        self.broken = ""  # why reads on this session are refused (a read overran its bound)

    @property
    def peer_id(self) -> str:
        return self._peer_id

    @property
    def peer_regions(self) -> tuple[Region, ...]:
        return self._regions

    def close(self) -> None:
        self.closed = True


def _unknown_options(unknown: dict[str, object]) -> ConfigError:
    known = "store_url, hostname, port, device_id, data_op, start_store, timeout"
    return ConfigError(f"unknown option(s) for the memfabric engine: {', '.join(sorted(unknown))} (known: {known})")


def _path_kinds(data_op: str) -> MemoryKinds:
    # a host transport (memfabric's CPU path: "host_*") copies with the CPU: host memory only
    return HOST_ONLY if data_op.startswith("host_") else _ALL_KINDS


def _resolve_data_op(data_op: str) -> str:
    if data_op == "auto":
        # memfabric's own default where an NPU is; its host TCP path everywhere else
        return "sdma" if _native.npu_present() else "host_tcp"
    if data_op not in _native.DATA_OPS:
        raise ConfigError(f"data_op must be 'auto' or one of {_native.DATA_OPS}, got {data_op!r}")
    return data_op


class MemFabricEngine(TransferEngine):
    """Transfer engine over memfabric-hybrid (``pip install rd2h[memfabric]``).

    Options: ``store_url`` (``"tcp://ip:port"``, passed to memfabric; see the README for
    what 1.3.0 does with it), ``hostname`` (the IPv4 address in this engine's session id),
    ``port`` (session port; ``None`` lets memfabric pick a free one), ``device_id``,
    ``data_op`` (``"auto"``, ``"host_tcp"``, ``"sdma"``, ``"device_rdma"``; auto is sdma where
    an Ascend NPU is and host_tcp elsewhere), ``start_store`` (this process starts the config
    store at ``store_url``) and ``timeout`` (seconds any memfabric call may block).

    memfabric's engine is process-wide: engines made in one process with the same
    configuration share it (the last ``close`` uninitializes it); another configuration
    raises ``ConfigError`` naming both. Construction raises ``ConfigError`` for bad options,
    ``BackendUnavailableError`` when memfabric cannot run here, ``TransferError`` when it
    refuses to start and ``TransferTimeout`` when it does not answer.
    """

    name = "memfabric"
    capabilities = (
        Capability.READ_FROM_HOST
        | Capability.READ_FROM_DEVICE
        | Capability.WRITE_TO_HOST
        | Capability.WRITE_TO_DEVICE
        | Capability.CROSS_HOST
        | Capability.NEEDS_REGISTERED_DESTINATIONS
    )

    @classmethod
    def availability(cls) -> Availability:
        ok, reason = _native.environment()
        return Availability(ok, reason)

    @classmethod
    def memory_kinds(cls) -> MemoryKinds:
        """Host and Ascend NPU memory, both ways: what some data path moves. memfabric's
        device data paths (SDMA, device RDMA) copy device-to-host, host-to-device,
        device-to-device and host-to-host; its host transport (``host_tcp``) moves host memory
        only (``memory_kinds_for``)."""
        return _ALL_KINDS

    @classmethod
    def memory_kinds_for(cls, options: Mapping[str, Any]) -> MemoryKinds:
        """What an engine built with ``options`` moves: host only on a host transport
        (``data_op="host_tcp"``, or ``"auto"`` where no Ascend NPU is), host and NPU on a device
        data path. A ``data_op`` the constructor refuses gets ``memory_kinds()``."""
        data_op = options.get("data_op", "auto")
        if data_op == "auto":
            data_op = _resolve_data_op(data_op)
        return _path_kinds(data_op) if data_op in _native.DATA_OPS else _ALL_KINDS

    def memory_kinds_in_use(self) -> MemoryKinds:
        """What this engine's data path moves (``data_op``, resolved): host only on
        ``host_tcp``, host and NPU on ``sdma`` and ``device_rdma``."""
        return _path_kinds(self.data_op)

    def __init__(
        self,
        role: str,
        *,
        store_url: str,
        hostname: str = "127.0.0.1",
        port: int | None = None,
        device_id: int = 0,
        data_op: str = "auto",
        start_store: bool = False,
        timeout: float = DEFAULT_TIMEOUT,
        **unknown: object,
    ) -> None:
        if unknown:
            raise _unknown_options(unknown)
        if role not in _ROLES:
            raise ConfigError(f"role must be one of {_ROLES}, got {role!r}")
        if not isinstance(store_url, str) or not store_url.startswith("tcp://"):
            raise ConfigError(f"store_url must look like 'tcp://ip:port', got {store_url!r}")
        try:
            _metadata.split_session_id(store_url[len("tcp://") :])
            if not isinstance(ipaddress.ip_address(hostname), ipaddress.IPv4Address):
                raise ValueError
        except ValueError:
            raise ConfigError(
                f"store_url must be 'tcp://ip:port' and hostname an IPv4 address, got {store_url!r}, {hostname!r}"
            ) from None
        if port is not None and (type(port) is not int or not 0 < port < 65536):
            raise PortError(f"port must be 1..65535 or None, got {port!r}")
        if type(device_id) is not int or device_id < 0:
            raise ConfigError(f"device_id must be an integer >= 0, got {device_id!r}")
        if not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ConfigError(f"timeout must be a number of seconds > 0, got {timeout!r}")
        config = _native.Config(role, store_url, hostname, port, device_id, _resolve_data_op(data_op))
        self.role = role
        self.timeout = float(timeout)
        self._native = _native.acquire(config, bool(start_store), self.timeout)
        self._lock = threading.Lock()
        self._bounds = RegionSet()
        self._closed = False

    # -- identity and registration ------------------------------------------------------

    @property
    def session_id(self) -> str:
        return self._native.session_id

    @property
    def data_op(self) -> str:
        """The memfabric data path in use (``"auto"`` resolved)."""
        return self._native.config.data_op

    @property
    def registered_regions(self) -> tuple[Region, ...]:
        """Every region registered through this engine, merged where they overlap or touch."""
        return tuple(Region(a, n) for a, n in self._bounds)

    def register(self, regions: Sequence[Region]) -> bytes:
        """Register more memory (merged with what is registered) and return metadata covering
        all of it. Raises ``TransferError`` for memory this engine's data path does not move
        (``memory_kinds_in_use``), when memfabric refuses or the engine is closed,
        ``TransferTimeout`` when it does not answer."""
        check_region_kinds(self, regions)  # as configured: memory_kinds_in_use
        with self._lock:
            self._check_open()
            bounds = RegionSet([*self._bounds, *((r.addr, r.length) for r in regions)])
            self._native.set_regions(id(self), list(bounds), self.timeout)
            self._bounds = bounds
            return _metadata.encode(self.session_id, list(bounds))

    def connect(self, peer_metadata: bytes) -> MemFabricSession:
        """A session to the Prefill engine that produced ``peer_metadata``.

        Only a Decode engine reads. Raises ``TransferError`` for a malformed blob or a
        Prefill-side engine, ``PeerGoneError`` when nothing answers at the peer's address.
        """
        self._check_open()
        peer_id, regions = _metadata.decode(peer_metadata)
        if self.role != "decode":
            raise TransferError("only a decode-side memfabric engine reads; this one is prefill")
        if not _native.peer_listening(peer_id, min(self.timeout, 5.0)):
            raise PeerGoneError(f"no memfabric Prefill engine answers at {peer_id}")
        return MemFabricSession(self, peer_id, regions)

    def connect_legacy(self, p_session: str) -> MemFabricSession:
        """A session to a reference-implementation Prefill known only by its ``"ip:port"``.

        memfabric reaches a peer by session id alone, so this works where ``connect`` would;
        but such a peer sends no list of what it registered, so the session's
        ``peer_regions`` is the whole 63-bit address space: it comes from nothing the peer
        proved, and reads from it are checked on the Decode (destination) side only.
        Raises ``TransferError`` for a session id that is not ``"ip:port"`` or a Prefill-side
        engine, ``PeerGoneError`` when nothing answers there.
        """
        self._check_open()
        if not isinstance(p_session, str):
            raise TransferError(f"a memfabric session id is an 'ip:port' string, got {type(p_session).__name__}")
        try:
            _metadata.split_session_id(p_session)
        except ValueError as exc:
            raise TransferError(f"legacy peer: {exc}") from None
        if self.role != "decode":
            raise TransferError("only a decode-side memfabric engine reads; this one is prefill")
        if not _native.peer_listening(p_session, min(self.timeout, 5.0)):
            raise PeerGoneError(f"no memfabric Prefill engine answers at {p_session}")
        return MemFabricSession(self, p_session, [(0, _UNPROVEN_END)])

    # -- reading ------------------------------------------------------------------------

    def read_batch(
        self, session: Session, local_addrs: Int64Array, remote_addrs: Int64Array, lengths: Int64Array
    ) -> None:
        """One synchronous memfabric batched read of every ``[remote_addrs[i], +lengths[i])``.

        Raises ``RegionError`` (nothing read) for a range outside the peer's or this
        engine's registered regions; ``PeerGoneError`` when the peer is gone;
        ``TransferTimeout`` past ``timeout`` (the session then refuses further reads: the
        native call cannot be cancelled and may still write the destinations until
        memfabric gives up on its own); ``TransferError`` otherwise, including bad arrays
        and a closed engine or session.
        """
        self._check_open()
        # memfabric checks neither side (it reads outside the peer's registrations and writes
        # to unregistered local memory): check_read checks both, before anything moves.
        if check_read(self, session, self._bounds, local_addrs, remote_addrs, lengths, broken=PeerGoneError) == 0:
            return
        with breaks_session_on_timeout(session):
            self._native.read(session.peer_id, local_addrs.tolist(), remote_addrs.tolist(), lengths.tolist(), self.timeout)

    # -- lifetime -----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError("the memfabric engine is closed")

    def close(self) -> None:
        """Unregister this engine's memory; the last engine of the process uninitializes
        memfabric. Idempotent; never raises (a failure is logged)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._native.release(id(self), self.timeout)

    def __enter__(self) -> MemFabricEngine:
        return self

    def __repr__(self) -> str:
        state = "closed" if self._closed else self.session_id
        return f"<MemFabricEngine {self.role} {self.data_op} {state} pid={os.getpid()}>"
