"""rd2h's transfer engine over a NIXL agent (UCX backend): one agent per engine, metadata in the blob.

Prefill registers its cache with its agent and sends the agent's NIXL metadata inside the
blob ``register`` returns; Decode loads it (``loadRemoteMD``), and each ``read_batch`` is one
NIXL READ request, posted and then polled to completion by the calling thread.

NIXL's Python wrapper fixes the agent's progress-thread delay at 0, a thread that spins a
whole core (on 2 cores it halves throughput), so the agent is built from NIXL's bindings with
the delay as an option. The reading side runs without a progress thread by default: polling
the request is its progress. The serving side keeps one (UCX over TCP emulates a remote read
with messages the target must progress). NIXL checks remote ranges only against the peer's
registrations and never bounds a transfer: a request to a stopped TCP peer stays in
progress for ever. So this engine checks both ends itself and bounds every request.

GPU memory is registered as NIXL ``VRAM`` with its device index (UCX then picks ``cuda_ipc``
between two processes of one host, RDMA across hosts); a read whose ranges span several kinds
of memory is one request per pair of kinds, posted together and polled together.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Sequence
from types import ModuleType
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from rd2h.engine_support import breaks_session_on_timeout, check_read, check_region_kinds
from rd2h.errors import BackendUnavailableError, ConfigError, TransferError, TransferTimeout
from rd2h.interfaces import Availability, Capability, MemoryKinds, Region, Session, TransferEngine
from rd2h.layout.regions import HOST, KindIndex, RegionSet, device_index, device_type, merge_by_kind
from rd2h_nixl import _metadata, _native

__all__ = ["NixlEngine", "NixlSession"]

log = logging.getLogger("rd2h_nixl")

Int64Array = npt.NDArray[np.int64]

_ROLES = ("prefill", "decode")
_OPTIONS = "timeout, backend, progress_thread, progress_delay_us, poll_interval_us, agent_name, ucx_tls"
DEFAULT_TIMEOUT = 30.0
GRACE_S = 1.0  # how long past its deadline a request may take to be cancelled and released
SPIN_S = 0.001  # a READ is polled flat out this long, then every poll_interval_us
_names = itertools.count()
# Host and CUDA memory, both ways: the nixl wheels (nixl-cu12, nixl-cu13) are CUDA builds whose
# UCX backend registers GPU memory as VRAM.
_KINDS = MemoryKinds(frozenset({HOST, "cuda"}), frozenset({HOST, "cuda"}))


class Group(NamedTuple):
    """The ranges of one read between one local and one remote memory kind, as NIXL
    descriptors ``(addr, length, device index)``: one NIXL request."""

    local_kind: str
    local: np.ndarray
    remote_kind: str
    remote: np.ndarray


def _descs(addrs: Int64Array, lengths: Int64Array, kind: str) -> np.ndarray:
    device = np.full(len(addrs), device_index(kind), dtype=np.int64)
    return np.stack([addrs, lengths, device], axis=1).astype(np.uint64)


class NixlSession(Session):
    """A loaded remote agent and the regions its engine registered."""

    def __init__(self, engine: NixlEngine, agent: str, regions: Sequence[Region]) -> None:
        self.engine = engine
        self.agent = agent
        self.bounds = RegionSet(regions)
        self.kinds = KindIndex(regions)  # the memory kind of every remote range
        self._regions = tuple(merge_by_kind(regions))
        self.closed = False
        self.broken = ""  # why reads are refused after a request could not be released

    @property
    def peer_id(self) -> str:
        return self.agent

    @property
    def peer_regions(self) -> tuple[Region, ...]:
        return self._regions

    def close(self) -> None:
        self.closed = True


class NixlEngine(TransferEngine):
    """Pull through a NIXL agent; UCX picks the transport (``cma`` on one host, TCP or RDMA across).

    Options:

    - ``timeout``: seconds a ``read_batch`` (or another agent call) may take; a request still
      in progress then is cancelled and ``TransferTimeout`` raised;
    - ``backend``: the NIXL backend plugin (default ``"UCX"``);
    - ``progress_thread``: run the agent's progress thread (default: on for ``prefill``, which
      is read from, off for ``decode``, which polls its own requests);
    - ``progress_delay_us``: the pause of that thread between rounds (0 spins a core);
    - ``poll_interval_us``: how often a READ still in progress after its first millisecond is
      polled (0: flat out; the poll is the reading side's progress, and on few cores a
      spinning reader takes the CPU the kernel's TCP work and the peer need);
    - ``agent_name``: this agent's name (default unique per process and engine);
    - ``ucx_tls``: sets ``UCX_TLS`` (e.g. ``"tcp"`` to keep two processes of one host off
      ``cma``); process-wide, read by UCX when the first agent starts.
    """

    name = "nixl"
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
        """Host and CUDA memory, read from and written to: GPU memory is registered as NIXL
        VRAM with its device index, host memory as DRAM."""
        return _KINDS

    def __init__(
        self,
        role: str,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        backend: str = "UCX",
        progress_thread: bool | None = None,
        progress_delay_us: int = 100,
        poll_interval_us: int = 100,
        agent_name: str | None = None,
        ucx_tls: str | None = None,
        **unknown: object,
    ) -> None:
        if unknown:
            raise ConfigError(f"unknown option(s) for the nixl engine: {', '.join(sorted(unknown))} (known: {_OPTIONS})")
        if role not in _ROLES:
            raise ConfigError(f"role must be one of {_ROLES}, got {role!r}")
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0:
            raise ConfigError(f"timeout must be a number of seconds > 0, got {timeout!r}")
        if progress_thread is None:
            progress_thread = role == "prefill"
        if not isinstance(progress_thread, bool):
            raise ConfigError(f"progress_thread must be true or false, got {progress_thread!r}")
        for opt, value in (("progress_delay_us", progress_delay_us), ("poll_interval_us", poll_interval_us)):
            if type(value) is not int or value < 0:
                raise ConfigError(f"{opt} must be an integer >= 0, got {value!r}")
        for opt, value in (("backend", backend), ("agent_name", agent_name), ("ucx_tls", ucx_tls)):
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigError(f"{opt} must be a non-empty string, got {value!r}")
        ok, reason = _native.environment()
        if not ok:
            raise BackendUnavailableError(f"the nixl engine cannot run here: {reason}")
        if ucx_tls is not None:
            os.environ["UCX_TLS"] = ucx_tls
        _native.prepare_environment()
        self.role = role
        self.timeout = float(timeout)
        self.progress_thread = progress_thread
        self.poll_sleep_s = poll_interval_us / 1e6
        self.agent_name = agent_name or f"rd2h-{role}-{socket.gethostname()}-{os.getpid()}-{next(_names)}"
        self._nx: ModuleType = _native.import_nixl()._bindings
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when a read leaves the agent
        self._active = 0
        self._closed = False
        self._bounds = RegionSet()
        self._regions: list[Region] = []  # everything registered, merged kind by kind
        self._kinds = KindIndex()  # the memory kind of every local destination
        self._reg_lists: dict[Region, Any] = {}  # merged region -> its nixlRegDList
        self._remotes: dict[str, bytes] = {}  # loaded remote agents -> the metadata loaded
        self._stuck: list[Any] = []  # requests NIXL would not release; kept so nothing frees them
        self._agent, self._backend = _native.call(
            "agent", lambda: self._make_agent(backend, progress_thread, progress_delay_us), self.timeout
        )

    def _make_agent(self, backend: str, progress_thread: bool, delay_us: int) -> tuple[Any, Any]:
        nx = self._nx
        config = nx.nixlAgentConfig()
        config.useProgThread = progress_thread
        config.useListenThread = False  # metadata travels in rd2h's handshake, not NIXL's listener
        config.pthrDelay = delay_us
        config.syncMode = nx.NIXL_THREAD_SYNC_STRICT  # several rd2h threads may read at once
        config.captureTelemetry = False
        agent = nx.nixlAgent(self.agent_name, config)
        if backend not in agent.getAvailPlugins():
            raise ConfigError(f"NIXL has no backend plugin {backend!r} here (it has {agent.getAvailPlugins()})")
        params, _mems = agent.getPluginParams(backend)
        return agent, agent.createBackend(backend, params)

    # -- identity and registration ------------------------------------------------------

    @property
    def session_id(self) -> str:
        return self.agent_name

    def register(self, regions: Sequence[Region]) -> bytes:
        """Add regions (host memory as DRAM, GPU memory as VRAM of its device); returns
        metadata (this agent's NIXL metadata and each region's kind included) covering all.

        Raises ``TransferError`` for memory of a kind NIXL does not move here
        (``memory_kinds``), regions of two kinds that overlap, a closed engine or a refusal
        by NIXL.
        """
        check_region_kinds(self, regions)
        with self._lock:
            self._check_open()
            merged = merge_by_kind([*self._regions, *regions])
            try:
                kinds = KindIndex(merged)
            except ValueError as exc:
                raise TransferError(f"nixl cannot register these regions: {exc}") from None
            bounds = RegionSet([*self._bounds, *((r.addr, r.length) for r in regions)])
            _native.call("registerMem", lambda: self._sync_registrations(set(merged)), self.timeout)
            self._bounds, self._regions, self._kinds = bounds, merged, kinds
            agent_md = _native.call("getLocalMD", self._agent.getLocalMD, self.timeout)
            ranges = [(r.addr, r.length) for r in merged]
            return _metadata.encode(self.agent_name, agent_md, ranges, [r.kind for r in merged])

    def _segment(self, kind: str) -> Any:
        """NIXL's memory type for ``kind``: DRAM for host memory, VRAM for a GPU's."""
        return self._nx.DRAM_SEG if device_type(kind) == HOST else self._nx.VRAM_SEG

    def _sync_registrations(self, wanted: set[Region]) -> None:
        """Make the agent's registrations equal ``wanted`` (merged ranges replace their parts)."""
        nx = self._nx
        for key in [k for k in self._reg_lists if k not in wanted]:
            self._agent.deregisterMem(self._reg_lists.pop(key), [self._backend])
        for region in sorted(wanted - self._reg_lists.keys(), key=lambda r: (r.kind, r.addr)):
            desc = (region.addr, region.length, device_index(region.kind), "")
            reg = nx.nixlRegDList(self._segment(region.kind), [desc])
            self._agent.registerMem(reg, [self._backend])
            self._reg_lists[region] = reg

    def connect(self, peer_metadata: bytes) -> NixlSession:
        """Load the peer's agent and connect to it.

        Raises ``TransferError`` for a malformed blob or an agent NIXL refuses,
        ``PeerGoneError`` when the peer does not answer.
        """
        self._check_open()
        name, agent_md, ranges, kinds = _metadata.decode(peer_metadata)
        try:
            regions = [Region(a, n, k) for (a, n), k in zip(ranges, kinds)]
            KindIndex(regions)
        except ValueError as exc:
            raise _metadata.ENVELOPE.malformed(str(exc)) from None
        with self._lock:
            self._check_open()
            if self._remotes.get(name) != agent_md:
                if name in self._remotes:  # the peer registered more since: load its new metadata
                    _native.call("invalidateRemoteMD", lambda: self._agent.invalidateRemoteMD(name), self.timeout)
                    del self._remotes[name]
                loaded = _native.call("loadRemoteMD", lambda: self._agent.loadRemoteMD(agent_md), self.timeout)
                loaded = loaded.decode() if isinstance(loaded, bytes) else loaded
                if loaded != name:
                    raise TransferError(f"the nixl metadata names agent {loaded!r}, the blob {name!r}")
                self._remotes[name] = agent_md
        _native.call("makeConnection", lambda: self._agent.makeConnection(name, [self._backend]), self.timeout)
        return NixlSession(self, name, regions)

    # -- reading ------------------------------------------------------------------------

    def read_batch(
        self, session: Session, local_addrs: Int64Array, remote_addrs: Int64Array, lengths: Int64Array
    ) -> None:
        """One NIXL READ of every ``[remote_addrs[i], +lengths[i])`` into ``local_addrs[i]``.

        Raises ``RegionError`` (nothing read) for a range outside the peer's or this engine's
        registered regions; ``PeerGoneError`` when NIXL reports the peer disconnected;
        ``TransferTimeout`` when the request did not finish within ``timeout`` (it is
        cancelled; if NIXL cannot cancel it the session refuses further reads, since the
        request may still write); ``TransferError`` otherwise, including bad arrays and a
        closed engine or session.
        """
        self._check_open()
        n = check_read(self, session, self._bounds, local_addrs, remote_addrs, lengths)
        if n == 0:
            return
        groups = self._groups(session, local_addrs, remote_addrs, lengths)
        deadline = time.monotonic() + self.timeout
        with self._lock:
            self._check_open()
            self._active += 1

        def read() -> str:
            # counted out by the thread inside the agent, not by the caller: a caller that gave
            # up must not let close() tear the agent down under a read still running
            try:
                return self._read(session, groups, deadline)
            finally:
                with self._lock:
                    self._active -= 1
                    self._idle.notify_all()

        with breaks_session_on_timeout(session):
            outcome = _native.call("read", read, self.timeout + GRACE_S)
        if outcome:
            raise TransferTimeout(f"nixl read of {n} ranges from {session.peer_id}: {outcome}")

    def _groups(
        self, session: NixlSession, local_addrs: Int64Array, remote_addrs: Int64Array, lengths: Int64Array
    ) -> list[Group]:
        """One ``Group`` per pair of memory kinds the ranges span (a NIXL descriptor list holds
        one memory type); one, without a lookup, where each side holds one kind (host memory,
        as a rule)."""
        local_kind, remote_kind = self._kinds.uniform, session.kinds.uniform
        if local_kind is not None and remote_kind is not None:
            local, remote = _descs(local_addrs, lengths, local_kind), _descs(remote_addrs, lengths, remote_kind)
            return [Group(local_kind, local, remote_kind, remote)]
        # check_read put every range inside a registered region: every code is >= 0
        width = len(session.kinds.kinds)
        pair = self._kinds.codes(local_addrs) * width + session.kinds.codes(remote_addrs)
        groups = []
        for code in np.unique(pair).tolist():
            pick = pair == code
            lk, rk = self._kinds.kinds[code // width], session.kinds.kinds[code % width]
            local, remote = _descs(local_addrs[pick], lengths[pick], lk), _descs(remote_addrs[pick], lengths[pick], rk)
            groups.append(Group(lk, local, rk, remote))
        return groups

    def _read(self, session: NixlSession, groups: list[Group], deadline: float) -> str:
        """Post every group's request and poll them together (in a bounded thread); "" when
        all are done, else why they timed out."""
        nx, agent = self._nx, self._agent
        reqs: list[Any] = []
        try:
            for g in groups:
                local = nx.nixlXferDList(self._segment(g.local_kind), g.local)
                remote = nx.nixlXferDList(self._segment(g.remote_kind), g.remote)
                reqs.append(agent.createXferReq(nx.NIXL_READ, local, remote, session.agent, b"", [self._backend]))
            statuses = [agent.postXferReq(req, b"") for req in reqs]
            spin_until = time.monotonic() + SPIN_S
            while nx.NIXL_IN_PROG in statuses and (now := time.monotonic()) < deadline:
                if now > spin_until:
                    time.sleep(self.poll_sleep_s)
                statuses = [agent.getXferStatus(r) if st == nx.NIXL_IN_PROG else st for r, st in zip(reqs, statuses)]
        except BaseException:
            for req in reqs:
                self._release(session, req)
            raise
        released = [self._release(session, req) for req in reqs]  # every one, whatever the others did
        if nx.NIXL_IN_PROG in statuses:
            why = f"still in progress after {self.timeout} s (a stopped peer or a cut link)"
            if not all(released):
                session.broken = why + "; NIXL could not cancel it"
            return why
        failed = [st for st in statuses if st != nx.NIXL_SUCCESS]
        if failed:
            raise TransferError(f"nixl read from {session.peer_id} ended with status {failed[0]}")
        return ""

    def _release(self, session: NixlSession, req: Any) -> bool:
        try:
            self._agent.releaseXferReq(req)
            return True
        except Exception as exc:  # noqa: BLE001 - an active request NIXL cannot cancel
            log.warning("nixl could not release a request to %s: %s", session.peer_id, exc)
            self._stuck.append(req)
            return False

    # -- lifetime -----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError("the nixl engine is closed")

    def close(self) -> None:
        """Wait (up to ``timeout``) for reads in the agent, deregister everything and drop the
        agent. Idempotent; never raises. With a read still stuck, the agent is left as it is."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            stuck = not self._idle.wait_for(lambda: self._active == 0, self.timeout) or bool(self._stuck)
        if stuck:
            log.warning("nixl engine %s closed with a request it could not release; the agent is kept", self.agent_name)
            return
        try:
            _native.call("close", self._teardown, self.timeout)
        except TransferError as exc:
            log.warning("nixl engine %s: %s", self.agent_name, exc)

    def _teardown(self) -> None:
        for name in list(self._remotes):
            try:
                self._agent.invalidateRemoteMD(name)
            except Exception:  # noqa: BLE001 - a peer already gone is fine here
                pass
        self._remotes.clear()
        self._sync_registrations(set())
        self._agent = None  # the agent and its UCX workers go with the last reference

    def __enter__(self) -> NixlEngine:
        return self

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<NixlEngine {self.role} {self.agent_name} {state}>"
