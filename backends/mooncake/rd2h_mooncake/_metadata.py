"""The Mooncake engine's registration blob: where the peer's engine listens and what it registered.

A positional msgpack array, append-only like the rest of rd2h's wire formats:

    (b"rd2h-mooncake", version, session_id "host:port", [(addr, length), ...])

``session_id`` is Mooncake's own name for the peer (its P2P handshake address), so a reader
hands it to ``batch_transfer_sync_read`` as the target.
"""

from __future__ import annotations

from rd2h.engine_support import MetadataEnvelope

__all__ = ["ENVELOPE", "encode", "decode", "split_session_id"]

ENVELOPE = MetadataEnvelope("mooncake", b"rd2h-mooncake", 1)


def encode(session_id: str, regions: list[tuple[int, int]]) -> bytes:
    return ENVELOPE.pack(session_id, regions)


def split_session_id(session_id: str) -> tuple[str, int]:
    """``"host:port"`` -> ``(host, port)``; ``ValueError`` when it is not that shape."""
    host, sep, port = session_id.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"session id must be 'host:port', got {session_id!r:.80}")
    return host, int(port)


def decode(blob: bytes) -> tuple[str, list[tuple[int, int]]]:
    """Parse a peer's blob into ``(session_id, regions)``; ``TransferError`` naming the bad field."""
    session_id, regions = ENVELOPE.unpack(blob, 2)
    if not isinstance(session_id, str):
        raise ENVELOPE.malformed("session_id must be a string")
    try:
        split_session_id(session_id)
    except ValueError as exc:
        raise ENVELOPE.malformed(str(exc)) from None
    return session_id, ENVELOPE.regions(regions)
