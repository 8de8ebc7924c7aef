"""The connector's settings, read from ``kv_connector_extra_config`` (no vLLM import).

Every key is optional::

    {"engine": "local", "engine_options": {}, "channel": "zmq", "channel_options": {},
     "kv_port": 5600, "host": "127.0.0.1", "advertise_host": null,
     "mode": "dense",              # or "sfa"
     "request_timeout": 120.0,     # Decode: a request not pulled by then fails
     "reply_timeout": 30.0,        # Prefill: a Decode silent that long is abandoned
     "metaserver": null,           # Decode: the proxy's rendezvous URL (required on Decode)
     "metaserver_retries": 5,
     "peer_tp": null,              # the other side's TP size, checked at startup where known
     "secret_file": null,          # the secret shared with the proxy (default: $RD2H_SECRET)
     "handoff_port": null,         # Prefill: vLLM's P/D convention; rank r listens on port + dp*tp + r
     "hold_timeout": 60.0,         # Prefill: seconds a finished request's blocks wait to be asked for
     "handoff_timeout": 10.0}      # Decode: seconds every Prefill rank has to answer an ask

Unknown keys are refused, so a misspelt option is an error at startup, not a silent default.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any

from rd2h.errors import ConfigError

__all__ = ["ConnectorConfig", "Mode"]


class Mode(Enum):
    DENSE = "dense"  # main KV into vLLM's own paged cache, a full copy on every Decode rank
    SFA = "sfa"  # the specification's layout: a TP-shared main pool, rank-local indexer/scale


@dataclass(frozen=True)
class ConnectorConfig:
    engine: str = "local"
    engine_options: Mapping[str, Any] = field(default_factory=dict)
    channel: str = "zmq"
    channel_options: Mapping[str, Any] = field(default_factory=dict)
    kv_port: int = 5600
    host: str = "127.0.0.1"
    advertise_host: str | None = None
    mode: Mode = Mode.DENSE
    request_timeout: float | None = 120.0
    reply_timeout: float = 30.0
    metaserver: str | None = None
    metaserver_retries: int = 5
    peer_tp: int | None = None
    secret_file: str | None = None
    handoff_port: int | None = None
    hold_timeout: float = 60.0
    handoff_timeout: float = 10.0

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        """Raises ConfigError naming an unknown key or a bad value."""
        values = dict(extra or {})
        names = {f.name for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in values.items():
            if key not in names:
                raise ConfigError(f"unknown kv_connector_extra_config key {key!r}; known: " + ", ".join(sorted(names)))
            kwargs[key] = value
        if "mode" in kwargs:
            try:
                kwargs["mode"] = Mode(kwargs["mode"])
            except ValueError:
                raise ConfigError(f"mode must be 'dense' or 'sfa', got {kwargs['mode']!r}") from None
        config = cls(**kwargs)
        if not isinstance(config.kv_port, int) or not 1 <= config.kv_port <= 65535:
            raise ConfigError(f"kv_port must be a port number, got {config.kv_port!r}")
        if config.reply_timeout <= 0 or (config.request_timeout is not None and config.request_timeout <= 0):
            raise ConfigError("reply_timeout and request_timeout must be positive")
        port = config.handoff_port
        if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535):
            raise ConfigError(f"handoff_port must be a port number, got {port!r}")
        for key in ("hold_timeout", "handoff_timeout"):
            value = getattr(config, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"{key} must be a positive number of seconds, got {value!r}")
        return config

    @property
    def advertised(self) -> str:
        return self.advertise_host or self.host
