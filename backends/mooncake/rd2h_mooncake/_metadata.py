"""The Mooncake engine's registration blob: where the peer's engine listens and what it registered.

A positional msgpack array, append-only like the rest of rd2h's wire formats:

    (b"rd2h-mooncake", version, session_id "host:port", [(addr, length), ...])

``session_id`` is Mooncake's own name for the peer (its P2P handshake address), so a reader
hands it to ``batch_transfer_sync_read`` as the target.
"""

from __future__ import annotations

from rd2h.engine_support import MetadataEnvelope, split_host_port

__all__ = ["ENVELOPE", "encode", "decode", "split_session_id"]

ENVELOPE = MetadataEnvelope("mooncake", b"rd2h-mooncake", 1)


def encode(session_id: str, regions: list[tuple[int, int]]) -> bytes:
    return ENVELOPE.pack(session_id, regions)


split_session_id = split_host_port  # ``"host:port"`` -> ``(host, port)``


def decode(blob: bytes) -> tuple[str, list[tuple[int, int]]]:
    """Parse a peer's blob into ``(session_id, regions)``; ``TransferError`` naming the bad field."""
    return ENVELOPE.unpack_session(blob)
