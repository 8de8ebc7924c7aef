"""Which blocks of a request become ready in a Prefill step (pure).

With chunked prefill a request's prompt is computed over several steps. A block can be
announced once every token in it is computed; the final chunk also announces the last,
partial block. Announced blocks are never announced again, so Decode reads each block
exactly once.

Each KV cache group of a request (main, indexer) is cut on its own: groups may hold a
different number of tokens per block, so one step can complete two main blocks and one
indexer block. A group may also start at ``first_block``: a prefix Decode already holds is
never announced, and the first chunk starts there.
"""

from __future__ import annotations

from dataclasses import dataclass

from rd2h.errors import ConfigError, UnknownRequestError

__all__ = ["Chunk", "GroupChunks", "ChunkPlanner", "blocks_for"]


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks ``num_tokens`` tokens occupy, the partial last one included."""
    return -(-num_tokens // block_size)


@dataclass(frozen=True, slots=True)
class Chunk:
    """Positions ``[lo, hi)`` of the request's block list that are newly ready."""

    lo: int
    hi: int
    final: bool

    @property
    def count(self) -> int:
        return self.hi - self.lo


@dataclass(slots=True)
class GroupChunks:
    """One cache group of one request: how far it was announced, and its next chunk.

    Raises ConfigError for a non-positive ``block_size`` or ``num_tokens``, or a
    ``first_block`` outside ``0..blocks``.
    """

    block_size: int
    num_tokens: int
    first_block: int = 0
    announced: int = -1  # positions [first_block, announced) were announced already
    final_sent: bool = False

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ConfigError(f"block_size must be positive, got {self.block_size}")
        if self.num_tokens <= 0:
            raise ConfigError(f"num_tokens must be positive, got {self.num_tokens}")
        if not 0 <= self.first_block <= self.num_blocks:
            raise ConfigError(
                f"first_block {self.first_block} outside 0..{self.num_blocks} "
                f"({self.num_tokens} tokens of {self.block_size} per block)"
            )
        if self.announced < self.first_block:
            self.announced = self.first_block

    @property
    def num_blocks(self) -> int:
        return blocks_for(self.num_tokens, self.block_size)

    def peek(self, computed_tokens: int) -> Chunk:
        """The chunk that ``computed_tokens`` cached tokens make ready, not recorded.

        Blocks of the skipped prefix are never part of a chunk. Raises ConfigError once the
        final chunk was announced or for ``computed_tokens`` outside ``0..num_tokens``.
        """
        if self.final_sent:
            raise ConfigError("its final chunk was already announced")
        if not 0 <= computed_tokens <= self.num_tokens:
            raise ConfigError(f"computed_tokens {computed_tokens} outside 0..{self.num_tokens}")
        final = computed_tokens == self.num_tokens
        ready = self.num_blocks if final else computed_tokens // self.block_size
        return Chunk(self.announced, max(ready, self.announced), final)

    def commit(self, chunk: Chunk) -> None:
        """Record ``chunk`` (from ``peek``) as announced."""
        self.announced = chunk.hi
        self.final_sent = chunk.final


class ChunkPlanner:
    """Tracks, per request, how many blocks were announced and cuts the next chunk
    (one cache group, starting at block 0)."""

    def __init__(self, block_size: int) -> None:
        if block_size <= 0:
            raise ConfigError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self._requests: dict[str, GroupChunks] = {}
        self._computed: dict[str, int] = {}

    def track(self, ext_id: str, num_tokens: int) -> None:
        """Start tracking a request whose prompt has ``num_tokens`` tokens."""
        if num_tokens <= 0:
            raise ConfigError(f"request {ext_id!r}: num_tokens must be positive, got {num_tokens}")
        if ext_id in self._requests:
            raise ConfigError(f"request {ext_id!r} is already tracked")
        self._requests[ext_id] = GroupChunks(self.block_size, num_tokens)
        self._computed[ext_id] = 0

    def num_blocks(self, ext_id: str) -> int:
        """Blocks the whole prompt occupies, the partial last one included."""
        return self._progress(ext_id).num_blocks

    def peek(self, ext_id: str, computed_tokens: int) -> Chunk:
        """The chunk ``advance`` would return, without recording it. Raises like ``advance``."""
        progress = self._progress(ext_id)
        try:
            chunk = progress.peek(computed_tokens)
        except ConfigError as exc:
            raise ConfigError(f"request {ext_id!r}: {exc}") from None
        if computed_tokens < self._computed[ext_id]:
            raise ConfigError(
                f"request {ext_id!r}: computed_tokens went back ({computed_tokens} tokens after "
                f"{self._computed[ext_id]})"
            )
        return chunk

    def advance(self, ext_id: str, computed_tokens: int) -> Chunk:
        """The chunk made ready once ``computed_tokens`` prompt tokens are in the cache.

        Raises UnknownRequestError for an untracked id, ConfigError once the final chunk was
        announced, for tokens outside ``0..num_tokens`` or fewer than last time.
        """
        chunk = self.peek(ext_id, computed_tokens)
        self._requests[ext_id].commit(chunk)
        self._computed[ext_id] = computed_tokens
        return chunk

    def forget(self, ext_id: str) -> None:
        self._requests.pop(ext_id, None)
        self._computed.pop(ext_id, None)

    def _progress(self, ext_id: str) -> GroupChunks:
        try:
            return self._requests[ext_id]
        except KeyError:
            raise UnknownRequestError(f"request {ext_id!r} is not tracked") from None
