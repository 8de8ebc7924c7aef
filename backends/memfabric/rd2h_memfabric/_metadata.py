"""The MemFabric engine's registration blob: the peer's session id and what it registered.

A positional msgpack array, append-only like the rest of rd2h's wire formats:

    (b"rd2h-memfabric", version, session_id "ip:port", [(addr, length), ...])
"""

from __future__ import annotations

from rd2h.engine_support import MetadataEnvelope

__all__ = ["encode", "decode", "split_session_id"]

ENVELOPE = MetadataEnvelope("memfabric", b"rd2h-memfabric", 1)


def encode(session_id: str, regions: list[tuple[int, int]]) -> bytes:
    return ENVELOPE.pack(session_id, regions)


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
    session_id, regions = ENVELOPE.unpack(blob, 2)
    if not isinstance(session_id, str):
        raise ENVELOPE.malformed("session_id must be a string")
    try:
        split_session_id(session_id)
    except ValueError as exc:
        raise ENVELOPE.malformed(str(exc)) from None
    return session_id, ENVELOPE.regions(regions)
