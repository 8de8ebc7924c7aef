"""The MemFabric engine's registration blob: the peer's session id and what it registered.

A positional msgpack array, append-only like the rest of rd2h's wire formats:

    (b"rd2h-memfabric", version, session_id "ip:port", [(addr, length), ...])
"""

from __future__ import annotations

import msgpack

from rd2h.errors import TransferError

__all__ = ["encode", "decode", "split_session_id"]

MAGIC = b"rd2h-memfabric"
VERSION = 1
_MAX_BLOB = 16 << 20  # far above any real registration; refuses absurd input early
_INT64_MAX = (1 << 63) - 1


def encode(session_id: str, regions: list[tuple[int, int]]) -> bytes:
    return msgpack.packb((MAGIC, VERSION, session_id, regions), use_bin_type=True)


def _malformed(what: str) -> TransferError:
    return TransferError(f"malformed memfabric-engine metadata: {what}")


def split_session_id(session_id: str) -> tuple[str, int]:
    """``"ip:port"`` -> ``(ip, port)``; ``ValueError`` when it is not that shape."""
    host, sep, port = session_id.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"session id must be 'ip:port', got {session_id!r:.80}")
    return host, int(port)


def decode(blob: bytes) -> tuple[str, list[tuple[int, int]]]:
    """Parse a peer's blob into ``(session_id, regions)``.

    Raises ``TransferError`` naming the field that is wrong.
    """
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise _malformed(f"expected bytes, got {type(blob).__name__}")
    if len(blob) > _MAX_BLOB:
        raise _malformed(f"{len(blob)} bytes is more than any registration")
    try:
        msg = msgpack.unpackb(blob, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise _malformed(f"not msgpack ({type(exc).__name__})") from None
    if not isinstance(msg, list) or len(msg) < 4:
        raise _malformed("expected an array of at least 4 fields")
    if msg[0] != MAGIC:
        raise _malformed(f"not produced by the memfabric engine (tag {msg[0]!r:.40})")
    if msg[1] != VERSION:
        raise _malformed(f"version {msg[1]!r:.20}; this engine speaks {VERSION}")
    session_id, raw_regions = msg[2], msg[3]
    if not isinstance(session_id, str):
        raise _malformed("session_id must be a string")
    try:
        split_session_id(session_id)
    except ValueError as exc:
        raise _malformed(str(exc)) from None
    if not isinstance(raw_regions, list):
        raise _malformed("regions must be an array")
    regions = []
    for i, r in enumerate(raw_regions):
        if not (isinstance(r, list) and len(r) == 2 and all(type(v) is int for v in r)):
            raise _malformed(f"region {i} must be an (addr, length) pair of integers")
        addr, length = r
        if addr < 0 or length <= 0 or addr + length > _INT64_MAX:
            raise _malformed(f"region {i} ({addr:#x}+{length}) is not a valid address range")
        regions.append((addr, length))
    return session_id, regions
