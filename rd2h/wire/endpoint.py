"""A Decode instance as its rendezvous advertises it (pure: no I/O).

Decode hands Prefill one small value through whatever rendezvous the deployment uses (a
proxy, a key-value store, a command line): host, base port and TP size, and, for a Decode
run with pipeline parallel, how many model layers each of its stages holds. Its text form is
``host:base_port/tp_size`` with IPv6 hosts bracketed (``[::1]:5600/2``), and
``host:base_port/tp_size/n0,n1,...`` with stages (stage ``s`` listens from
``base_port + s * tp_size``, where ``base_port`` already counts the engine's global DP rank:
``kv_port + dp_rank * pp_size * tp_size``, see :func:`rd2h.vllm.parallel.port_rank`); ``to_bytes``
is that text in ASCII. Both parse back to an equal
endpoint, and anything else raises :class:`~rd2h.errors.ConfigError`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from rd2h.errors import ConfigError, PortError
from rd2h.layout.topology import MAX_PORT, remote_port

__all__ = ["DecodeEndpoint"]

# A host name or an IPv4 address, or (bracketed in text) an IPv6 address with an optional zone.
_NAME = re.compile(r"[A-Za-z0-9_.-]+")
_IPV6 = re.compile(r"[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*(%[A-Za-z0-9_.-]+)?")
_TEXT = re.compile(
    r"(?:\[(?P<v6>[^\]]*)\]|(?P<host>[^:/\[\]]*)):(?P<port>[0-9]{1,5})/(?P<tp>[0-9]{1,6})"
    r"(?:/(?P<stages>[0-9]{1,6}(?:,[0-9]{1,6}){1,63}))?"
)
MAX_STAGES = 64


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class DecodeEndpoint:
    """A Decode instance: host, base port (its rank 0 listens there) and TP size; ``stages``:
    the model layers each pipeline stage holds, in order (empty: no pipeline parallel).

    Raises ConfigError for an empty or malformed host, a base port outside 1..65535, a TP
    size below 1, or stages that are not 2..64 counts of at least one layer each.
    """

    host: str
    base_port: int
    tp_size: int
    stages: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not (_NAME.fullmatch(self.host) or _IPV6.fullmatch(self.host)):
            raise ConfigError(f"Decode host must be a host name, IPv4 or IPv6 address, got {self.host!r}")
        if not _is_int(self.base_port) or not 1 <= self.base_port <= MAX_PORT:
            raise ConfigError(f"Decode base port must lie in 1..{MAX_PORT}, got {self.base_port!r}")
        if not _is_int(self.tp_size) or self.tp_size < 1:
            raise ConfigError(f"Decode TP size must be an integer >= 1, got {self.tp_size!r}")
        stages = self.stages
        if not isinstance(stages, tuple) or (stages and not 2 <= len(stages) <= MAX_STAGES):
            raise ConfigError(f"Decode stages must be a tuple of 2..{MAX_STAGES} layer counts (or empty), got {stages!r}")
        if any(not _is_int(n) or n < 1 for n in stages):
            raise ConfigError(f"every Decode stage holds at least one layer, got {stages!r}")

    @property
    def _bracketed(self) -> str:
        return f"[{self.host}]" if ":" in self.host else self.host

    def address(self, decode_rank: int) -> str:
        """The control address of one Decode TP rank (the port is range-checked: PortError,
        TopologyError for a rank outside the TP size)."""
        return f"tcp://{self._bracketed}:{remote_port(self.base_port, decode_rank, self.tp_size)}"

    def stage(self, stage: int) -> DecodeEndpoint:
        """Pipeline stage ``stage`` as an endpoint of its own (its ranks' ports), with no stages.
        Raises ConfigError for a stage out of range, PortError if its base port leaves 1..65535."""
        if not _is_int(stage) or not 0 <= stage < max(len(self.stages), 1):
            raise ConfigError(f"Decode stage {stage!r} outside 0..{max(len(self.stages), 1) - 1}")
        base = self.base_port + stage * self.tp_size
        if base > MAX_PORT:
            raise PortError(f"Decode stage {stage}'s base port {base} is above {MAX_PORT}")
        return DecodeEndpoint(self.host, base, self.tp_size)

    def __str__(self) -> str:
        text = f"{self._bracketed}:{self.base_port}/{self.tp_size}"
        return f"{text}/{','.join(map(str, self.stages))}" if self.stages else text

    @classmethod
    def parse(cls, text: str) -> DecodeEndpoint:
        """The endpoint written by ``str(endpoint)``; ConfigError for anything else."""
        if not isinstance(text, str):
            raise ConfigError(f"a Decode endpoint is text like 'host:5600/2', got {type(text).__name__}")
        match = _TEXT.fullmatch(text)
        if match is None:
            raise ConfigError(f"not a Decode endpoint (want 'host:base_port/tp_size'): {text[:80]!r}")
        host = match["v6"] if match["v6"] is not None else match["host"]
        if match["v6"] is not None and ":" not in host:
            raise ConfigError(f"only IPv6 addresses are bracketed in a Decode endpoint: {text[:80]!r}")
        stages = tuple(int(n) for n in match["stages"].split(",")) if match["stages"] else ()
        return cls(host, int(match["port"]), int(match["tp"]), stages)

    def to_bytes(self) -> bytes:
        return str(self).encode("ascii")

    @classmethod
    def from_bytes(cls, data: bytes) -> DecodeEndpoint:
        """The endpoint written by ``to_bytes``; ConfigError for anything else."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ConfigError(f"a Decode endpoint in bytes is expected, got {type(data).__name__}")
        try:
            text = bytes(data).decode("ascii")
        except UnicodeDecodeError:
            raise ConfigError("a Decode endpoint is ASCII text like b'host:5600/2'") from None
        return cls.parse(text)
