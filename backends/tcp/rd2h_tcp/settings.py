"""What every listener and dialer of one channel is built with (its own module so that
``channel``, which makes them, and ``listener``/``dialer`` import it, not each other)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Settings"]


@dataclass(frozen=True, slots=True)
class Settings:
    max_frame_bytes: int
    send_timeout: float  # seconds a dialer's connect or send may wait
    high_water_mark: int  # replies a listener holds per peer that does not read
    max_queued_bytes: int  # bytes a listener holds per peer, each way
    max_unadmitted_connections: int
    busy_poll: float = 0.0  # seconds an end keeps polling without sleeping after its last frame (0: never)
