"""Which blocks a prefill step makes ready: each exactly once, the partial one at the end."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rd2h.chunking import Chunk, ChunkPlanner
from rd2h.errors import ConfigError, UnknownRequestError


def test_partial_block_waits_for_the_final_chunk() -> None:
    planner = ChunkPlanner(16)
    planner.track("r", 40)  # 3 blocks, the last one partial
    assert planner.advance("r", 20) == Chunk(0, 1, False)
    assert planner.advance("r", 32) == Chunk(1, 2, False)
    assert planner.advance("r", 40) == Chunk(2, 3, True)
    with pytest.raises(ConfigError, match="already"):
        planner.advance("r", 40)


@given(st.integers(1, 64), st.integers(1, 2000), st.data())
def test_chunks_cover_every_block_once(block_size: int, tokens: int, data: st.DataObject) -> None:
    planner = ChunkPlanner(block_size)
    planner.track("r", tokens)
    cuts = sorted(data.draw(st.lists(st.integers(0, tokens - 1), max_size=6)))
    chunks = [planner.advance("r", c) for c in cuts] + [planner.advance("r", tokens)]
    covered = [b for c in chunks for b in range(c.lo, c.hi)]
    assert covered == list(range(planner.num_blocks("r")))
    assert [c.final for c in chunks] == [False] * len(cuts) + [True]


def test_bad_calls_say_what_is_wrong() -> None:
    planner = ChunkPlanner(8)
    planner.track("r", 30)
    planner.advance("r", 24)
    with pytest.raises(ConfigError, match="went back"):
        planner.advance("r", 9)
    with pytest.raises(ConfigError, match="outside"):
        planner.advance("r", 31)
    with pytest.raises(UnknownRequestError):
        planner.advance("nobody", 1)
    with pytest.raises(ConfigError, match="already tracked"):
        planner.track("r", 5)
    with pytest.raises(ConfigError):
        ChunkPlanner(0)
