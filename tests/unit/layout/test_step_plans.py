"""StepPlans: a plan moved from a template equals a fresh build at the new addresses, and
anything it cannot vouch for is built afresh."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rd2h.errors import MainBlockLengthMismatch
from rd2h.layout.layers import LayerLayout, TensorLayout
from rd2h.layout.planning import RequestRead, build_layer_plan
from rd2h.layout.regions import Region, RegionSet
from rd2h.layout.step_plans import StepPlans

GiB = 1 << 30


def layer(base: int, blocks: int = 32, stride: int | None = None) -> LayerLayout:
    return LayerLayout(
        (TensorLayout(base, 64, blocks, block_stride=stride), TensorLayout(base + GiB // 4, 32, blocks)),
        TensorLayout(base + GiB // 2, 16, blocks),
        TensorLayout(base + 3 * GiB // 4, 8, blocks),
    )


def regions(*layouts: LayerLayout) -> RegionSet:
    return RegionSet([r for layout in layouts for r in layout.regions()])


def reads_of(draw_ids: list[tuple[list[int], list[int]]]) -> list[RequestRead]:
    return [RequestRead(f"r{i}", s, d, s, d) for i, (s, d) in enumerate(draw_ids)]


pairs = st.lists(st.tuples(st.integers(0, 31), st.integers(0, 31)), max_size=12).map(lambda p: ([a for a, _ in p], [b for _, b in p]))


@settings(max_examples=100, deadline=None)
@given(st.lists(pairs, max_size=4), st.lists(st.integers(1, 60), min_size=2, max_size=5))
def test_a_moved_plan_equals_a_fresh_build(ids: list[tuple[list[int], list[int]]], layer_gigs: list[int]) -> None:
    reads = reads_of(ids)
    srcs = [layer(g * GiB) for g in layer_gigs]
    dsts = [layer((g + 100) * GiB) for g in layer_gigs]
    src_regions, dst_regions = regions(*srcs), regions(*dsts)
    plans = StepPlans()
    for src, dst in zip(srcs, dsts):
        got = plans.build("step", src, dst, reads, src_regions=src_regions, dst_regions=dst_regions)
        want = build_layer_plan(src, dst, reads, src_regions=src_regions, dst_regions=dst_regions)
        for a in ("local", "remote", "lengths"):
            assert np.array_equal(getattr(got, a), getattr(want, a)), a
        assert (got.requests, got.failed, got.blocks, got.nbytes) == (want.requests, want.failed, want.blocks, want.nbytes)
    assert plans.rebuilt == 1 and plans.moved == len(srcs) - 1


def test_ranges_outside_the_regions_are_built_afresh_and_fail_there() -> None:
    reads = reads_of([([1, 2], [3, 4])])
    a, b = layer(1 * GiB), layer(2 * GiB)
    plans = StepPlans()
    plans.build("k", a, a, reads, src_regions=regions(a, b), dst_regions=regions(a, b))
    narrow = RegionSet([Region(2 * GiB, 64)])  # b's main[0] block 0 only: block 1 is outside
    plan = plans.build("k", b, a, reads, src_regions=narrow, dst_regions=regions(a))
    assert plans.moved == 0 and "r0" in plan.failed


def test_a_new_shape_a_missing_key_or_a_failed_plan_is_not_reused() -> None:
    reads = reads_of([([1], [2])])
    a, b = layer(1 * GiB), layer(2 * GiB)
    every = regions(a, b, layer(3 * GiB, stride=128), layer(1 * GiB, blocks=64))
    plans = StepPlans()
    plans.build("k", a, a, reads, src_regions=every, dst_regions=every)
    plans.build("k", layer(1 * GiB, blocks=64), layer(1 * GiB, blocks=64), reads, src_regions=every, dst_regions=every)
    plans.build(None, b, b, reads, src_regions=every, dst_regions=every)
    assert plans.moved == 0
    bad = reads_of([([99], [2])])  # out of range: the plan fails r0, so it is not remembered
    plans.build("bad", a, a, bad, src_regions=every, dst_regions=every)
    assert "r0" in plans.build("bad", b, b, bad, src_regions=every, dst_regions=every).failed
    assert plans.moved == 0


def test_a_layout_mismatch_is_raised_even_from_a_template() -> None:
    reads = reads_of([([1], [2])])
    a = layer(1 * GiB)
    plans = StepPlans()
    plans.build("k", a, a, reads, src_regions=regions(a), dst_regions=regions(a))
    other = LayerLayout((TensorLayout(GiB, 32, 32), TensorLayout(GiB + GiB // 4, 32, 32)), a.indexer, a.scale)
    with pytest.raises(MainBlockLengthMismatch):
        plans.build("k", other, a, reads, src_regions=regions(a, other), dst_regions=regions(a))
    with pytest.raises(MainBlockLengthMismatch):  # a mismatch is never remembered as validated
        plans.build("k", other, a, reads, src_regions=regions(a, other), dst_regions=regions(a))


def test_a_layer_registered_only_in_part_is_built_afresh_and_right() -> None:
    """A move is vouched for by whole tensors inside the regions; a layer whose tensors are
    registered only where the blocks read lie gets a full build, which reads it rightly."""
    reads = reads_of([([0, 1], [0, 1])])
    a, b = layer(1 * GiB), layer(2 * GiB)
    part = RegionSet([Region(t.base_addr, 2 * t.stride) for t in b.tensors()])  # blocks 0-1 only
    plans = StepPlans()
    plans.learn([a], regions(a))
    plans.build("k", a, a, reads, src_regions=regions(a), dst_regions=regions(a))
    got = plans.build("k", b, a, reads, src_regions=part, dst_regions=regions(a))
    want = build_layer_plan(b, a, reads, src_regions=part, dst_regions=regions(a))
    assert plans.moved == 0 and not got.failed
    assert np.array_equal(got.remote, want.remote) and np.array_equal(got.local, want.local)


def test_pairs_learnt_ahead_skip_nothing_that_matters() -> None:
    """``learn_pairs`` swallows a mismatch (it is raised when the layer is read) and a
    matching pair read later is planned exactly as without it."""
    reads = reads_of([([1], [2])])
    a = layer(1 * GiB)
    other = LayerLayout((TensorLayout(GiB, 32, 32), TensorLayout(GiB + GiB // 4, 32, 32)), a.indexer, a.scale)
    plans = StepPlans()
    plans.learn_pairs([("good", a, a), ("bad", other, a)])
    with pytest.raises(MainBlockLengthMismatch):
        plans.build("k", other, a, reads, src_regions=regions(a, other), dst_regions=regions(a), layer_name="bad")
    got = plans.build("k", a, a, reads, src_regions=regions(a), dst_regions=regions(a), layer_name="good")
    want = build_layer_plan(a, a, reads, src_regions=regions(a), dst_regions=regions(a))
    assert np.array_equal(got.remote, want.remote) and np.array_equal(got.local, want.local)
