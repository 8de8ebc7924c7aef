"""The process's one memfabric-hybrid ``TransferEngine``, and bounded calls into it.

memfabric's engine is process-wide: every ``MemFabricEngine`` of a process is a handle on
one ``Native``, shared while their configurations agree and initialized by the first.

Every native call that can block runs in a thread of its own and is waited for at most
``timeout`` seconds (the GIL is released inside memfabric, so the wait is real). A call
that overruns cannot be cancelled: it is remembered, ``close`` waits for it (bounded too),
and if it is still stuck then the native engine is left as it is and the process is marked
*wedged*: a later ``MemFabricEngine`` in this process raises instead of touching it.
"""

from __future__ import annotations

import collections
import functools
import glob
import importlib.util
import itertools
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from rd2h.engine_support import answers_at, goes_quiet
from rd2h.errors import BackendUnavailableError, ConfigError, PeerGoneError, TransferError, TransferTimeout
from rd2h.layout.regions import RegionSet

__all__ = ["Config", "Native", "acquire", "environment", "npu_present"]

log = logging.getLogger("rd2h_memfabric")
native_log = logging.getLogger("rd2h_memfabric.native")

# The role arrangement that lets Decode pull (found by experiment with memfabric-hybrid 1.3.0):
# an engine whose role equals ``store_server_role`` is passive and serves a config store at its
# own session address; engines of the other role initiate reads and writes against it.
STORE_SERVER_ROLE = "Prefill"
MF_ROLES = {"prefill": "Prefill", "decode": "Decode"}
HOST_TCP = 4  # TransDataOpType(4): not a member of the 1.3.0 Python enum, but accepted
DATA_OPS = ("host_tcp", "sdma", "device_rdma")
INSTALL_HINT = "pip install rd2h[memfabric]"
# memfabric's close waits for its transport's reconnect attempts to a dead peer: ~32 s with the
# transport's default retries, ~5 s with one. Set unless the user chose otherwise.
HOST_TCP_ENV = {"HCOM_CONNECTION_RETRY_TIMES": "1"}
CLOSE_GRACE_S = 15.0  # close() waits at least this long for memfabric to shut down
# memfabric maps each registration in whole 2 MiB units and refuses two whose units overlap.
MAP_UNIT = 2 << 20


def npu_present() -> bool:
    """An Ascend NPU driver is loaded on this machine (its device files exist)."""
    return bool(glob.glob("/dev/davinci[0-9]*"))


def _preloaded(name: str) -> bool:
    try:
        with open("/proc/self/maps") as maps:
            return any(name in line for line in maps)
    except OSError:
        return False


def environment() -> tuple[bool, str]:
    """Whether memfabric-hybrid can start in this process; never imports or starts anything."""
    if importlib.util.find_spec("memfabric_hybrid") is None:
        return False, f"memfabric-hybrid is not installed ({INSTALL_HINT})"
    fake = os.environ.get("FAKE_ASCEND_INSTALL_INFO")
    if fake:  # the CPU test kit (tests/kit/memfabric-cpu): its shim must be in this process
        if not os.path.isfile(fake) or not _preloaded("librealpath_shim"):
            return False, "the memfabric CPU test kit is only half set up: start the process with its env.sh sourced"
    elif not os.path.isfile("/etc/ascend_install.info"):
        return False, (
            "no Ascend driver found (/etc/ascend_install.info is missing); memfabric-hybrid needs the Ascend "
            "driver and CANN (on a CPU-only machine, for tests only: tests/kit/memfabric-cpu)"
        )
    if not os.environ.get("ASCEND_HOME_PATH"):
        return False, "ASCEND_HOME_PATH is not set: source CANN's set_env.sh (or the test kit's env.sh)"
    return True, ""


@dataclass(frozen=True, slots=True)
class Config:
    role: str  # "prefill" | "decode"
    store_url: str
    hostname: str
    port: int | None  # None: memfabric picks a free one
    device_id: int
    data_op: str  # one of DATA_OPS ("auto" already resolved)

    def conflicts_with(self, other: Config) -> list[str]:
        """The fields that stop ``other`` from sharing an engine built with ``self``."""
        fields = ("role", "store_url", "hostname", "device_id", "data_op")
        bad = [f for f in fields if getattr(self, f) != getattr(other, f)]
        if other.port is not None and other.port != self.port:
            bad.append("port")
        return bad

    def describe(self) -> str:
        port = "auto" if self.port is None else self.port
        return (
            f"role={self.role} device_id={self.device_id} hostname={self.hostname} port={port} "
            f"data_op={self.data_op} store_url={self.store_url}"
        )


class _Errors:
    """Recent error lines of memfabric's own log: the text behind a bare return code."""

    def __init__(self) -> None:
        self._lines: collections.deque[tuple[int, str]] = collections.deque(maxlen=16)
        self._seq = itertools.count()

    def add(self, msg: str) -> None:
        self._lines.append((next(self._seq), msg))

    def since(self, mark: int) -> str:
        lines = [m for s, m in list(self._lines) if s >= mark]
        return lines[-1] if lines else ""

    def now(self) -> int:
        lines = list(self._lines)
        return lines[-1][0] + 1 if lines else 0


# memfabric's levels; 5 is its lifecycle trace, emitted whatever the level is set to
_LEVELS = {0: logging.DEBUG, 1: logging.INFO, 2: logging.WARNING, 3: logging.ERROR, 4: logging.CRITICAL, 5: logging.DEBUG}

_lock = threading.Lock()
_native: Native | None = None
_wedged = ""  # why this process's memfabric engine cannot be used again
_prefill_closed = False  # 1.3.0 cannot re-initialize a Prefill engine in the same process
_stores: set[str] = set()  # config stores this process started
_errors = _Errors()
_logger_installed = False


def _import() -> ModuleType:
    try:
        import memfabric_hybrid
    except ImportError as exc:
        raise BackendUnavailableError(f"memfabric-hybrid is not installed ({exc}); {INSTALL_HINT}") from exc
    except OSError as exc:  # its shared libraries failed to load
        raise BackendUnavailableError(f"memfabric-hybrid cannot load its libraries: {exc}") from exc
    return memfabric_hybrid


def _install_logger(mf: ModuleType) -> None:
    """Send memfabric's log into ``logging`` (and keep its errors for our messages)."""
    global _logger_installed
    if _logger_installed:
        return

    def forward(level: int, msg: str) -> None:
        if level in (3, 4):
            _errors.add(msg)
        native_log.log(_LEVELS.get(level, logging.ERROR), "%s", msg)

    mf.set_extern_logger(forward)
    effective = native_log.getEffectiveLevel()
    mf.set_log_level(next((k for k in range(4) if _LEVELS[k] >= effective), 3))
    _logger_installed = True


def acquire(config: Config, start_store: bool, timeout: float) -> Native:
    """The process's native engine for ``config``: the running one if compatible, else a new one.

    Raises ``ConfigError`` when a running engine has another configuration,
    ``BackendUnavailableError`` when memfabric cannot start here, ``TransferError`` when it
    refuses, ``TransferTimeout`` when it does not answer.
    """
    global _native
    with _lock:
        if _wedged:
            raise TransferError(f"memfabric in this process is unusable ({_wedged}); restart the process")
        if _native is not None:
            bad = _native.config.conflicts_with(config)
            if bad:
                raise ConfigError(
                    "memfabric's engine is process-wide and already runs here with another configuration "
                    f"({', '.join(bad)} differ): running [{_native.config.describe()}], "
                    f"requested [{config.describe()}]"
                )
            _native.refs += 1
            return _native
        if config.role == "prefill" and _prefill_closed:
            raise BackendUnavailableError(
                "memfabric-hybrid 1.3.0 cannot start a second Prefill engine in a process whose first one was "
                "closed (Decode then fails with 'session not found'): start a new process"
            )
        ok, reason = environment()
        if not ok:
            raise BackendUnavailableError(f"memfabric cannot run here: {reason}")
        mf = _import()
        _install_logger(mf)
        if start_store and config.store_url not in _stores:
            ret, text = _bounded(mf, "create_config_store", lambda: mf.create_config_store(config.store_url), timeout)
            if ret != 0:
                raise TransferError(f"memfabric create_config_store({config.store_url}) failed ({ret}): {text}")
            _stores.add(config.store_url)
        if config.data_op == "host_tcp":
            for key, value in HOST_TCP_ENV.items():
                os.environ.setdefault(key, value)
        _native = Native(mf, config, timeout)
        return _native


def _bounded(mf: ModuleType, what: str, fn: Callable[[], Any], timeout: float) -> tuple[Any, str]:
    """Run ``fn`` in a thread of its own; its result and memfabric's error text for it.

    Raises ``TransferTimeout`` after ``timeout`` seconds (the thread runs on: a native call
    cannot be cancelled) and ``TransferError`` when ``fn`` raises.
    """
    out: list[Any] = []
    mark = _errors.now()

    def run() -> None:
        try:
            ret = fn()
            text = ""
            if ret not in (0, None):
                text = mf.get_and_clear_last_err_msg().strip() or _errors.since(mark)
            out.append((ret, text))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            out.append(exc)

    t = threading.Thread(target=run, name=f"rd2h-memfabric-{what}", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise TransferTimeout(f"memfabric {what} did not return within {timeout} s")
    result = out[0]
    if isinstance(result, BaseException):
        raise TransferError(f"memfabric {what} raised {type(result).__name__}: {result}") from result
    return result


def _native_ranges(regions: RegionSet) -> dict[int, int]:
    """What to register with memfabric for ``regions``: ranges whose 2 MiB units overlap are
    registered as one range spanning both (the bytes between them were inside memfabric's
    mapping already). Peers still read only what ``regions`` covers: that is checked on the
    reading side against the metadata, which lists ``regions`` themselves."""
    spans: list[list[int]] = []
    for addr, length in regions:
        if spans and addr // MAP_UNIT * MAP_UNIT < -(-spans[-1][1] // MAP_UNIT) * MAP_UNIT:
            spans[-1][1] = max(spans[-1][1], addr + length)
        else:
            spans.append([addr, addr + length])
    return {start: end - start for start, end in spans}


def peer_listening(session_id: str, timeout: float) -> bool:
    """Whether a Prefill engine answers at ``session_id`` (its config store listens there)."""
    return answers_at(session_id, timeout)


class Native:
    """One initialized memfabric ``TransferEngine`` and the memory registered with it."""

    def __init__(self, mf: ModuleType, config: Config, timeout: float) -> None:
        self.mf = mf
        self.config = config
        self.refs = 1
        self._idle = threading.Condition()  # notified when a call leaves memfabric
        self._active = 0  # calls inside memfabric now, overrunning ones included
        self._closing = False
        self._reg_lock = threading.Lock()  # one registration change at a time
        self._registered: dict[int, int] = {}  # addr -> length, as memfabric holds them
        self._wanted: dict[int, list[tuple[int, int]]] = {}  # handle id -> its regions
        op = mf.TransferEngine.TransDataOpType
        data_op = {"host_tcp": op(HOST_TCP), "sdma": op.SDMA, "device_rdma": op.DEVICE_RDMA}[config.data_op]
        self.te = mf.TransferEngine()
        port = 0 if config.port is None else config.port
        ret, text = _bounded(
            mf,
            "initialize",
            lambda: self.te.initialize(
                config.store_url,
                f"{config.hostname}:{port}",
                MF_ROLES[config.role],
                config.device_id,
                data_op,
                STORE_SERVER_ROLE,
            ),
            timeout,
        )
        if ret != 0:
            raise TransferError(f"memfabric initialize [{config.describe()}] failed ({ret}): {text}")
        self.session_id = f"{config.hostname}:{self.te.get_rpc_port() if port == 0 else port}"

    def call(self, what: str, fn: Callable[[], Any], timeout: float) -> tuple[Any, str]:
        """``fn`` (a call into memfabric) run bounded, counted until it really returns."""
        with self._idle:
            if self._closing:
                raise TransferError("the memfabric engine is closed")
            self._active += 1

        def counted() -> Any:
            try:
                return fn()
            finally:
                with self._idle:
                    self._active -= 1
                    self._idle.notify_all()

        return _bounded(self.mf, what, counted, timeout)

    def set_regions(self, owner: int, regions: list[tuple[int, int]], timeout: float) -> None:
        """Make ``owner``'s regions ``regions``; memfabric gets the merged union of all owners."""
        with self._reg_lock:
            if regions:
                self._wanted[owner] = regions
            else:
                self._wanted.pop(owner, None)
            target = _native_ranges(RegionSet([r for rs in self._wanted.values() for r in rs]))
            drop = [a for a, n in self._registered.items() if target.get(a) != n]
            add = [(a, n) for a, n in target.items() if self._registered.get(a) != n]
            # Merged ranges replace the pieces they cover (memfabric refuses overlaps).
            for addr in drop:
                ret, text = self.call("unregister_memory", functools.partial(self.te.unregister_memory, addr), timeout)
                if ret != 0:
                    raise TransferError(f"memfabric unregister_memory({addr:#x}) failed ({ret}): {text}")
                del self._registered[addr]
            for addr, length in add:
                ret, text = self.call("register_memory", functools.partial(self.te.register_memory, addr, length), timeout)
                if ret != 0:
                    raise TransferError(f"memfabric register_memory({addr:#x}, {length}) failed ({ret}): {text}")
                self._registered[addr] = length

    def release(self, owner: int, timeout: float) -> None:
        """Drop one handle; the last one unregisters everything and uninitializes.

        Holds the module lock throughout, so no new handle can pick up an engine that is
        being closed. Never raises: a failure is logged (and wedges the process if the
        engine could not be closed).
        """
        global _native, _wedged, _prefill_closed
        timeout = max(timeout, CLOSE_GRACE_S)
        with _lock:
            self.refs -= 1
            try:
                self.set_regions(owner, [], timeout)
            except TransferError as exc:
                log.warning("memfabric: releasing registrations failed: %s", exc)
            if self.refs > 0:
                return
            if _native is self:
                _native = None
            if self.config.role == "prefill":
                _prefill_closed = True
            with self._idle:  # no new calls; never uninitialize under one still inside memfabric
                self._closing = True
                idle = self._idle.wait_for(lambda: self._active == 0, timeout)
            if not idle:
                _wedged = f"a memfabric call did not return within {timeout} s, so the engine was not closed"
            else:
                try:
                    _bounded(self.mf, "unInitialize", self.te.unInitialize, timeout)
                except TransferError as exc:
                    _wedged = f"closing the engine failed: {exc}"
            if _wedged:
                log.warning("memfabric: %s; this process cannot start another memfabric engine", _wedged)

    def read(self, peer: str, local: list[int], remote: list[int], lengths: list[int], timeout: float) -> None:
        """One synchronous batched read from ``peer``; raises on any failure."""
        ret, text = self.call(
            "batch_transfer_sync_read", lambda: self.te.batch_transfer_sync_read(peer, local, remote, lengths), timeout
        )
        if ret == 0:
            return
        if goes_quiet(peer, within=min(timeout, 1.0)):
            raise PeerGoneError(f"memfabric read from {peer} failed ({ret}): the peer is gone ({text or 'no detail'})")
        hint = " (session not found: is the peer a Prefill engine of this store arrangement?)" if ret == -2000 else ""
        raise TransferError(f"memfabric read of {len(lengths)} ranges from {peer} failed ({ret}){hint}: {text}")
