"""The NIXL engine's registration blob: the peer agent's name, its NIXL metadata, its regions.

A positional msgpack array, append-only like the rest of rd2h's wire formats:

    (b"rd2h-nixl", version, agent_name, agent_metadata: bytes, [(addr, length), ...])

``agent_metadata`` is NIXL's own blob (``get_agent_metadata``: connection info and the
registered memory); the reader loads it with ``add_remote_agent``.
"""

from __future__ import annotations

from rd2h.engine_support import MetadataEnvelope

__all__ = ["ENVELOPE", "encode", "decode"]

ENVELOPE = MetadataEnvelope("nixl", b"rd2h-nixl", 1)


def encode(agent_name: str, agent_metadata: bytes, regions: list[tuple[int, int]]) -> bytes:
    return ENVELOPE.pack(agent_name, agent_metadata, regions)


def decode(blob: bytes) -> tuple[str, bytes, list[tuple[int, int]]]:
    """Parse a peer's blob into ``(agent_name, agent_metadata, regions)``.

    Raises ``TransferError`` naming the field that is wrong.
    """
    name, agent_md, regions = ENVELOPE.unpack(blob, 3)
    if not isinstance(name, str) or not name:
        raise ENVELOPE.malformed("agent_name must be a non-empty string")
    if not isinstance(agent_md, bytes) or not agent_md:
        raise ENVELOPE.malformed("agent_metadata must be non-empty bytes")
    return name, agent_md, ENVELOPE.regions(regions)
