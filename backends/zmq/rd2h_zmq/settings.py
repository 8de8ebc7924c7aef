"""What a channel's listeners and dialers are built with: its options and CURVE keys.

Its own module so that ``channel`` (which makes these) and ``sockets`` (which use them)
both import it and not each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["CurveKeys", "Settings"]


@dataclass(frozen=True, slots=True)
class CurveKeys:
    """Z85 keys read from ``zmq.auth`` certificate files."""

    public: bytes
    secret: bytes
    server_public: bytes | None  # the Decode listeners' public key, for dialers
    authorized_dir: Path | None  # client public keys allowed to reach our listeners


@dataclass(frozen=True, slots=True)
class Settings:
    """What every listener and dialer of one channel is built with."""

    max_frame_bytes: int
    send_timeout_ms: int
    high_water_mark: int
    curve: CurveKeys | None
    # frames a listener queues from one peer: high_water_mark, lowered so that this many
    # frames of max_frame_bytes stay under max_queued_bytes (libzmq counts frames, not bytes)
    receive_high_water_mark: int = 1000
    # connections a listener keeps open that carry no peer Decode admitted (rd2h.connection_book)
    max_unadmitted_connections: int = 256
    # bytes a dialer's connection may hold in its outbox (libzmq had no room): one more fails it
    max_queued_bytes: int = 256 << 20
