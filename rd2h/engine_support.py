"""Helpers every transfer engine needs, so backends do not each write them again.

- ``MetadataEnvelope``: the blob ``register`` returns and ``connect`` parses, as a tagged,
  versioned msgpack array whose parsing raises ``TransferError`` naming the bad field;
- ``check_read_arrays``: the argument checks ``read_batch`` owes its callers;
- ``check_read``: the whole preamble of a ``read_batch`` over native sessions (the session is
  this engine's, open and usable; the arrays are sound; both sides lie in registered regions),
  and ``breaks_session_on_timeout``: a read that overran leaves its session refusing reads;
- ``check_region_kinds``: a registration refuses memory the engine, as configured, does not
  move, naming the engines installed here that do (``capable_engines``); ``check_peer_kinds``:
  the same question about a peer's layouts, asked by Decode before it connects;
  ``kinds_for_options``: what an engine built with given options will move (asked before
  building it: the vLLM worker's staging choice); ``kinds_in_use``: what a built one moves;
- ``bounded_call``: a native call that cannot hang its caller;
- ``goes_quiet``: whether a peer's TCP address stops answering (a dead peer, told apart from
  a failed transfer).
"""

from __future__ import annotations

import functools
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import msgpack
import numpy as np
import numpy.typing as npt

from rd2h.errors import IncompatiblePeerError, RD2HError, TransferError, TransferTimeout
from rd2h.interfaces import HOST_ONLY, MemoryKinds, TransferEngine
from rd2h.layout.layers import LayerLayout
from rd2h.layout.regions import Region, RegionSet, check_memory_kind, device_type

__all__ = [
    "MetadataEnvelope", "split_host_port", "check_read_arrays", "check_read", "breaks_session_on_timeout",
    "check_region_kinds", "check_peer_kinds", "kinds_for_options", "kinds_in_use", "capable_engines", "bounded_call", "answers_at", "goes_quiet",
]  # fmt: skip

T = TypeVar("T")

_INT64 = np.dtype(np.int64)
_INT64_MAX = (1 << 63) - 1
_MAX_BLOB = 16 << 20  # far above any real registration; refuses absurd input early


@dataclass(frozen=True)
class MetadataEnvelope:
    """``(magic, version, *fields)`` in msgpack, for one engine's registration metadata."""

    engine: str  # named in error messages, e.g. "local" for "the local engine"
    magic: bytes
    version: int

    def pack(self, *fields: Any) -> bytes:
        return msgpack.packb((self.magic, self.version, *fields), use_bin_type=True)

    def malformed(self, what: str) -> TransferError:
        return TransferError(f"malformed {self.engine}-engine metadata: {what}")

    def unpack(self, blob: object, fields: int, optional: int = 0) -> list[Any]:
        """The ``fields`` fields after magic and version, and up to ``optional`` more where the
        blob has them (fields appended later; further trailing fields are ignored).

        Raises TransferError for anything else: not bytes, too big, not msgpack, another
        engine's blob, another version, too few fields.
        """
        if not isinstance(blob, (bytes, bytearray, memoryview)):
            raise self.malformed(f"expected bytes, got {type(blob).__name__}")
        if len(blob) > _MAX_BLOB:
            raise self.malformed(f"{len(blob)} bytes is more than any registration")
        try:
            msg = msgpack.unpackb(blob, raw=False, strict_map_key=True, use_list=True)
        except Exception as exc:  # msgpack raises several unrelated types on garbage
            raise self.malformed(f"not msgpack ({type(exc).__name__})") from None
        if not isinstance(msg, list) or len(msg) < 2 + fields:
            raise self.malformed(f"expected an array of at least {2 + fields} fields")
        if msg[0] != self.magic:
            raise self.malformed(f"not produced by the {self.engine} engine (tag {msg[0]!r:.40})")
        if msg[1] != self.version:
            raise self.malformed(f"version {msg[1]!r:.20}; this engine speaks {self.version}")
        return msg[2 : 2 + fields + optional]

    def integer(self, value: object, field: str) -> int:
        """A non-negative integer field."""
        if type(value) is not int or value < 0:
            raise self.malformed(f"{field} must be a non-negative integer, got {value!r:.60}")
        return value

    def unpack_session(self, blob: object) -> tuple[str, list[tuple[int, int]]]:
        """``(session_id "host:port", regions)``: the blob of an engine whose peers are named
        by their address (memfabric, mooncake). Raises TransferError naming the bad field."""
        session_id, regions = self.unpack(blob, 2)
        if not isinstance(session_id, str):
            raise self.malformed("session_id must be a string")
        try:
            split_host_port(session_id)
        except ValueError as exc:
            raise self.malformed(str(exc)) from None
        return session_id, self.regions(regions)

    def regions(self, raw: object) -> list[tuple[int, int]]:
        """A list of ``(addr, length)`` pairs, each non-empty and inside int64 addresses."""
        if not isinstance(raw, list):
            raise self.malformed("regions must be an array")
        regions = []
        for i, item in enumerate(raw):
            if not (isinstance(item, list) and len(item) == 2):
                raise self.malformed(f"region {i} must be an (addr, length) pair")
            addr = self.integer(item[0], f"region {i} addr")
            length = self.integer(item[1], f"region {i} length")
            if not length or addr + length > _INT64_MAX:
                raise self.malformed(f"region {i} ({addr:#x}+{length}) is empty or beyond the address space")
            regions.append((addr, length))
        return regions


def check_read_arrays(
    local_addrs: npt.NDArray[np.int64],
    remote_addrs: npt.NDArray[np.int64],
    lengths: npt.NDArray[np.int64],
    *,
    positive_lengths: bool = True,
) -> int:
    """The number of descriptors; TransferError unless three equal-length 1-D int64 arrays
    (with every length positive, unless the caller checks that on its own fast path)."""
    for name, a in (("local_addrs", local_addrs), ("remote_addrs", remote_addrs), ("lengths", lengths)):
        if not (isinstance(a, np.ndarray) and a.dtype == _INT64 and a.ndim == 1):
            what = f"{a.dtype} array of {a.ndim} dims" if isinstance(a, np.ndarray) else type(a).__name__
            raise TransferError(f"{name} must be a 1-d numpy int64 array, got {what}")
    n = len(lengths)
    if len(local_addrs) != n or len(remote_addrs) != n:
        raise TransferError(
            f"arrays differ in length: local_addrs {len(local_addrs)}, remote_addrs {len(remote_addrs)}, lengths {n}"
        )
    if positive_lengths and n and int(lengths.min()) <= 0:
        raise TransferError(f"every length must be > 0 (found {int(lengths.min())})")
    return n


class NativeSession(Protocol):
    """What :func:`check_read` needs of an engine's session."""

    engine: object
    peer_id: str
    closed: bool
    broken: str  # why the session refuses reads ("" while usable)
    bounds: RegionSet  # the peer's registered regions


def check_read(
    engine: object,
    session: object,
    local_bounds: RegionSet,
    local_addrs: npt.NDArray[np.int64],
    remote_addrs: npt.NDArray[np.int64],
    lengths: npt.NDArray[np.int64],
    *,
    broken: type[RD2HError] = TransferTimeout,
) -> int:
    """The checks a ``read_batch`` makes before anything moves; the number of descriptors.

    TransferError for a session of another engine, a closed session or bad arrays;
    ``broken`` (the engine's choice: a timed-out native call, or a peer gone) for a session
    that refuses reads; RegionError for a range outside the peer's registered regions or
    this engine's (``local_bounds``). Engines whose native call checks neither side rely on
    this: nothing is read outside what both sides registered.
    """
    if getattr(session, "engine", None) is not engine:
        raise TransferError(f"not a session of this {getattr(engine, 'name', 'transfer')} engine: {session!r}")
    native: NativeSession = session  # type: ignore[assignment]
    if native.closed:
        raise TransferError(f"the session to {native.peer_id} is closed")
    if native.broken:
        raise broken(f"the session to {native.peer_id} is unusable: {native.broken}; connect again")
    n = check_read_arrays(local_addrs, remote_addrs, lengths)
    if n:
        native.bounds.check(remote_addrs, lengths, f"remote range from {native.peer_id}")
        local_bounds.check(local_addrs, lengths, "local destination")
    return n


@contextmanager
def breaks_session_on_timeout(session: object) -> Iterator[None]:
    """A native read that timed out cannot be cancelled and may still write its destinations:
    the session refuses every later read (``check_read`` raises) until the caller connects again."""
    try:
        yield
    except TransferTimeout as exc:
        session.broken = str(exc)  # type: ignore[attr-defined]
        raise


def split_host_port(address: str) -> tuple[str, int]:
    """``"host:port"`` -> ``(host, port)``; ``ValueError`` when it is not that shape."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"session id must be 'host:port', got {address!r:.80}")
    return host, int(port)


_SIDE = {"prefill": "reads from", "decode": "writes to"}


def capable_engines(kind: str, role: str) -> list[str]:
    """The engines installed here (``rd2h.plugins``) whose ``memory_kinds`` move memory of
    ``kind``'s device type on ``role``'s side: what a refusal suggests instead. Never raises:
    an engine that cannot be imported or answers badly is left out. The engines are asked
    once per process (that imports every backend and asks each whether it can run here): a
    peer refused again and again, whatever kinds it names, costs Decode's loop a lookup."""
    return list(_declared().get((role, device_type(kind)), ()))


@functools.lru_cache(maxsize=1)
def _declared() -> dict[tuple[str, str], tuple[str, ...]]:
    """``(role, device type) -> names`` of the engines installed and available here."""
    from rd2h import plugins  # lazy: plugins imports the interfaces this module serves

    table: dict[tuple[str, str], list[str]] = {}
    try:
        backends = plugins.list_backends()
    except Exception:  # noqa: BLE001 - only a suggestion in an error message
        return {}
    for info in sorted(backends, key=lambda b: b.name):
        if info.kind != "engine" or not info.available:
            continue
        try:
            kinds = plugins.engine_class(info.name).memory_kinds()
        except Exception:  # noqa: BLE001 - a broken backend is no suggestion
            continue
        for role in _SIDE:
            for kind in kinds.for_role(role):
                table.setdefault((role, kind), []).append(info.name)
    return {key: tuple(names) for key, names in table.items()}


def _refusal(engine: str, kind: str, role: str, kinds: frozenset[str], what: str) -> str:
    others = capable_engines(kind, role)  # this engine too where another of its configurations can
    can = f"installed engines that can: {', '.join(others)}" if others else "no installed engine can"
    return (
        f"{what} is {kind} memory, and the {engine} engine {_SIDE[role]} {', '.join(sorted(kinds)) or 'no'} "
        f"memory only ({can}; or stage it through host memory)"
    )


def kinds_for_options(engine_class: type, options: Mapping[str, Any] | None = None) -> MemoryKinds:
    """What an engine of ``engine_class`` built with ``options`` moves
    (``TransferEngine.memory_kinds_for``); ``memory_kinds()`` for a class that predates
    that method (a third-party engine that is no ``TransferEngine`` subclass), host only
    for one that says nothing."""
    ask = getattr(engine_class, "memory_kinds_for", None)
    if ask is not None:
        return ask(dict(options or {}))
    ask = getattr(engine_class, "memory_kinds", None)
    return ask() if ask is not None else HOST_ONLY


def kinds_in_use(engine: object) -> MemoryKinds:
    """What the engine, as configured, moves (``memory_kinds_in_use``; a wrapper's inner
    engine's); ``memory_kinds()`` for an engine that predates that method; host only for an
    object that says nothing (a test double that is no ``TransferEngine``)."""
    ask = getattr(engine, "memory_kinds_in_use", None) or getattr(engine, "memory_kinds", None)
    return ask() if ask is not None else HOST_ONLY


def _engine_name(engine: object) -> str:
    """The engine's registered name (a wrapper delegating by ``__getattr__`` gives its inner
    engine's), or the class name of an object that has none (a test double)."""
    return getattr(engine, "name", "") or type(engine).__name__


def check_region_kinds(engine: TransferEngine, regions: Iterable[Region], kinds: MemoryKinds | None = None) -> None:
    """Raise ``TransferError`` for a region whose memory kind ``engine`` does not move on its
    role's side: a Prefill engine registers what peers read from (``reads_from``), a Decode
    engine what it writes to (``writes_to``). ``kinds`` defaults to what the engine as
    configured moves (``memory_kinds_in_use``: the options an engine was built with may
    narrow its class's ``memory_kinds()``). The message names
    the region, its kind, what the engine moves and the installed engines that can move it,
    so the refusal comes at registration, not as EFAULT at the first read."""
    role = getattr(engine, "role", "decode")
    allowed = (kinds if kinds is not None else kinds_in_use(engine)).for_role(role)
    name = _engine_name(engine)
    for r in regions:
        if r.device_type not in allowed:
            raise TransferError(_refusal(name, r.kind, role, allowed, f"region {r.addr:#x}+{r.length}"))


def check_peer_kinds(engine: TransferEngine, layers: Mapping[str, LayerLayout]) -> None:
    """Raise ``IncompatiblePeerError`` unless ``engine`` (Decode's, as configured:
    ``memory_kinds_in_use``) reads from every memory kind a peer's layouts declare (layer
    metadata, layout 4): refused at the handshake with a
    message naming the layer, the kind and the engines that can, not at the first read."""
    allowed = kinds_in_use(engine).reads_from
    name = _engine_name(engine)
    for layer, layout in layers.items():
        for what, tensor in layout.named_tensors():
            kind = check_memory_kind(tensor.kind)
            if device_type(kind) not in allowed:
                where = f"the peer's layer {layer[:80]!r} ({what})"
                raise IncompatiblePeerError(_refusal(name, kind, "prefill", allowed, where))


def bounded_call(
    engine: str,
    what: str,
    fn: Callable[[], T],
    timeout: float,
    translate: Callable[[BaseException, str], RD2HError] | None = None,
) -> T:
    """``fn()``'s result, run in a thread of its own and waited for at most ``timeout`` s.

    A native call cannot be cancelled: one that overruns keeps its (daemon) thread, the
    caller gets ``TransferTimeout`` and must treat whatever the call touches as still in
    use. An rd2h error ``fn`` raises passes through; any other exception becomes
    ``translate(exc, what)`` (default: a ``TransferError`` naming the engine and call).
    """
    box: list[object] = []

    def run() -> None:
        try:
            box.append(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box.append(exc)

    thread = threading.Thread(target=run, name=f"rd2h-{engine}-{what}", daemon=True)
    thread.start()
    thread.join(max(timeout, 0.0))
    if thread.is_alive():
        raise TransferTimeout(f"{engine} {what} did not return within {timeout:.3g} s")
    result = box[0]
    if isinstance(result, RD2HError):
        raise result
    if isinstance(result, BaseException):
        if translate is not None:
            raise translate(result, what) from result
        raise TransferError(f"{engine} {what} raised {type(result).__name__}: {result}") from result
    return result  # type: ignore[return-value]


def answers_at(address: str, timeout: float) -> bool:
    """Whether something accepts a TCP connection at ``address`` (``"host:port"``)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def goes_quiet(address: str, within: float) -> bool:
    """Whether ``address`` stops answering within ``within`` seconds.

    For telling a dead peer from a failed transfer after a read failed: the transfer breaks
    as soon as a killed peer's connections do, which can be a moment before its process is
    gone and its listening socket closed, so one look could call it alive.
    """
    deadline = time.monotonic() + within
    while answers_at(address, max(0.05, min(0.5, deadline - time.monotonic()))):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)  # an error path: the read already failed
    return True
