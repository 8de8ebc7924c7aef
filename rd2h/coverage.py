"""Did a contributor announce every layer of every chunk of a request? (Decode side, pure.)

Contributor completion (``tracking.ContributorTracker``) trusts the final signal. This
checks what the final signal claims: for each contributor, the chunks it announced tile
the request's blocks from 0 without a gap, and each chunk was read on every layer this
Decode rank holds. A layer Prefill failed to announce, or one lost to an abandoned
connection, then fails the request instead of leaving a hole in a request called DONE.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

__all__ = ["ChunkKey", "CoverageTracker"]

# (main_start, main_count, indexer_start, indexer_count) of one announced chunk
ChunkKey = tuple[int, int, int, int]


def _gap(spans: Iterable[tuple[int, int]], what: str) -> str | None:
    end = 0
    for start, count in sorted(spans):
        if start > end:
            return f"{what} blocks {end}..{start - 1} were never announced"
        end = max(end, start + count)
    return None


class CoverageTracker:
    """Per request and contributor: which layers of which chunks were read."""

    def __init__(self, layers: Iterable[str]) -> None:
        self._layers = frozenset(layers)
        self._seen: dict[str, dict[int, dict[ChunkKey, set[str]]]] = defaultdict(
            lambda: defaultdict(lambda: defaultdict(set))
        )

    def record(self, ext_id: str, member: int, layer: str, chunk: ChunkKey) -> None:
        """Contributor ``member``'s chunk of ``ext_id`` was read on ``layer``."""
        self._seen[ext_id][member][chunk].add(layer)

    def missing(self, ext_id: str, member: int) -> str | None:
        """Why ``member``'s announcements of ``ext_id`` are incomplete, or None if complete."""
        chunks = self._seen.get(ext_id, {}).get(member, {})
        for (main_start, main_count, _, _), layers in sorted(chunks.items()):
            absent = self._layers - layers
            if absent:
                shown = ", ".join(sorted(absent)[:3]) + (" ..." if len(absent) > 3 else "")
                return (
                    f"contributor {member} never announced layer(s) {shown} of the chunk at main "
                    f"block {main_start} ({main_count} blocks)"
                )
        return _gap(((c[0], c[1]) for c in chunks), f"contributor {member}: main") or _gap(
            ((c[2], c[3]) for c in chunks), f"contributor {member}: indexer"
        )

    def forget(self, ext_id: str) -> None:
        self._seen.pop(ext_id, None)
