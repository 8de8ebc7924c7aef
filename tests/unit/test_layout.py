"""Layouts, validation, region checks and descriptor building (rd2h.layout, rd2h.planning, rd2h.regions)."""

from __future__ import annotations

import ctypes
import dataclasses
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rd2h.errors import (
    BlockRangeError,
    IndexerBlockLengthMismatch,
    IndexerPresenceMismatch,
    LayoutError,
    MainBlockLengthMismatch,
    MainTensorCountMismatch,
    RegionError,
    ScaleLayoutMismatch,
    ScalePresenceMismatch,
)
from rd2h.layout import LayerLayout, TensorLayout, validate_layer
from rd2h.planning import LayerPlan, PlanBuilder, RequestRead, block_addresses, build_layer_plan
from rd2h.regions import Region, RegionSet

T = TensorLayout


def layer(main=((0x1000, 64, 16), (0x9000, 64, 16)), indexer=(0x20000, 16, 8), scale=(0x30000, 4, 8)):
    return LayerLayout(
        tuple(T(*m) for m in main),
        None if indexer is None else T(*indexer),
        None if scale is None else T(*scale),
    )


# --------------------------------------------------------------------------- dataclasses


def test_tensor_layout_rejects_nonsense():
    for args in [(-1, 64, 4), (0, 0, 4), (0, 64, -1), (0, 64, 4, 0), (2**62, 2**31, 2**31)]:
        with pytest.raises(ValueError):
            T(*args)
    t = T(np.int64(0x1000), np.int32(64), 4, 2)
    assert type(t.base_addr) is int and t.stride == 128 and t.nbytes == 512


def test_layer_layout_rules_and_order():
    with pytest.raises(ValueError):
        LayerLayout(())
    with pytest.raises(ValueError):
        LayerLayout((T(0, 8, 1),), None, T(64, 8, 1))
    lay = layer()
    assert [n for n, _ in lay.named_tensors()] == ["main[0]", "main[1]", "indexer", "scale"]
    assert lay.tensors() == (lay.main[0], lay.main[1], lay.indexer, lay.scale)
    assert lay.regions() == (
        Region(0x1000, 1024),
        Region(0x9000, 1024),
        Region(0x20000, 128),
        Region(0x30000, 32),
    )
    assert LayerLayout([T(0, 8, 1)]).main == (T(0, 8, 1),)  # a list becomes a tuple
    assert lay.main_slot == 0x1000 and lay.indexer_slot == 0x20000


def test_block_addresses():
    t = T(0x1000, 64, 10, 2)
    assert block_addresses(t, [0, 3, 9]).tolist() == [0x1000, 0x1000 + 3 * 128, 0x1000 + 9 * 128]
    assert block_addresses(t, []).dtype == np.int64
    for bad in ([10], [-1], [0, 2**40]):
        with pytest.raises(BlockRangeError, match=str(bad[-1])):
            block_addresses(t, bad)


def test_request_read_converts_ids():
    r = RequestRead("r", [1, 2], np.array([3, 4], dtype=np.uint32))
    assert r.src_main.dtype == np.int64 and r.dst_main.tolist() == [3, 4]
    assert r.src_indexer.size == 0 and r.src_indexer.dtype == np.int64
    with pytest.raises(TypeError):
        RequestRead("r", [1.5], [1])
    with pytest.raises(ValueError):
        RequestRead("r", [[1]], [[1]])


# --------------------------------------------------------------------------- validation

ORDER = [
    ("count", MainTensorCountMismatch),
    ("main_len", MainBlockLengthMismatch),
    ("indexer_presence", IndexerPresenceMismatch),
    ("indexer_len", IndexerBlockLengthMismatch),
    ("scale_presence", ScalePresenceMismatch),
    ("scale_len", ScaleLayoutMismatch),
]


def _wider(t: TensorLayout) -> TensorLayout:
    return dataclasses.replace(t, block_len=t.block_len + 8)


def mutate(lay: LayerLayout, what: str, tensor: int) -> LayerLayout:
    if what == "count":
        return dataclasses.replace(lay, main=lay.main + (T(0x50000, 64, 16),))
    if what == "main_len":
        main = list(lay.main)
        main[tensor] = _wider(main[tensor])
        return dataclasses.replace(lay, main=tuple(main))
    if what == "indexer_presence":
        return dataclasses.replace(lay, indexer=None, scale=None)
    if what == "indexer_len":
        return dataclasses.replace(lay, indexer=_wider(lay.indexer)) if lay.indexer else lay
    if what == "scale_presence":
        return dataclasses.replace(lay, scale=None)
    if what == "scale_len":
        return dataclasses.replace(lay, scale=_wider(lay.scale)) if lay.scale else lay
    raise AssertionError(what)


@given(
    st.sets(st.sampled_from([w for w, _ in ORDER])),
    st.integers(0, 1),
    st.booleans(),
    st.booleans(),
)
def test_validation_reports_first_mismatch_in_spec_order(mutations, tensor, on_decode, harmless):
    src = dst = layer()
    if harmless:  # other base addresses, block counts, and the same bytes per block split otherwise
        dst = LayerLayout(
            tuple(T(0x70000 + i * 0x8000, 32, 5, 2) for i in range(2)), T(0x90000, 8, 3, 2), T(0x99000, 2, 3, 2)
        )
    for what, _ in ORDER:  # apply in order: a later mutation never undoes an earlier one
        if what in mutations:
            if on_decode:
                dst = mutate(dst, what, tensor)
            else:
                src = mutate(src, what, tensor)
    expected = next((err for what, err in ORDER if what in mutations), None)
    if expected is None:
        validate_layer("L", src, dst)
        return
    with pytest.raises(LayoutError) as info:
        validate_layer("model.layers.3", src, dst)
    assert type(info.value) is expected
    msg = str(info.value)
    assert "'model.layers.3'" in msg and "Prefill" in msg and "Decode" in msg


def test_validation_messages_name_both_values():
    with pytest.raises(MainTensorCountMismatch, match="Prefill 2, Decode 1"):
        validate_layer("L", layer(), layer(main=((0, 64, 4),)))
    with pytest.raises(MainBlockLengthMismatch, match=r"main tensor 1 .*Prefill 64 .*Decode 128"):
        validate_layer("L", layer(), layer(main=((0, 64, 4), (0, 64, 2, 2))))
    with pytest.raises(IndexerPresenceMismatch, match="Prefill present, Decode absent"):
        validate_layer("L", layer(), layer(indexer=None, scale=None))
    with pytest.raises(IndexerBlockLengthMismatch, match="Prefill 16 .*Decode 32"):
        validate_layer("L", layer(), layer(indexer=(0, 32, 8)))
    with pytest.raises(ScalePresenceMismatch, match="Prefill absent, Decode present"):
        validate_layer("L", layer(scale=None), layer())
    with pytest.raises(ScaleLayoutMismatch, match="Prefill 4 .*Decode 8"):
        validate_layer("L", layer(), layer(scale=(0, 4, 8, 2)))
    validate_layer("L", layer(indexer=None, scale=None), layer(indexer=None, scale=None))


def test_build_refuses_a_mismatched_layer():
    with pytest.raises(ScaleLayoutMismatch):
        build_layer_plan(layer(), layer(scale=(0, 8, 8)), [], src_regions=RegionSet(), dst_regions=RegionSet())


# --------------------------------------------------------------------------- regions


def naive_inside(pairs, addr, length):
    """Walk the original (unmerged) regions byte range by byte range."""
    if length <= 0 or addr < 0:
        return False
    pos, end = addr, addr + length
    while pos < end:
        nxt = max((a + n for a, n in pairs if a <= pos < a + n), default=None)
        if nxt is None:
            return False
        pos = nxt
    return True


def test_regionset_merges_and_rejects_straddling():
    rs = RegionSet([(100, 50), Region(150, 10), (120, 5), (300, 10)])
    assert list(rs) == [(100, 60), (300, 10)] and len(rs) == 2 and rs.nbytes == 70
    addrs = np.array([100, 159, 100, 159, 155, 300, 309, 310, 99, 0, 100, 100])
    lens = np.array([60, 1, 61, 2, 150, 10, 1, 1, 2, 1, 0, -1])
    exp = [True, True, False, False, False, True, True, False, False, False, False, False]
    assert rs.contains(addrs, lens).tolist() == exp
    assert rs.contains(np.array([100, 150]), 10).tolist() == [True, True]
    assert rs.covers(100, 60) and not rs.covers(155, 150) and not rs.covers(100, 0)
    with pytest.raises(RegionError, match=r"remote main\[0\] of request 'r7': range \[0x9b, 0x131\)"):
        rs.check(addrs[4:6], lens[4:6], "remote main[0] of request 'r7'")
    rs.check(addrs[:2], lens[:2], "fine")
    assert RegionSet([(1, 2)]) == RegionSet([(1, 1), (2, 1)]) and hash(RegionSet()) == hash(RegionSet())
    assert "0x64" in repr(rs)


def test_regionset_rejects_bad_regions_and_empty_set_contains_nothing():
    for bad in [(-1, 4), (0, 0), (0, -3), (2**63 - 2, 4)]:
        with pytest.raises(ValueError):
            RegionSet([bad])
    assert RegionSet().contains(np.array([0, 5]), np.array([1, 1])).tolist() == [False, False]
    with pytest.raises(RegionError):
        RegionSet().check(np.array([0]), np.array([1]), "x")


@given(
    st.lists(st.tuples(st.integers(0, 200), st.integers(1, 40)), max_size=6),
    st.lists(st.tuples(st.integers(-5, 260), st.integers(-2, 60)), max_size=30),
)
def test_regionset_matches_naive(pairs, queries):
    rs = RegionSet(pairs)
    addrs = np.array([a for a, _ in queries], dtype=np.int64)
    lens = np.array([n for _, n in queries], dtype=np.int64)
    got = rs.contains(addrs, lens).tolist()
    assert got == [naive_inside(pairs, a, n) for a, n in queries]
    merged = list(rs)
    assert all(a + n < b for (a, n), (b, _) in zip(merged, merged[1:]))  # disjoint, not adjacent


# --------------------------------------------------------------------------- plans: reference


def reference_plan(src, dst, reads, src_pairs, dst_pairs):
    """Block by block, in Python: returns (failed {id: error type}, [(tensor, local, remote, len)])."""
    named = list(zip(src.named_tensors(), dst.tensors()))
    n_main = len(src.main)
    failed = {}
    for r in reads:
        groups = [("main", r.src_main, r.dst_main, [t for t in range(n_main)])]
        if src.indexer is not None:
            groups.append(("indexer", r.src_indexer, r.dst_indexer, list(range(n_main, len(named)))))
        err = None
        for _, s_ids, d_ids, ts in groups:
            if len(s_ids) != len(d_ids):
                err = BlockRangeError
            for s, d in zip(s_ids.tolist(), d_ids.tolist()):
                for t in ts:
                    if not (0 <= s < named[t][0][1].num_blocks and 0 <= d < named[t][1].num_blocks):
                        err = BlockRangeError
        if err is None:
            for _, s_ids, d_ids, ts in groups:
                for s, d in zip(s_ids.tolist(), d_ids.tolist()):
                    for t in ts:
                        st_, dt_ = named[t][0][1], named[t][1]
                        if not naive_inside(src_pairs, st_.base_addr + s * st_.stride, st_.stride):
                            err = RegionError
                        if not naive_inside(dst_pairs, dt_.base_addr + d * dt_.stride, dt_.stride):
                            err = RegionError
        if err is not None:
            failed[r.ext_req_id] = err
    descs = []
    for t, ((_, st_), dt_) in enumerate(named):
        for r in reads:
            if r.ext_req_id in failed:
                continue
            s_ids, d_ids = (r.src_main, r.dst_main) if t < n_main else (r.src_indexer, r.dst_indexer)
            for s, d in zip(s_ids.tolist(), d_ids.tolist()):
                descs.append((t, dt_.base_addr + d * dt_.stride, st_.base_addr + s * st_.stride, st_.stride))
    return failed, descs


def coalesce_reference(descs):
    out = []
    for t, loc, rem, n in descs:
        if out and out[-1][0] == t and out[-1][1] + out[-1][3] == loc and out[-1][2] + out[-1][3] == rem:
            out[-1][3] += n
        else:
            out.append([t, loc, rem, n])
    return [(loc, rem, n) for _, loc, rem, n in out]


def assert_plan_is_merge_of(plan: LayerPlan, descs):
    """Each plan descriptor is a run of consecutive reference descriptors, contiguous on both sides."""
    i = 0
    for loc, rem, n in zip(plan.local.tolist(), plan.remote.tolist(), plan.lengths.tolist()):
        acc = 0
        while acc < n:
            _, rl, rr, rn = descs[i]
            assert (rl, rr) == (loc + acc, rem + acc)
            acc += rn
            i += 1
        assert acc == n
    assert i == len(descs)


@st.composite
def tensor_pair(draw, stride_choices=(1, 3, 8, 64)):
    block_len = draw(st.sampled_from(stride_choices))
    s_scale, d_scale = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2]))
    stride = block_len * s_scale
    s = T(draw(st.integers(0, 1 << 20)), block_len, draw(st.integers(0, 16)), s_scale)
    d_len = stride // d_scale if stride % d_scale == 0 else stride
    d = T(draw(st.integers(0, 1 << 20)), d_len, draw(st.integers(0, 16)), stride // d_len)
    return s, d


@st.composite
def regions_for(draw, tensors):
    pairs = []
    for t in tensors:
        mode = draw(st.sampled_from(["full"] * 4 + ["split", "partial", "none"]))
        if t.nbytes == 0 or mode == "none":
            continue
        if mode == "full":
            pairs.append((t.base_addr, t.nbytes))
        elif mode == "split":  # two adjacent registrations: merged, so straddling blocks are fine
            cut = draw(st.integers(1, t.nbytes)) if t.nbytes > 1 else 1
            pairs += [(t.base_addr, cut)] + ([(t.base_addr + cut, t.nbytes - cut)] if cut < t.nbytes else [])
        else:
            lo = draw(st.integers(0, t.nbytes - 1))
            hi = draw(st.integers(lo + 1, t.nbytes))
            pairs.append((t.base_addr + lo, hi - lo))
    return pairs


@st.composite
def id_list(draw, limit, size):
    mode = draw(st.sampled_from(["run", "run", "valid", "valid", "any"]))
    if mode == "run" and limit >= size:  # a contiguous run (coalescing material)
        start = draw(st.integers(0, limit - size))
        return list(range(start, start + size))
    if mode != "any" and limit > 0:
        return draw(st.lists(st.integers(0, limit - 1), min_size=size, max_size=size))
    return draw(st.lists(st.integers(-2, limit + 1), min_size=size, max_size=size))


@st.composite
def plan_case(draw):
    n_main = draw(st.integers(1, 3))
    mains = [draw(tensor_pair()) for _ in range(n_main)]
    has_indexer = draw(st.booleans())
    indexer = draw(tensor_pair()) if has_indexer else None
    scale = draw(tensor_pair(stride_choices=(1, 2, 4))) if has_indexer and draw(st.booleans()) else None
    src = LayerLayout(tuple(s for s, _ in mains), indexer and indexer[0], scale and scale[0])
    dst = LayerLayout(tuple(d for _, d in mains), indexer and indexer[1], scale and scale[1])
    src_pairs = draw(regions_for(src.tensors()))
    dst_pairs = draw(regions_for(dst.tensors()))
    reads = []
    for i in range(draw(st.integers(0, 5))):
        k = draw(st.integers(0, 8))
        m = draw(st.integers(0, 5))
        extra = draw(st.sampled_from([0] * 8 + [1]))  # sometimes lengths that disagree
        reads.append(
            RequestRead(
                f"r{i}",
                draw(id_list(min(t.num_blocks for t in src.main), k)),
                draw(id_list(min(t.num_blocks for t in dst.main), k + extra)),
                draw(id_list(src.indexer.num_blocks if src.indexer else 4, m)),
                draw(id_list(dst.indexer.num_blocks if dst.indexer else 4, m)),
            )
        )
    return src, dst, reads, src_pairs, dst_pairs


@settings(max_examples=200, deadline=None)
@given(plan_case())
def test_plan_matches_block_by_block_reference(case):
    src, dst, reads, src_pairs, dst_pairs = case
    plan = build_layer_plan(
        src, dst, reads, src_regions=RegionSet(src_pairs), dst_regions=RegionSet(dst_pairs), layer_name="L"
    )
    failed, descs = reference_plan(src, dst, reads, src_pairs, dst_pairs)
    assert {k: type(v) for k, v in plan.failed.items()} == failed
    assert plan.requests == tuple(r.ext_req_id for r in reads if r.ext_req_id not in failed)
    # exact maximal coalescing within each tensor, in tensor-major order
    expect = coalesce_reference(descs)
    assert list(zip(plan.local.tolist(), plan.remote.tolist(), plan.lengths.tolist())) == expect
    assert_plan_is_merge_of(plan, descs)
    assert plan.nbytes == sum(n for *_, n in descs) == int(plan.lengths.sum())
    kept = [r for r in reads if r.ext_req_id not in failed]
    assert plan.blocks == sum(r.src_main.size + (r.src_indexer.size if src.indexer else 0) for r in kept)
    assert all(arr.dtype == np.int64 for arr in (plan.local, plan.remote, plan.lengths))
    # memory safety: everything in the plan is inside the registered regions
    assert RegionSet(src_pairs).contains(plan.remote, plan.lengths).all()
    assert RegionSet(dst_pairs).contains(plan.local, plan.lengths).all()
    # a builder that reuses its arrays across examples of every size gives the same plan
    reused = SHARED_BUILDER.build(
        src, dst, reads, src_regions=RegionSet(src_pairs), dst_regions=RegionSet(dst_pairs), layer_name="L"
    )
    for a, b in zip((plan.local, plan.remote, plan.lengths), (reused.local, reused.remote, reused.lengths)):
        assert np.array_equal(a, b) and not b.flags.writeable
    assert (reused.requests, reused.blocks, reused.nbytes) == (plan.requests, plan.blocks, plan.nbytes)
    assert {k: str(v) for k, v in reused.failed.items()} == {k: str(v) for k, v in plan.failed.items()}


SHARED_BUILDER = PlanBuilder()


# --------------------------------------------------------------------------- plans: examples


def full_regions(lay):
    return RegionSet(lay.regions())


SRC = layer()
DST = layer(main=((0x100000, 64, 32), (0x200000, 64, 32)), indexer=(0x300000, 16, 8), scale=(0x400000, 4, 8))


def build(reads, src=SRC, dst=DST, src_regions=None, dst_regions=None):
    return build_layer_plan(
        src,
        dst,
        reads,
        src_regions=src_regions or full_regions(src),
        dst_regions=dst_regions or full_regions(dst),
        layer_name="L7",
    )


def test_empty_input_and_zero_block_requests():
    plan = build([])
    assert len(plan) == 0 and plan.requests == () and plan.failed == {} and plan.blocks == plan.nbytes == 0
    assert plan.local.dtype == np.int64
    plan = build([RequestRead("a", [], []), RequestRead("b", [], [], [], [])])
    assert plan.requests == ("a", "b") and len(plan) == 0 and plan.failed == {}


def test_builder_plans_are_read_only_views_valid_until_the_next_build():
    builder = PlanBuilder()
    kw = dict(src_regions=full_regions(SRC), dst_regions=full_regions(DST))
    first = builder.build(SRC, DST, [RequestRead("a", [0, 2], [0, 2])], **kw)
    expect = first.remote.copy()
    with pytest.raises(ValueError):
        first.remote[0] = 0
    scattered = [RequestRead("b", np.arange(0, 16, 2), np.arange(0, 32, 4))]
    big = builder.build(SRC, DST, scattered, **kw)
    assert len(big) == 16 and np.array_equal(big.remote, build(scattered).remote)
    again = builder.build(SRC, DST, [RequestRead("a", [0, 2], [0, 2])], **kw)
    assert np.array_equal(again.remote, expect)


def test_contiguous_ids_become_one_descriptor_per_tensor():
    plan = build([RequestRead("a", [2, 3, 4], [10, 11, 12], [0, 1], [5, 6])])
    assert plan.lengths.tolist() == [192, 192, 32, 8]
    assert plan.remote.tolist() == [0x1000 + 128, 0x9000 + 128, 0x20000, 0x30000]
    assert plan.local.tolist() == [0x100000 + 640, 0x200000 + 640, 0x300000 + 80, 0x400000 + 20]
    assert plan.blocks == 5 and plan.nbytes == 2 * 192 + 32 + 8


def test_contiguous_on_one_side_only_is_not_merged():
    plan = build([RequestRead("a", [2, 3, 5], [10, 12, 13])], src=layer(indexer=None, scale=None),
                 dst=layer(main=((0x100000, 64, 32), (0x200000, 64, 32)), indexer=None, scale=None))
    assert plan.lengths.tolist() == [64, 64, 64] * 2


def test_a_bad_request_fails_alone():
    good = [RequestRead("a", [0, 1], [0, 1], [0], [0]), RequestRead("c", [5, 9], [7, 3], [2, 3], [4, 5])]
    alone = build(good)
    cases = {
        "src main range": (RequestRead("b", [16], [0]), BlockRangeError, r"source \(Prefill\) main block id 16"),
        "dst main range": (RequestRead("b", [0], [32]), BlockRangeError, r"destination \(Decode\) main .*id 32"),
        "negative": (RequestRead("b", [-1], [0]), BlockRangeError, "-1"),
        "indexer range": (RequestRead("b", [0], [0], [8], [0]), BlockRangeError, "indexer block id 8"),
        "lengths": (RequestRead("b", [0, 1], [0]), BlockRangeError, "2 source main block ids but 1"),
        "indexer lengths": (RequestRead("b", [], [], [0], []), BlockRangeError, "1 source indexer"),
    }
    for name, (bad, err, match) in cases.items():
        plan = build([good[0], bad, good[1]])
        assert plan.requests == ("a", "c"), name
        assert type(plan.failed["b"]) is err, name
        assert plan.failed["b"].args[0].startswith("layer 'L7': request 'b'")
        assert re.search(match, str(plan.failed["b"])), (name, str(plan.failed["b"]))
        for a, b in zip((plan.local, plan.remote, plan.lengths), (alone.local, alone.remote, alone.lengths)):
            assert np.array_equal(a, b), name


def test_region_failures_name_the_tensor_side_and_range():
    # Prefill registered only blocks 0..7 of main[1]; Decode only blocks 0..3 of the scale
    src_regions = RegionSet([Region(0x1000, 1024), Region(0x9000, 512), Region(0x20000, 128), Region(0x30000, 32)])
    dst_regions = RegionSet([(0x100000, 2048), (0x200000, 2048), (0x300000, 128), (0x400000, 16)])
    reads = [
        RequestRead("ok", [0, 7], [0, 1], [1], [3]),
        RequestRead("r7", [3, 8], [4, 5]),
        RequestRead("r8", [1], [9], [0], [4]),
    ]
    plan = build(reads, src_regions=src_regions, dst_regions=dst_regions)
    assert plan.requests == ("ok",)
    assert isinstance(plan.failed["r7"], RegionError) and isinstance(plan.failed["r8"], RegionError)
    assert "remote main[1] of request 'r7': range [0x9200, 0x9240)" in str(plan.failed["r7"])
    assert "local scale of request 'r8': range [0x400010, 0x400014)" in str(plan.failed["r8"])


def test_duplicate_request_id_fails_as_a_whole():
    plan = build([RequestRead("a", [0], [0]), RequestRead("b", [1], [1]), RequestRead("a", [99], [1])])
    assert plan.requests == ("b",) and set(plan.failed) == {"a"}
    assert plan.remote.tolist() == [0x1000 + 64, 0x9000 + 64]


def test_indexer_ids_are_ignored_on_a_main_only_layer():
    src, dst = layer(indexer=None, scale=None), layer(indexer=None, scale=None)
    plan = build([RequestRead("a", [0], [1], [99, 100], [3])], src=src, dst=dst)
    assert plan.requests == ("a",) and plan.blocks == 1 and len(plan) == 2


def test_contiguity_across_requests_merges():
    plan = build([RequestRead("a", [0, 1], [4, 5]), RequestRead("b", [2, 3], [6, 7])],
                 src=layer(indexer=None, scale=None), dst=layer(indexer=None, scale=None))
    assert plan.lengths.tolist() == [256, 256] and plan.requests == ("a", "b")


# --------------------------------------------------------------------------- real memory


def execute(plan: LayerPlan) -> None:
    for loc, rem, n in zip(plan.local.tolist(), plan.remote.tolist(), plan.lengths.tolist()):
        ctypes.memmove(loc, rem, n)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_plan_moves_the_selected_blocks_in_real_memory(data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    strides = {"main[0]": 48, "main[1]": 16, "indexer": 24, "scale": 4}
    nb_src, nb_dst, nb_isrc, nb_idst = 40, 64, 12, 20
    src_buf = {k: rng.integers(1, 256, size=(nb_isrc if k in ("indexer", "scale") else nb_src) * s, dtype=np.uint8)
               for k, s in strides.items()}
    dst_buf = {k: np.zeros((nb_idst if k in ("indexer", "scale") else nb_dst) * s, dtype=np.uint8)
               for k, s in strides.items()}

    def lay(bufs, nb, nbi):
        return LayerLayout(
            (T(bufs["main[0]"].ctypes.data, 24, nb, 2), T(bufs["main[1]"].ctypes.data, 16, nb)),
            T(bufs["indexer"].ctypes.data, 24, nbi),
            T(bufs["scale"].ctypes.data, 4, nbi),
        )

    src, dst = lay(src_buf, nb_src, nb_isrc), lay(dst_buf, nb_dst, nb_idst)
    dst_main_free, dst_idx_free = rng.permutation(nb_dst), rng.permutation(nb_idst)
    reads, expect = [], []
    for i in range(data.draw(st.integers(0, 4))):
        k = data.draw(st.integers(0, 12))
        m = data.draw(st.integers(0, 4))
        if data.draw(st.booleans()):
            s_main = rng.permutation(nb_src)[:k]
        else:
            s_main = np.arange(k) + rng.integers(0, nb_src - k)
        d_main, dst_main_free = dst_main_free[:k], dst_main_free[k:]
        if data.draw(st.booleans()):
            d_main = np.sort(d_main)
        s_idx = rng.permutation(nb_isrc)[:m]
        d_idx, dst_idx_free = dst_idx_free[:m], dst_idx_free[m:]
        bad = data.draw(st.sampled_from([False] * 4 + [True]))
        if bad and k:
            s_main = s_main.copy()
            s_main[-1] = nb_src  # out of range: the request must leave no byte behind
        reads.append(RequestRead(f"r{i}", s_main, d_main, s_idx, d_idx))
        expect.append((bad and k > 0, s_main, d_main, s_idx, d_idx))

    plan = build_layer_plan(
        src, dst, reads, src_regions=RegionSet(src.regions()), dst_regions=RegionSet(dst.regions())
    )
    execute(plan)

    written = {k: np.zeros(len(v) // strides[k], dtype=bool) for k, v in dst_buf.items()}
    for bad, s_main, d_main, s_idx, d_idx in expect:
        if bad:
            continue
        for k in strides:
            s_ids, d_ids = (s_idx, d_idx) if k in ("indexer", "scale") else (s_main, d_main)
            s_rows = src_buf[k].reshape(-1, strides[k])
            d_rows = dst_buf[k].reshape(-1, strides[k])
            assert np.array_equal(d_rows[d_ids], s_rows[s_ids])
            written[k][d_ids] = True
    for k, buf in dst_buf.items():  # nothing else was touched
        assert not buf.reshape(-1, strides[k])[~written[k]].any()


@given(
    st.lists(st.tuples(st.integers(0, 300), st.integers(1, 60)), max_size=6),
    st.integers(0, 200),
    st.integers(1, 24),
    st.integers(0, 12),
)
def test_block_intervals_match_per_block_lookups(pairs, base, stride, num_blocks):
    rs = RegionSet(pairs)
    inside = [b for b in range(num_blocks) if naive_inside(pairs, base + b * stride, stride)]
    intervals = rs.block_intervals(base, stride, num_blocks)
    assert [b for lo, hi in intervals for b in range(lo, hi)] == inside
    assert all(hi1 < lo2 for (_, hi1), (lo2, _) in zip(intervals, intervals[1:]))  # never adjacent

