"""``TcpChannel``: options, the insecure-address rule, and the factory for listeners and dialers."""

from __future__ import annotations

from typing import ClassVar

from rd2h.errors import ConfigError
from rd2h.interfaces import Availability, ControlChannel
from rd2h_tcp.addresses import parse
from rd2h_tcp.dialer import TcpDialer
from rd2h_tcp.listener import TcpListener
from rd2h_tcp.settings import Settings

__all__ = ["TcpChannel", "MiB"]

MiB = 1 << 20


class TcpChannel(ControlChannel):
    """Plain-socket control channel: Decode's listener serves every peer from one ``epoll`` on
    its loop thread; a Prefill's dialer writes on the calling thread. No I/O threads.

    Addresses: ``tcp://host:port`` (port 0 picks a free one; ``tcp://[::1]:5600`` for IPv6) and
    ``ipc:///path`` (a unix socket; a stale socket file left by a dead listener is replaced,
    a live one is ``PortInUseError``). Both ends must be rd2h with this channel: a zmq peer
    is told apart by its first bytes and its connection closed.

    Options (all keyword-only; anything else raises ``ConfigError``), named as the zmq
    channel's where they mean the same:

    ``max_frame_bytes`` (16 MiB)
        Largest payload sent or accepted. Sending a larger one raises ``FrameTooLargeError``;
        a peer that announces a larger one has its connection closed before the payload is
        read (counted in ``TcpListener.refused``; the other peers are not affected).
    ``send_timeout`` (5.0 s)
        How long a dialer's ``connect`` may wait, and a frame may wait in a dialer's outbox for
        a Decode that does not take its bytes; then that connection alone is reset (a frame
        half written never corrupts the stream) and the next send to it raises
        ``ChannelError``. A send itself never waits for a Decode.
    ``high_water_mark`` (1000) and ``max_queued_bytes`` (256 MiB)
        Per peer, in a listener: replies held for a peer whose socket buffer is full (it does
        not read) before one more is dropped, counted in ``dropped`` and raised as
        ``ChannelError``; Decode's loop never blocks on a peer. Inbound, a listener stops
        reading a peer that has ``max_queued_bytes`` of frames waiting for ``recv`` until they
        are taken (the kernel's buffer, then the peer's ``send_timeout``, hold the rest). A
        dialer fails a connection at once when more than ``max_queued_bytes`` would wait in its
        outbox.
    ``max_unadmitted_connections`` (256)
        Connections a listener keeps open that carry no peer Decode admitted (``vouch``): the
        policy the zmq channel uses too (``rd2h.connection_book``: from a quarter of it on, refused,
        forgotten, replaced and silent-for-a-second connections are closed; at the bound one
        more whatever its age; from the source holding the most), enforced here by closing
        the socket, which this listener owns. An admitted peer's connection is never closed.
    ``busy_poll_us`` (0: off)
        After each frame in or out, an end (Decode's loop in ``recv``, a Prefill thread waiting
        for a reply) keeps polling its sockets for this many microseconds before it sleeps in
        ``epoll``/``poll``, yielding the CPU between polls. On a virtual machine a sleeping
        thread's wake-up costs 10-500 us, more than a small layer's whole round trip between
        two awake ends (docs/performance.md, section 3); polling is CPU spent only while frames
        flow (up to this long after each), none when idle. 100-500 suits layers announced less
        than that apart; 0 sleeps at once (the least CPU). At most 100000 (0.1 s).
    ``allow_insecure`` (False)
        The channel does not authenticate peers, so ``listen`` refuses any address but
        loopback and ``ipc://`` with ``ConfigError``. ``True`` allows it (a private link you
        trust); for authentication use the zmq channel with CurveZMQ.
    """

    name: ClassVar[str] = "tcp"

    def __init__(
        self,
        *,
        max_frame_bytes: int = 16 * MiB,
        send_timeout: float = 5.0,
        high_water_mark: int = 1000,
        max_queued_bytes: int = 256 * MiB,
        max_unadmitted_connections: int = 256,
        busy_poll_us: int = 0,
        allow_insecure: bool = False,
        **unknown: object,
    ) -> None:
        if unknown:
            raise ConfigError(
                f"unknown tcp channel option(s): {', '.join(sorted(unknown))}; known: max_frame_bytes, "
                "send_timeout, high_water_mark, max_queued_bytes, max_unadmitted_connections, busy_poll_us, "
                "allow_insecure"
            )
        for option, value in (
            ("max_frame_bytes", max_frame_bytes), ("high_water_mark", high_water_mark),
            ("max_queued_bytes", max_queued_bytes), ("max_unadmitted_connections", max_unadmitted_connections),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{option} must be a positive int, got {value!r}")
        if max_frame_bytes >= 1 << 32:
            raise ConfigError(f"max_frame_bytes must be below 4 GiB (a 4-byte length), got {max_frame_bytes}")
        if isinstance(send_timeout, bool) or not isinstance(send_timeout, (int, float)) or not send_timeout > 0:
            raise ConfigError(f"send_timeout must be a positive number of seconds, got {send_timeout!r}")
        if isinstance(busy_poll_us, bool) or not isinstance(busy_poll_us, int) or not 0 <= busy_poll_us <= 100_000:
            raise ConfigError(f"busy_poll_us must be an int of microseconds from 0 to 100000, got {busy_poll_us!r}")
        if not isinstance(allow_insecure, bool):
            raise ConfigError(f"allow_insecure must be True or False, got {allow_insecure!r}")
        self._allow_insecure = allow_insecure
        self._settings = Settings(
            max_frame_bytes=max_frame_bytes, send_timeout=float(send_timeout), high_water_mark=high_water_mark,
            max_queued_bytes=max_queued_bytes, max_unadmitted_connections=max_unadmitted_connections,
            busy_poll=busy_poll_us / 1e6,
        )

    @classmethod
    def availability(cls) -> Availability:
        import select

        if not hasattr(select, "epoll"):
            return Availability(False, "needs select.epoll (Linux)")
        return Availability(True)

    @property
    def settings(self) -> Settings:
        return self._settings

    def listen(self, address: str) -> TcpListener:
        """Bind ``address`` now. Raises ``PortInUseError`` if taken, ``ChannelError`` for a
        malformed address or another bind failure, ``ConfigError`` for an address other than
        loopback or ipc unless ``allow_insecure``."""
        parsed = parse(address)
        if not parsed.local and not self._allow_insecure:
            raise ConfigError(
                f"refusing to listen on {address}: the tcp channel does not authenticate peers, and anyone "
                "who reaches it could announce layers and make this Decode read. Bind a loopback or ipc:// "
                "address, use the zmq channel with CurveZMQ keys (see docs/security.md), or pass the channel "
                'option allow_insecure=True (e.g. channel_options={"allow_insecure": True}) for a network you trust'
            )
        return TcpListener(self._settings, address, parsed)

    def dialer(self) -> TcpDialer:
        return TcpDialer(self._settings)

