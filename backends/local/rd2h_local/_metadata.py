"""The local engine's registration blob: who the peer is and what it registered.

A positional msgpack array, append-only like the rest of rd2h's wire formats:

    (b"rd2h-local", version, boot_id, hostname, pid_namespace | None, pid, start_time | None,
     [(addr, length), ...])
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack

from rd2h.errors import TransferError
from rd2h.interfaces import Region

__all__ = ["PeerInfo", "encode", "decode"]

MAGIC = b"rd2h-local"
VERSION = 1
_MAX_BLOB = 16 << 20  # far above any real registration; refuses absurd input early


@dataclass(frozen=True, slots=True)
class PeerInfo:
    boot_id: str
    hostname: str
    pid_namespace: int | None
    pid: int
    start_time: int | None
    regions: tuple[Region, ...]


def encode(info: PeerInfo) -> bytes:
    regions = [(r.addr, r.length) for r in info.regions]
    return msgpack.packb(
        (MAGIC, VERSION, info.boot_id, info.hostname, info.pid_namespace, info.pid, info.start_time, regions),
        use_bin_type=True,
    )


def _malformed(what: str) -> TransferError:
    return TransferError(f"malformed local-engine metadata: {what}")


def _int(value: object, field: str) -> int:
    if type(value) is not int or value < 0:
        raise _malformed(f"{field} must be a non-negative integer, got {value!r:.60}")
    return value


def _optional_int(value: object, field: str) -> int | None:
    return None if value is None else _int(value, field)


def decode(blob: bytes) -> PeerInfo:
    """Parse a peer's blob. Raises ``TransferError`` naming the field that is wrong."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise _malformed(f"expected bytes, got {type(blob).__name__}")
    if len(blob) > _MAX_BLOB:
        raise _malformed(f"{len(blob)} bytes is more than any registration")
    try:
        msg = msgpack.unpackb(blob, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise _malformed(f"not msgpack ({type(exc).__name__})") from None
    if not isinstance(msg, list) or len(msg) < 8:
        raise _malformed("expected an array of at least 8 fields")
    if msg[0] != MAGIC:
        raise _malformed(f"not produced by the local engine (tag {msg[0]!r:.40})")
    if msg[1] != VERSION:
        raise _malformed(f"version {msg[1]!r:.20}; this engine speaks {VERSION}")
    boot, host = msg[2], msg[3]
    if not isinstance(boot, str) or not isinstance(host, str):
        raise _malformed("boot_id and hostname must be strings")
    pidns = _optional_int(msg[4], "pid_namespace")
    pid = _int(msg[5], "pid")
    start = _optional_int(msg[6], "start_time")
    if not pid:
        raise _malformed("pid must be positive")
    if not isinstance(msg[7], list):
        raise _malformed("regions must be an array")
    regions = []
    for i, item in enumerate(msg[7]):
        if not isinstance(item, list) or len(item) != 2:
            raise _malformed(f"region {i} must be (addr, length)")
        addr, length = _int(item[0], f"region {i} addr"), _int(item[1], f"region {i} length")
        if not length or addr + length > (1 << 63) - 1:
            raise _malformed(f"region {i} ({addr:#x}+{length}) is empty or beyond the address space")
        regions.append(Region(addr, length))
    return PeerInfo(boot, host, pidns, pid, start, tuple(regions))
