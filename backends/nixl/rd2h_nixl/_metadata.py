"""The NIXL engine's registration blob: the peer agent's name, its NIXL metadata, its regions.

A positional msgpack array, append-only like the rest of rd2h's wire formats:

    (b"rd2h-nixl", version, agent_name, agent_metadata: bytes, [(addr, length), ...], [kind, ...])

``agent_metadata`` is NIXL's own blob (``get_agent_metadata``: connection info and the
registered memory); the reader loads it with ``add_remote_agent``. The last field, appended
later, gives each region's memory kind (``"host"``, ``"cuda:0"``): a reader names remote GPU
memory to NIXL as VRAM of that device. A blob without it (an older peer) registered host
memory only.
"""

from __future__ import annotations

from collections.abc import Sequence

from rd2h.engine_support import MetadataEnvelope
from rd2h.layout.regions import HOST, check_memory_kind

__all__ = ["ENVELOPE", "encode", "decode"]

ENVELOPE = MetadataEnvelope("nixl", b"rd2h-nixl", 1)


def encode(agent_name: str, agent_metadata: bytes, regions: list[tuple[int, int]], kinds: Sequence[str] = ()) -> bytes:
    """The blob; ``kinds`` (one per region) defaults to host memory for every region."""
    return ENVELOPE.pack(agent_name, agent_metadata, regions, list(kinds) or [HOST] * len(regions))


def decode(blob: bytes) -> tuple[str, bytes, list[tuple[int, int]], tuple[str, ...]]:
    """Parse a peer's blob into ``(agent_name, agent_metadata, regions, kinds)``.

    Raises ``TransferError`` naming the field that is wrong.
    """
    name, agent_md, regions, *rest = ENVELOPE.unpack(blob, 3, optional=1)
    if not isinstance(name, str) or not name:
        raise ENVELOPE.malformed("agent_name must be a non-empty string")
    if not isinstance(agent_md, bytes) or not agent_md:
        raise ENVELOPE.malformed("agent_metadata must be non-empty bytes")
    regions = ENVELOPE.regions(regions)
    kinds = rest[0] if rest else [HOST] * len(regions)
    if not isinstance(kinds, list) or len(kinds) != len(regions):
        raise ENVELOPE.malformed(f"kinds must be an array of one memory kind per region ({len(regions)})")
    for i, kind in enumerate(kinds):
        try:
            check_memory_kind(kind, f"kinds[{i}]")
        except (TypeError, ValueError) as exc:
            raise ENVELOPE.malformed(str(exc)) from None
    return name, agent_md, regions, tuple(kinds)

