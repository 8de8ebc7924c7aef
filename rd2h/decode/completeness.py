"""Did a contributor announce every layer of every block of a request? (Decode side, pure.)

A contributor's final signal is a claim: "you have everything I was to send". Decode
believes it only if the chunks that contributor announced tile the request's expected
blocks, from its first block (a cached prefix is not sent) to the end of its destinations,
and each chunk was read on every layer this Decode rank holds. A final signal that covers
nothing, a chunk never announced, or a layer lost on the way then fails the request
instead of calling it DONE with destinations still holding zeros.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["ChunkKey", "Contributor", "Coverage"]

# (main_start, main_count, indexer_start, indexer_count) of one announced chunk
ChunkKey = tuple[int, int, int, int]
# a contributor member, or (member, pipeline stage) for a Prefill run with pipeline parallel
Contributor = int | tuple[int, int]


def _gap(spans: Iterable[tuple[int, int]], lo: int, hi: int, what: str) -> str | None:
    """Why ``spans`` (start, count) do not cover ``[lo, hi)``, or None if they do."""
    end = lo
    for start, count in sorted(spans):
        if count == 0 or start + count <= end:
            continue
        if start > end:
            return f"{what} blocks {end}..{start - 1} were never announced"
        end = start + count
    if end < hi:
        return f"{what} blocks {end}..{hi - 1} were never announced"
    return None


class Coverage:
    """What each contributor of one request announced, and on which layers it was read.

    ``main_span``/``indexer_span`` are the ``[first, end)`` positions of the request's
    destination lists that Prefill must send.
    """

    __slots__ = ("_main", "_indexer", "_seen")

    def __init__(self, main_span: tuple[int, int], indexer_span: tuple[int, int]) -> None:
        self._main = main_span
        self._indexer = indexer_span
        self._seen: dict[Contributor, dict[ChunkKey, set[str]]] = {}

    def record(self, member: Contributor, layer: str, chunk: ChunkKey) -> None:
        """Contributor ``member``'s ``chunk`` was read on ``layer``."""
        self._seen.setdefault(member, {}).setdefault(chunk, set()).add(layer)

    def missing(self, member: Contributor, layers: frozenset[str]) -> str | None:
        """Why ``member``'s announcements are incomplete, or None if they cover ``layers``."""
        chunks = self._seen.get(member, {})
        who = member if isinstance(member, int) else f"{member[0]} of pipeline stage {member[1]}"
        for (main_start, main_count, _, _), read_on in sorted(chunks.items()):
            absent = layers - read_on
            if absent:
                shown = ", ".join(sorted(absent)[:3]) + (" ..." if len(absent) > 3 else "")
                return (
                    f"contributor {who} never announced layer(s) {shown} of the chunk at main "
                    f"block {main_start} ({main_count} blocks)"
                )
        return _gap(((c[0], c[1]) for c in chunks), *self._main, f"contributor {who}: main") or _gap(
            ((c[2], c[3]) for c in chunks), *self._indexer, f"contributor {who}: indexer"
        )
