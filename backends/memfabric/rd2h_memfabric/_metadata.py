"""The MemFabric engine's registration blob: the peer's session id and what it registered.

A positional msgpack array, append-only like the rest of rd2h's wire formats:

    (b"rd2h-memfabric", version, session_id "ip:port", [(addr, length), ...])
"""

from __future__ import annotations

from rd2h.engine_support import MetadataEnvelope, split_host_port

__all__ = ["encode", "decode", "split_session_id"]

ENVELOPE = MetadataEnvelope("memfabric", b"rd2h-memfabric", 1)


def encode(session_id: str, regions: list[tuple[int, int]]) -> bytes:
    return ENVELOPE.pack(session_id, regions)


split_session_id = split_host_port  # ``"ip:port"`` -> ``(ip, port)``


def decode(blob: bytes) -> tuple[str, list[tuple[int, int]]]:
    """Parse a peer's blob into ``(session_id, regions)``; ``TransferError`` naming the bad field."""
    return ENVELOPE.unpack_session(blob)
