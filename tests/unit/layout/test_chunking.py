"""Which blocks a prefill step makes ready: each exactly once, the partial one at the end."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rd2h.errors import ConfigError, UnknownRequestError
from rd2h.layout.chunking import Chunk, ChunkPlanner, GroupChunks, blocks_for


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


@given(st.integers(1, 64), st.integers(1, 2000), st.data())
def test_a_group_from_its_first_block_covers_the_rest_once(block_size: int, tokens: int, data: st.DataObject) -> None:
    group = GroupChunks(block_size, tokens, data.draw(st.integers(0, blocks_for(tokens, block_size))))
    cuts = sorted(data.draw(st.lists(st.integers(0, tokens - 1), max_size=6))) + [tokens]
    chunks = []
    for cut in cuts:
        chunks.append(group.peek(cut))
        group.commit(chunks[-1])
    covered = [b for c in chunks for b in range(c.lo, c.hi)]
    assert covered == list(range(group.first_block, group.num_blocks))
    assert chunks[0].lo == group.first_block and [c.final for c in chunks][-1]


def test_groups_with_other_block_sizes_cut_on_their_own() -> None:
    main, indexer = GroupChunks(16, 100), GroupChunks(64, 100)
    assert (main.peek(70), indexer.peek(70)) == (Chunk(0, 4, False), Chunk(0, 1, False))
    assert (main.peek(100), indexer.peek(100)) == (Chunk(0, 7, True), Chunk(0, 2, True))


def test_a_cached_prefix_is_never_announced() -> None:
    group = GroupChunks(16, 64, first_block=2)
    assert group.peek(20) == Chunk(2, 2, False)  # still inside the prefix: nothing new
    group.commit(group.peek(40))
    assert group.announced == 2
    assert group.peek(64) == Chunk(2, 4, True)
    with pytest.raises(ConfigError, match="first_block 5 outside 0..4"):
        GroupChunks(16, 64, first_block=5)
    with pytest.raises(ConfigError):
        GroupChunks(16, 0)
    with pytest.raises(ConfigError):
        GroupChunks(0, 4)
