"""``ZmqChannel``: options, CURVE key files, and the factory for listeners and dialers."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from typing import ClassVar

import zmq
import zmq.auth

from rd2h.errors import BackendUnavailableError, ConfigError
from rd2h.interfaces import Availability, ControlChannel

from rd2h_zmq.settings import CurveKeys, Settings
from rd2h_zmq.sockets import SharedContext, ZmqDialer, ZmqListener

__all__ = ["ZmqChannel", "MiB"]

MiB = 1 << 20
KeyPath = str | os.PathLike[str]


class ZmqChannel(ControlChannel):
    """ZeroMQ control channel: Decode binds a ROUTER, Prefill connects one DEALER per Decode.

    Options (all keyword-only; anything else raises ``ConfigError``):

    ``max_frame_bytes`` (16 MiB)
        Largest payload sent or accepted (a readiness of a million block ids, the most a
        Decode accepts by default, takes under 5 MiB). Sending a larger one raises
        ``FrameTooLargeError``; a peer that sends one is disconnected by libzmq (the frame is
        never delivered, the peer reconnects by itself, others are not affected).
    ``send_timeout`` (5.0 s)
        How long a frame may wait in a dialer's outbox when ``high_water_mark`` frames are
        already queued for a peer that does not drain them; then that connection alone is
        closed and the next send to it raises ``ChannelError``. A send itself never waits.
    ``high_water_mark`` (1000)
        Frames queued per connection in each direction (a listener may queue fewer, below).
    ``max_queued_bytes`` (256 MiB)
        Memory a dialer's connection may hold in its outbox (frames libzmq had no room for: a
        Decode behind by that much is failed at once, a slower one only by ``send_timeout``);
        and memory one peer may fill in a listener's inbound queue: the listener queues at most
        ``max_queued_bytes // max_frame_bytes`` frames per peer (at least 1; 16 by default);
        the peer's own queue holds the rest, so a flooding peer pays for its backlog itself.
        Fewer than ~16 slows a saturated stream of small frames (measured: 4 frames, 9 us a
        frame against 3.6 us with 1000).
    ``max_unadmitted_connections`` (256)
        Connections (each an fd) a listener keeps open that carry no peer Decode admitted:
        peers in their handshake, refused or forgotten ones, connections that never sent a
        message. From a quarter of it on, the listener shuts down the connections of refused,
        forgotten or replaced peers, and those silent for a second; at the bound, one more
        whatever its age. It chooses from the host (for ipc, the process) holding the most,
        refused and replaced ones first, then silent ones, the longest open first. An
        admitted peer's connection is never shut (``PeerLimits`` bounds those). A shut zmq
        peer reconnects by itself and is shut again while the listener is over its bound.
    ``allow_insecure`` (False)
        Without CURVE, anyone who reaches a listener is a full Prefill peer, so ``listen``
        refuses any address but loopback (``127.0.0.0/8``, ``::1``, ``localhost``), ``ipc://``
        and ``inproc://`` with ``ConfigError``. ``True`` allows it (a private link you trust).
    ``curve_secret_key``
        This process's own certificate (Decode: the server's; Prefill: a client's), the ``*.key_secret`` file written by
        ``zmq.auth.create_certificates``. Giving it turns CurveZMQ on: traffic is encrypted
        and listeners accept only authorized clients.
    ``curve_authorized_keys``
        Directory of ``*.key`` public certificates of the clients (Prefill processes) a
        listener accepts; needed to ``listen``. Read when the first listener starts.
    ``curve_server_key``
        The ``*.key`` public certificate of the Decode listeners; needed to ``dialer()``.

    Addresses are zmq endpoints: ``tcp://host:port`` (port 0 picks a free one; a bracketed
    IPv6 literal such as ``tcp://[::1]:5600`` turns IPv6 on), ``ipc:///path``, and
    ``inproc://name`` between the listeners and dialers of one channel.

    Keys are per role: one server certificate for the Decode listeners and one client
    certificate per Prefill (or per Prefill host); the client ``*.key`` files go into the
    Decode's authorized directory. A listener whose own key is authorized as a client, or a
    dialer whose key is the server's, is refused (``ConfigError``): one certificate for both
    roles would let a Decode key announce layers. A client whose key is not authorized, or
    who speaks without CURVE, never gets a frame delivered. With CURVE, the peer identity a
    listener returns starts with the client's public key (``peer_key``): another key that
    takes over a Prefill's routing id is another peer, with none of its state.

    Listeners and dialers of one channel share one ``zmq.Context`` (one I/O thread, and the
    ZAP authenticator thread when CURVE is on). It is made by the first of them and
    terminated when the last one closes, so the channel itself holds nothing to close.
    """

    name: ClassVar[str] = "zmq"

    def __init__(
        self,
        *,
        max_frame_bytes: int = 16 * MiB,
        send_timeout: float = 5.0,
        high_water_mark: int = 1000,
        max_queued_bytes: int = 256 * MiB,
        allow_insecure: bool = False,
        max_unadmitted_connections: int = 256,
        curve_secret_key: KeyPath | None = None,
        curve_authorized_keys: KeyPath | None = None,
        curve_server_key: KeyPath | None = None,
        **unknown: object,
    ) -> None:
        if unknown:
            raise ConfigError(
                f"unknown zmq channel option(s): {', '.join(sorted(unknown))}; known: max_frame_bytes, "
                "send_timeout, high_water_mark, max_queued_bytes, allow_insecure, max_unadmitted_connections, "
                "curve_secret_key, "
                "curve_authorized_keys, curve_server_key"
            )
        if isinstance(max_frame_bytes, bool) or not isinstance(max_frame_bytes, int) or max_frame_bytes <= 0:
            raise ConfigError(f"max_frame_bytes must be a positive int, got {max_frame_bytes!r}")
        if isinstance(send_timeout, bool) or not isinstance(send_timeout, (int, float)) or not send_timeout > 0:
            raise ConfigError(f"send_timeout must be a positive number of seconds, got {send_timeout!r}")
        if isinstance(high_water_mark, bool) or not isinstance(high_water_mark, int) or high_water_mark <= 0:
            # 0 would mean "no limit" to libzmq: unbounded memory for a dead peer.
            raise ConfigError(f"high_water_mark must be a positive int, got {high_water_mark!r}")
        if isinstance(max_queued_bytes, bool) or not isinstance(max_queued_bytes, int) or max_queued_bytes <= 0:
            raise ConfigError(f"max_queued_bytes must be a positive int, got {max_queued_bytes!r}")
        if (
            isinstance(max_unadmitted_connections, bool)
            or not isinstance(max_unadmitted_connections, int)
            or max_unadmitted_connections <= 0
        ):
            raise ConfigError(f"max_unadmitted_connections must be a positive int, got {max_unadmitted_connections!r}")
        if not isinstance(allow_insecure, bool):
            raise ConfigError(f"allow_insecure must be True or False, got {allow_insecure!r}")
        curve = _load_curve(curve_secret_key, curve_authorized_keys, curve_server_key)
        self._allow_insecure = allow_insecure
        receive_hwm = max(1, min(high_water_mark, max_queued_bytes // max_frame_bytes))
        self._settings = Settings(
            max_frame_bytes, max(1, round(send_timeout * 1000)), high_water_mark, curve, receive_hwm,
            max_unadmitted_connections=max_unadmitted_connections, max_queued_bytes=max_queued_bytes,
        )
        self._context = SharedContext(curve.authorized_dir if curve else None)

    @classmethod
    def availability(cls) -> Availability:
        major, _minor, _patch = zmq.zmq_version_info()
        if major < 4:
            return Availability(False, f"libzmq {zmq.zmq_version()} is too old; 4.x is needed")
        return Availability(True)

    @property
    def settings(self) -> Settings:
        return self._settings

    def listen(self, address: str) -> ZmqListener:
        """Bind a ROUTER to ``address`` now (``tcp://host:0`` picks a free port; see
        ``.address``). Raises ``PortInUseError`` if taken, ``ChannelError`` for other bind
        failures, ``ConfigError`` when CURVE is on without ``curve_authorized_keys``, or off
        for an address other than loopback unless ``allow_insecure``."""
        curve = self._settings.curve
        if curve is not None and curve.authorized_dir is None:
            raise ConfigError("curve_authorized_keys is needed to listen with CURVE on")
        if curve is None and not self._allow_insecure and not is_local_address(address):
            raise ConfigError(
                f"refusing to listen on {address} without CURVE: anyone who reaches it could announce "
                "layers and make this Decode read. Give the channel curve_secret_key and "
                "curve_authorized_keys (see docs/security.md), bind a loopback address, or pass the "
                'channel option allow_insecure=True (e.g. channel_options={"allow_insecure": True}) '
                "for a network you trust"
            )
        return ZmqListener(self._settings, self._context, address)

    def dialer(self) -> ZmqDialer:
        """A dialer that connects to each Decode address on first send. Raises
        ``ConfigError`` when CURVE is on without ``curve_server_key``."""
        curve = self._settings.curve
        if curve is not None and curve.server_public is None:
            raise ConfigError("curve_server_key is needed to dial with CURVE on")
        return ZmqDialer(self._settings, self._context)


_NETWORK_SCHEMES = frozenset({"tcp", "udp", "pgm", "epgm", "norm", "ws", "wss", "tipc", "vmci"})


def is_local_address(address: str) -> bool:
    """Whether ``address`` is reachable from this host only: loopback TCP, ipc, inproc."""
    scheme, _, rest = address.partition("://")
    if scheme not in _NETWORK_SCHEMES:  # ipc, inproc (or nothing libzmq binds: it refuses)
        return True
    if scheme != "tcp":
        return False
    host = rest.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # "*", an interface name, a host name: not known to be loopback
        return False


def _load_curve(
    secret_file: KeyPath | None, authorized_dir: KeyPath | None, server_file: KeyPath | None
) -> CurveKeys | None:
    if secret_file is None:
        if authorized_dir is not None or server_file is not None:
            raise ConfigError("curve_authorized_keys / curve_server_key need curve_secret_key as well")
        return None
    if not zmq.has("curve"):
        raise BackendUnavailableError(f"libzmq {zmq.zmq_version()} was built without CURVE support")
    public, secret = _read_certificate(secret_file, "curve_secret_key")
    if secret is None:
        raise ConfigError(f"curve_secret_key {os.fspath(secret_file)!r} holds no secret key (use the *.key_secret file)")
    server_public = None
    if server_file is not None:
        server_public, _ = _read_certificate(server_file, "curve_server_key")
    directory = None
    if authorized_dir is not None:
        directory = Path(authorized_dir)
        if not directory.is_dir():
            raise ConfigError(f"curve_authorized_keys {str(directory)!r} is not a directory")
        authorized = zmq.auth.load_certificates(directory)
        if not authorized:
            raise ConfigError(f"curve_authorized_keys {str(directory)!r} holds no *.key public certificate")
        if public in authorized:
            raise ConfigError(
                f"curve_secret_key's public key is authorized as a client in {str(directory)!r}: give "
                "Decode (the server) and each Prefill (a client) their own certificates"
            )
    if server_public is not None and server_public == public:
        raise ConfigError(
            "curve_secret_key is the server's own certificate: a Prefill dials with a client "
            "certificate of its own, never the Decode's"
        )
    return CurveKeys(public, secret, server_public, directory)


def _read_certificate(path: KeyPath, option: str) -> tuple[bytes, bytes | None]:
    try:
        return zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{option}: cannot read a zmq certificate from {os.fspath(path)!r}: {exc}") from exc
