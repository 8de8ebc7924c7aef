"""Which blocks of a request become ready in a Prefill step (pure).

With chunked prefill a request's prompt is computed over several steps. A block can be
announced once every token in it is computed; the final chunk also announces the last,
partial block. Announced blocks are never announced again, so Decode reads each block
exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass

from rd2h.errors import ConfigError, UnknownRequestError

__all__ = ["Chunk", "ChunkPlanner"]


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
class _Progress:
    num_tokens: int
    announced: int = 0  # positions [0, announced) were announced already
    final_sent: bool = False


class ChunkPlanner:
    """Tracks, per request, how many blocks were announced and cuts the next chunk."""

    def __init__(self, block_size: int) -> None:
        if block_size <= 0:
            raise ConfigError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self._requests: dict[str, _Progress] = {}

    def track(self, ext_id: str, num_tokens: int) -> None:
        """Start tracking a request whose prompt has ``num_tokens`` tokens."""
        if num_tokens <= 0:
            raise ConfigError(f"request {ext_id!r}: num_tokens must be positive, got {num_tokens}")
        if ext_id in self._requests:
            raise ConfigError(f"request {ext_id!r} is already tracked")
        self._requests[ext_id] = _Progress(num_tokens)

    def num_blocks(self, ext_id: str) -> int:
        """Blocks the whole prompt occupies, the partial last one included."""
        return -(-self._progress(ext_id).num_tokens // self.block_size)

    def peek(self, ext_id: str, computed_tokens: int) -> Chunk:
        """The chunk ``advance`` would return, without recording it. Raises like ``advance``."""
        progress = self._progress(ext_id)
        if progress.final_sent:
            raise ConfigError(f"request {ext_id!r}: its final chunk was already announced")
        if not 0 <= computed_tokens <= progress.num_tokens:
            raise ConfigError(
                f"request {ext_id!r}: computed_tokens {computed_tokens} outside 0..{progress.num_tokens}"
            )
        final = computed_tokens == progress.num_tokens
        ready = self.num_blocks(ext_id) if final else computed_tokens // self.block_size
        if ready < progress.announced:
            raise ConfigError(
                f"request {ext_id!r}: computed_tokens went back ({computed_tokens} tokens after "
                f"{progress.announced} blocks were announced)"
            )
        return Chunk(progress.announced, ready, final)

    def advance(self, ext_id: str, computed_tokens: int) -> Chunk:
        """The chunk made ready once ``computed_tokens`` prompt tokens are in the cache."""
        chunk = self.peek(ext_id, computed_tokens)
        progress = self._requests[ext_id]
        progress.announced = chunk.hi
        progress.final_sent = chunk.final
        return chunk

    def forget(self, ext_id: str) -> None:
        self._requests.pop(ext_id, None)

    def _progress(self, ext_id: str) -> _Progress:
        try:
            return self._requests[ext_id]
        except KeyError:
            raise UnknownRequestError(f"request {ext_id!r} is not tracked") from None
