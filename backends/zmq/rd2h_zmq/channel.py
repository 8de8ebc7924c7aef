"""``ZmqChannel``: options, CURVE key files, and the factory for listeners and dialers."""

from __future__ import annotations

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

    ``max_frame_bytes`` (64 MiB)
        Largest payload sent or accepted. Sending a larger one raises
        ``FrameTooLargeError``; a peer that sends one is disconnected by libzmq (the frame is
        never delivered, the peer reconnects by itself, others are not affected).
    ``send_timeout`` (5.0 s)
        How long a send may wait when ``high_water_mark`` frames are already queued for a
        peer that does not drain them; then ``ChannelError``. A send never blocks forever.
    ``high_water_mark`` (1000)
        Frames queued per connection in each direction.
    ``curve_secret_key``
        This process's certificate, the ``*.key_secret`` file written by
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

    A deployment usually makes one server certificate shared by every Decode process and one
    client certificate per Prefill host (or one for all), and copies the client ``*.key``
    files into the Decode's authorized directory. A client whose key is not authorized, or
    who speaks without CURVE, never gets a frame delivered.

    Listeners and dialers of one channel share one ``zmq.Context`` (one I/O thread, and the
    ZAP authenticator thread when CURVE is on). It is made by the first of them and
    terminated when the last one closes, so the channel itself holds nothing to close.
    """

    name: ClassVar[str] = "zmq"

    def __init__(
        self,
        *,
        max_frame_bytes: int = 64 * MiB,
        send_timeout: float = 5.0,
        high_water_mark: int = 1000,
        curve_secret_key: KeyPath | None = None,
        curve_authorized_keys: KeyPath | None = None,
        curve_server_key: KeyPath | None = None,
        **unknown: object,
    ) -> None:
        if unknown:
            raise ConfigError(
                f"unknown zmq channel option(s): {', '.join(sorted(unknown))}; known: max_frame_bytes, "
                "send_timeout, high_water_mark, curve_secret_key, curve_authorized_keys, curve_server_key"
            )
        if isinstance(max_frame_bytes, bool) or not isinstance(max_frame_bytes, int) or max_frame_bytes <= 0:
            raise ConfigError(f"max_frame_bytes must be a positive int, got {max_frame_bytes!r}")
        if isinstance(send_timeout, bool) or not isinstance(send_timeout, (int, float)) or not send_timeout > 0:
            raise ConfigError(f"send_timeout must be a positive number of seconds, got {send_timeout!r}")
        if isinstance(high_water_mark, bool) or not isinstance(high_water_mark, int) or high_water_mark <= 0:
            # 0 would mean "no limit" to libzmq: unbounded memory for a dead peer.
            raise ConfigError(f"high_water_mark must be a positive int, got {high_water_mark!r}")
        curve = _load_curve(curve_secret_key, curve_authorized_keys, curve_server_key)
        self._settings = Settings(max_frame_bytes, max(1, round(send_timeout * 1000)), high_water_mark, curve)
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
        failures, ``ConfigError`` when CURVE is on without ``curve_authorized_keys``."""
        curve = self._settings.curve
        if curve is not None and curve.authorized_dir is None:
            raise ConfigError("curve_authorized_keys is needed to listen with CURVE on")
        return ZmqListener(self._settings, self._context, address)

    def dialer(self) -> ZmqDialer:
        """A dialer that connects to each Decode address on first send. Raises
        ``ConfigError`` when CURVE is on without ``curve_server_key``."""
        curve = self._settings.curve
        if curve is not None and curve.server_public is None:
            raise ConfigError("curve_server_key is needed to dial with CURVE on")
        return ZmqDialer(self._settings, self._context)


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
        if not zmq.auth.load_certificates(directory):
            raise ConfigError(f"curve_authorized_keys {str(directory)!r} holds no *.key public certificate")
    return CurveKeys(public, secret, server_public, directory)


def _read_certificate(path: KeyPath, option: str) -> tuple[bytes, bytes | None]:
    try:
        return zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{option}: cannot read a zmq certificate from {os.fspath(path)!r}: {exc}") from exc
