"""The two plugin interfaces: a transfer engine moves bytes, a control channel moves frames.

Both are deliberately small. A backend implements one of them in its own distribution and
publishes it under an entry-point group (see ``rd2h.plugins``); ``rd2h.testing`` checks it.

Addresses and lengths cross the engine interface as numpy ``int64`` arrays: one layer can
carry 10^5 descriptors, and a Python list per block would dominate the cost of the read.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from rd2h.errors import IncompatiblePeerError
from rd2h.layout.regions import HOST, Region

__all__ = [
    "Capability",
    "MemoryKinds",
    "HOST_ONLY",
    "Region",
    "Availability",
    "Session",
    "TransferEngine",
    "Listener",
    "Dialer",
    "ControlChannel",
]

Int64Array = npt.NDArray[np.int64]


class Capability(enum.Flag):
    """What an engine can do; the runtimes check these before choosing destinations.

    The four memory flags are a coarse summary; which memory an engine moves is
    ``TransferEngine.memory_kinds()``, and that is what registration checks."""

    NONE = 0
    READ_FROM_HOST = enum.auto()  # the peer's regions may be host memory
    READ_FROM_DEVICE = enum.auto()  # the peer's regions may be accelerator memory (of some type)
    WRITE_TO_HOST = enum.auto()  # local destinations may be host memory
    WRITE_TO_DEVICE = enum.auto()  # local destinations may be accelerator memory (of some type)
    CROSS_HOST = enum.auto()  # the peer may live on another machine
    NEEDS_REGISTERED_DESTINATIONS = enum.auto()  # local destinations must be registered first
    # connect() proves that the metadata comes from the process it names and that the peer
    # registered every region it declares; without it, an engine believes what it is told
    PROVES_PEER = enum.auto()
    # connect() may run on another thread while read_batch runs on other sessions: Decode then
    # admits a new Prefill off its loop, so a slow handshake delays no other peer's replies
    CONCURRENT_CONNECT = enum.auto()


@dataclass(frozen=True, slots=True)
class MemoryKinds:
    """The memory an engine moves, by device type (``"host"``, ``"cuda"``, ``"npu"``, ...):
    ``reads_from`` the peer's registered regions (what a Prefill engine may register),
    ``writes_to`` this side's destinations (what a Decode engine may register).

    Raises ``ValueError`` for an entry that is not a device type (``"cuda:0"``, ``""``).
    """

    reads_from: frozenset[str] = frozenset({HOST})
    writes_to: frozenset[str] = frozenset({HOST})

    def __post_init__(self) -> None:
        for side in ("reads_from", "writes_to"):
            kinds = frozenset(getattr(self, side))
            for kind in kinds:
                if type(kind) is not str or not kind.isidentifier() or not kind.islower():
                    raise ValueError(f"{side}: {kind!r} is not a device type such as 'host' or 'cuda'")
            object.__setattr__(self, side, kinds)

    def for_role(self, role: str) -> frozenset[str]:
        """What ``role``'s registrations may be: a Prefill registers what peers read from,
        a Decode what it writes to."""
        return self.reads_from if role == "prefill" else self.writes_to


HOST_ONLY = MemoryKinds()


@dataclass(frozen=True, slots=True)
class Availability:
    """Whether a backend can run on this machine, and if not, why (shown by `rd2h backends`)."""

    ok: bool
    reason: str = ""


class Session(abc.ABC):
    """A connection from a local engine to one peer engine, made by ``TransferEngine.connect``."""

    @property
    @abc.abstractmethod
    def peer_id(self) -> str:
        """The peer's engine identity (its ``TransferEngine.session_id``)."""

    @property
    @abc.abstractmethod
    def peer_regions(self) -> tuple[Region, ...]:
        """The regions the peer registered; every remote read must fall inside one."""

    def peer_exited(self) -> bool:
        """True once the engine knows the peer process is gone (a same-host engine can tell
        from a pidfd); False when alive or when the engine cannot tell. Must be cheap and
        must not block: the Decode loop asks between messages."""
        return False

    def close(self) -> None:
        """Forget the peer. Idempotent."""


class TransferEngine(abc.ABC):
    """Reads batches of remote ranges into local memory, synchronously.

    One engine per process, bound to one role, device and host. The Prefill side
    ``register``s its sources and sends the returned metadata to Decode; the Decode side
    ``register``s its destinations, ``connect``s with that metadata and calls ``read_batch``.

    Engines are built as ``cls(role="prefill" | "decode", **options)`` (``rd2h.plugins``
    does this by name); an unknown option raises ``ConfigError``.
    """

    name: ClassVar[str] = ""
    capabilities: ClassVar[Capability] = Capability.NONE

    @classmethod
    def availability(cls) -> Availability:
        """Whether this engine can run here. Must not raise and must not start anything."""
        return Availability(True)

    @classmethod
    def memory_kinds(cls) -> MemoryKinds:
        """Which memory this engine moves, by device type, with what is installed here (a
        wheel built without CUDA moves no CUDA memory). The default is host memory only.
        ``register`` refuses a region of any other kind (``engine_support.check_region_kinds``);
        an engine whose options narrow this (a host-only data path) refuses more: it says so
        in ``memory_kinds_for``. Must not raise and must not start anything."""
        return HOST_ONLY

    @classmethod
    def memory_kinds_for(cls, options: Mapping[str, Any]) -> MemoryKinds:
        """Which memory an engine built with ``options`` (its constructor's keyword options,
        without ``role``) moves: what the vLLM worker asks before it chooses host staging
        (``rd2h.staging.choice``). An engine whose transport depends on its options
        overrides this (MemFabric: ``data_op="host_tcp"`` moves host memory only). The
        default is ``memory_kinds()``, so an engine that overrides only that one is asked
        as before. Must not raise (options the constructor would refuse get an answer too:
        construction raises for them anyway) and must not start anything."""
        return cls.memory_kinds()

    def memory_kinds_in_use(self) -> MemoryKinds:
        """Which memory this engine, as configured, moves: what ``register`` and Decode's
        handshake check (``engine_support.check_region_kinds`` / ``check_peer_kinds``).
        Override it together with ``memory_kinds_for``; the default is the class's
        ``memory_kinds()``."""
        return type(self).memory_kinds()

    @property
    @abc.abstractmethod
    def session_id(self) -> str:
        """This engine's identity as peers name it (MemFabric: ``"ip:port"``)."""

    @abc.abstractmethod
    def register(self, regions: Sequence[Region]) -> bytes:
        """Register memory for reads (Prefill: sources) or as destinations (Decode).

        Returns opaque metadata for the peer's ``connect``; it covers every region
        registered so far. Raises ``TransferError`` when the engine refuses, among others
        for a region of a memory kind it does not move (``memory_kinds``).
        """

    @abc.abstractmethod
    def connect(self, peer_metadata: bytes) -> Session:
        """Open a session to the peer that produced ``peer_metadata`` with its ``register``.

        Raises ``TransferError`` when the peer cannot be reached (another host for a
        same-host engine, a malformed blob, a dead peer).
        """

    def connect_legacy(self, p_session: str) -> Session:
        """Open a session to a legacy (reference-implementation) peer known only by its
        ``p_session``: its ``mf_meta`` carries no metadata from this engine's ``register``.

        An engine that can reach a peer from its session id alone overrides this; its
        session's ``peer_regions`` then come from nothing the peer proved. This default
        raises ``IncompatiblePeerError``: the engine needs its own metadata to connect.
        """
        name = type(self).name or type(self).__name__
        raise IncompatiblePeerError(
            f"the {name!r} transfer engine needs its own metadata (from its register() on the peer) to "
            f"connect, and a legacy (reference-implementation) peer {p_session[:80]!r} cannot supply it: "
            "run rd2h on that Prefill, or use an engine that connects from the session id alone (memfabric)"
        )

    @abc.abstractmethod
    def read_batch(
        self,
        session: Session,
        local_addrs: Int64Array,
        remote_addrs: Int64Array,
        lengths: Int64Array,
    ) -> None:
        """Copy ``lengths[i]`` bytes from ``remote_addrs[i]`` in the peer to ``local_addrs[i]``.

        All or nothing from the caller's view: returns when every byte arrived, raises
        ``TransferError`` (``PeerGoneError``, ``TransferTimeout``) otherwise. Remote ranges
        outside ``session.peer_regions`` raise ``RegionError`` before anything is copied.
        """

    def close(self) -> None:
        """Release every registration and session. Idempotent."""

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()




class Listener(abc.ABC):
    """The Decode end of a control channel: bound to one address, talks to many Prefill peers."""

    @property
    @abc.abstractmethod
    def address(self) -> str:
        """The bound address, e.g. ``"tcp://127.0.0.1:5600"``."""

    @abc.abstractmethod
    def recv(self, timeout: float) -> tuple[bytes, bytes] | None:
        """Next ``(peer, payload)``; ``None`` after ``timeout`` seconds with nothing.

        ``peer`` is an opaque identity to pass back to ``send``.
        """

    @abc.abstractmethod
    def send(self, peer: bytes, payload: bytes) -> None:
        """Send one payload to a peer that spoke to us. Must not block for long: the Decode
        loop sends every reply; a peer that does not read loses its replies, not others'."""

    def peer_key(self, peer: bytes) -> str | None:
        """The key ``peer`` proved it holds (a CURVE public key, Z85), or None when the
        channel does not authenticate peers. Decode binds requests to it (``expect(prefill=)``)."""
        return None

    def vouch(self, peer: bytes) -> None:
        """Decode admitted ``peer``. A channel that bounds the connections of peers Decode
        does not know (zmq: ``max_unadmitted_connections``) never closes this one's. Called
        on the thread that calls ``recv``. The default does nothing."""

    def disown(self, peer: bytes) -> None:
        """Decode refused ``peer``, or forgot it (idle, over its limits, exited): it is a
        stranger again, and its connection is among the first such a channel closes. Called
        on the thread that calls ``recv``. The default does nothing."""

    def close(self) -> None:
        """Unbind. Idempotent."""

    def __enter__(self) -> Listener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Dialer(abc.ABC):
    """The Prefill end of a control channel: one connection per Decode address, made on demand.

    ``concurrent_send``: ``send`` and ``disconnect`` may run on any thread while another
    blocks in ``recv``. A Prefill then announces a layer on the thread that computed it,
    without handing it to its sender thread (two thread switches per layer less); without
    it every send goes through the sender thread.

    One endpoint must never slow another: ``send`` does not wait for a Decode that does not
    read. What cannot be written at once waits, in order, behind that connection alone; a
    connection whose frame waited the channel's send timeout is failed, and reported once:
    by ``take_failures`` (the channel then calls ``wakeup`` so the Prefill asks at once, and
    fails every request with readiness in flight there), or, if a ``send`` to that address
    comes first, by that send raising ``ChannelError`` (the Prefill reports that send as
    failed, as it would one that waited and raised). Sends, ``recv`` and ``disconnect`` of
    other endpoints go on meanwhile.
    """

    concurrent_send: ClassVar[bool] = False

    @abc.abstractmethod
    def send(self, address: str, payload: bytes) -> None:
        """Send one payload to the Decode endpoint at ``address`` (connecting if needed)."""

    @abc.abstractmethod
    def recv(self, timeout: float) -> tuple[str, bytes] | None:
        """Next ``(address, payload)`` from any connected endpoint; ``None`` after ``timeout``."""

    def wakeup(self) -> None:
        """Make a ``recv`` blocked in another thread return ``None`` soon. Thread-safe.

        The Prefill sender blocks in ``recv`` and is woken when a layer is queued. The
        default does nothing, so ``recv`` returns at its timeout: correct, but slower.
        """

    def take_failures(self) -> dict[str, str]:
        """Addresses whose connection the channel failed since the last call, each with why
        (consumed: the next ``send`` there connects again, raising nothing for it). Thread-safe.

        A connection failed with frames waiting (past the send timeout) lost them: the Prefill
        fails the requests they named now, not at its reply timeout. The default reports none,
        for a channel whose ``send`` raises every failure itself.
        """
        return {}

    @abc.abstractmethod
    def disconnect(self, address: str) -> None:
        """Drop the connection to ``address`` and anything queued for it."""

    def close(self) -> None:
        """Close every connection. Idempotent."""

    def __enter__(self) -> Dialer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ControlChannel(abc.ABC):
    """Makes listeners and dialers. Frames carry encoded protocol messages; the channel
    knows nothing of their meaning. Built as ``cls(**options)``; an unknown option raises
    ``ConfigError``."""

    name: ClassVar[str] = ""

    @classmethod
    def availability(cls) -> Availability:
        """Whether this channel can run here. Must not raise and must not start anything."""
        return Availability(True)

    @abc.abstractmethod
    def listen(self, address: str) -> Listener:
        """Bind now, e.g. ``"tcp://0.0.0.0:5600"``. Raises ``PortInUseError`` at once if taken."""

    @abc.abstractmethod
    def dialer(self) -> Dialer:
        """A dialer that connects to Decode listeners on first send."""
