"""Host staging, pure parts: mirror rows per step (rd2h.staging.mirror_tables) and the
host stand-in's vectorized copies (rd2h.device)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rd2h.device import HostStandIn, byte_rows
from rd2h.errors import ConfigError
from rd2h.staging.mirror_tables import MirrorTables


def tables(rows: int = 16, indexer_block_size: int | None = None, limit: int = 100) -> MirrorTables:
    return MirrorTables(block_size=16, indexer_block_size=indexer_block_size, main_rows=rows, indexer_rows=rows,
                        main_limit=limit, indexer_limit=limit)  # fmt: skip


def add(t: MirrorTables, ext_id: str, main: list[int], tokens: int, *, indexer: list[int] | None = None,
        first_block: int = 0) -> None:  # fmt: skip
    t.add(ext_id, t.check(ext_id, main, indexer, tokens, first_block))


def test_a_step_gives_consecutive_rows_in_request_order_and_stages_their_device_blocks() -> None:
    t = tables()
    add(t, "a", [7, 3, 9], 40)
    add(t, "b", [50, 51], 20)
    step = t.plan({"a": 40, "b": 20})
    assert step.extend["a"][0].tolist() == [0, 1, 2] and step.extend["b"][0].tolist() == [3, 4]
    assert step.main_blocks.tolist() == [7, 3, 9, 50, 51]
    assert step.indexer_blocks.tolist() == [7, 3, 9, 50, 51]  # the indexer uses the main ids
    assert step.extend["b"][1].tolist() == [3, 4]


def test_chunked_steps_reuse_rows_and_pad_positions_never_announced() -> None:
    t = tables()
    add(t, "a", [7, 3, 9, 4], 60, first_block=1)  # block 0 is a prefix Decode holds
    first = t.plan({"a": 48})  # blocks 1 and 2 complete
    assert first.extend["a"][0].tolist() == [0, 0, 1]  # position 0: a placeholder
    assert first.main_blocks.tolist() == [3, 9]
    t.handed(first)
    t.commit(first, ["a"])
    final = t.plan({"a": 60})  # the final chunk carries the partial last block
    assert final.extend["a"][0].tolist() == [0]  # rows restart at 0 each step
    assert final.main_blocks.tolist() == [4]


def test_a_request_the_tracker_refused_is_not_committed_and_never_planned_twice_from_old_rows() -> None:
    t = tables()
    add(t, "a", [1, 2], 32)
    step = t.plan({"a": 32})
    t.handed(step)
    t.commit(step, [])  # refused: stays uncommitted
    again = t.plan({"a": 32})
    assert again.extend["a"][0].tolist() == [0, 1]  # positions already given: nothing padded before them


def test_a_step_bigger_than_a_slot_refuses_the_request_that_does_not_fit_and_keeps_the_others() -> None:
    t = tables(rows=4)
    add(t, "a", [1, 2, 3], 48)
    add(t, "big", [4, 5, 6], 48)
    add(t, "c", [7], 16)
    step = t.plan({"a": 48, "big": 48, "c": 16})
    assert set(step.extend) == {"a", "c"} and "blocks_per_slot" in str(step.refused["big"])
    assert step.main_blocks.tolist() == [1, 2, 3, 7]


@pytest.mark.parametrize(
    ("main", "indexer", "tokens"),
    [([100], None, 16), ([-1], None, 16), ([1.5], None, 16), ([1], [100], 16), ([1], None, "16"), ([1], None, True)],
)
def test_ids_past_the_device_blocks_and_bad_counts_are_refused(main: list, indexer: list | None, tokens: object) -> None:
    with pytest.raises(ConfigError):
        tables().check("a", main, indexer, tokens, 0)  # type: ignore[arg-type]


def test_extend_checks_ids_and_ignores_an_ended_request() -> None:
    t = tables()
    add(t, "a", [1], 48)
    with pytest.raises(ConfigError):
        t.extend("a", [100], ())
    with pytest.raises(ConfigError, match="without indexer ids"):
        t.extend("a", [2], [3])
    t.forget(["a"])
    t.extend("a", [100], ())  # ended: nothing to check against


def test_indexer_blocks_of_another_size_get_rows_of_their_own() -> None:
    t = tables(indexer_block_size=32)
    with pytest.raises(ConfigError, match="give their ids"):
        t.check("a", [1, 2], None, 64, 0)
    add(t, "a", [1, 2, 3, 4], 64, indexer=[40, 41])
    add(t, "b", [5, 6], 32, indexer=[42])
    step = t.plan({"a": 64, "b": 32})
    assert step.main_blocks.tolist() == [1, 2, 3, 4, 5, 6]
    assert step.indexer_blocks.tolist() == [40, 41, 42]
    assert step.extend["b"][1].tolist() == [2]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 6), st.integers(0, 3)), min_size=1, max_size=5), st.integers(1, 24))
def test_rows_of_a_step_are_disjoint_and_map_back_to_each_requests_device_blocks(
    requests: list[tuple[int, int]], rows: int
) -> None:
    t = tables(rows=rows)
    rng = np.random.default_rng(len(requests) * 31 + rows)
    ids = {}
    for i, (blocks, skip) in enumerate(requests):
        ids[f"r{i}"] = rng.choice(100, blocks, replace=False).tolist()
        add(t, f"r{i}", ids[f"r{i}"], blocks * 16, first_block=min(skip, blocks - 1))
    step = t.plan({f"r{i}": blocks * 16 for i, (blocks, _) in enumerate(requests)})
    seen: list[int] = []
    for ext_id, (main, _) in step.extend.items():
        first = min(requests[int(ext_id[1:])][1], len(ids[ext_id]) - 1)
        announced = main[first:]
        assert step.main_blocks[announced].tolist() == ids[ext_id][first:]
        seen += announced.tolist()
    assert sorted(seen) == list(range(len(seen))) and len(seen) <= rows
    assert set(step.extend) | set(step.refused) == set(ids)


def test_the_stand_in_gathers_and_scatters_rows_by_index() -> None:
    dev = HostStandIn()
    src = torch.arange(40, dtype=torch.uint8).reshape(10, 4)
    host = dev.pinned(64).view(16, 4)
    dev.gather_to_host(dev.stream(), src, np.array([7, 2, 9]), host)
    assert host[:3].tolist() == src[[7, 2, 9]].tolist() and not host[3:].any()
    dst = torch.zeros(10, 4, dtype=torch.uint8)
    dev.scatter_from_host(dev.stream(), host[:3], dst, np.array([1, 5, 0]))
    assert dst[[1, 5, 0]].tolist() == src[[7, 2, 9]].tolist() and not dst[[2, 3, 4, 6, 7, 8, 9]].any()
    assert dev.record(dev.stream()).query()


def test_byte_rows_is_a_view_of_padded_blocks_and_of_units() -> None:
    whole = torch.zeros(6, 8, dtype=torch.bfloat16)
    padded = whole[:, :4]  # blocks of 8 bytes, 16 apart
    rows = byte_rows(padded)
    assert rows.shape == (6, 8) and rows.stride() == (16, 1) and rows.data_ptr() == padded.data_ptr()
    rows[2] = 255
    assert (padded[2].view(torch.uint8) == 255).all() and not whole[2, 4:].view(torch.uint8).any()
    units = byte_rows(padded, 4)
    assert units.shape == ((5 * 16 + 8) // 4, 4)
    units[9] = 7  # bytes 36..39: block 2's second half
    assert padded[2].view(torch.uint8)[4:].tolist() == [7] * 4
