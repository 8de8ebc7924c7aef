"""Descriptor planning: block ids to coalesced, region-checked reads (rd2h.layout.planning)."""

from __future__ import annotations

import ctypes
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from layout_cases import T, layer, naive_inside

from rd2h.errors import BlockRangeError, RegionError, ScaleLayoutMismatch
from rd2h.layout.layers import LayerLayout
from rd2h.layout.planning import LayerPlan, PlanBuilder, RequestRead, block_addresses, build_layer_plan
from rd2h.layout.regions import Region, RegionSet


def test_block_addresses():
    t = T(0x1000, 64, 10, 2)
    assert block_addresses(t, [0, 3, 9]).tolist() == [0x1000, 0x1000 + 3 * 128, 0x1000 + 9 * 128]
    padded = T(0x1000, 64, 10, 2, block_stride=200)
    assert block_addresses(padded, [0, 3, 9]).tolist() == [0x1000, 0x1000 + 3 * 200, 0x1000 + 9 * 200]
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


def test_build_refuses_a_mismatched_layer():
    with pytest.raises(ScaleLayoutMismatch):
        build_layer_plan(layer(), layer(scale=(0, 8, 8)), [], src_regions=RegionSet(), dst_regions=RegionSet())


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
                        if not naive_inside(src_pairs, st_.base_addr + s * st_.stride, st_.block_bytes):
                            err = RegionError
                        if not naive_inside(dst_pairs, dt_.base_addr + d * dt_.stride, dt_.block_bytes):
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
                descs.append((t, dt_.base_addr + d * dt_.stride, st_.base_addr + s * st_.stride, st_.block_bytes))
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


def padding(draw, block_bytes):
    """A block stride for a tensor: dense (None) mostly, else padded after each block."""
    pad = draw(st.sampled_from([0, 0, 0, 1, 8, block_bytes]))
    return block_bytes + pad if pad else None


@st.composite
def tensor_pair(draw, stride_choices=(1, 3, 8, 64)):
    block_len = draw(st.sampled_from(stride_choices))
    s_scale, d_scale = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2]))
    block_bytes = block_len * s_scale
    s = T(draw(st.integers(0, 1 << 20)), block_len, draw(st.integers(0, 16)), s_scale,
          block_stride=padding(draw, block_bytes))
    d_len = block_bytes // d_scale if block_bytes % d_scale == 0 else block_bytes
    d = T(draw(st.integers(0, 1 << 20)), d_len, draw(st.integers(0, 16)), block_bytes // d_len,
          block_stride=padding(draw, block_bytes))
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


def test_padded_blocks_are_read_one_by_one_at_their_stride():
    # Prefill pages padded to 96 bytes per block id (64 of data); Decode dense
    src = layer(main=((0x1000, 64, 16, 1, "cpu", 96),), indexer=None, scale=None)
    dst = layer(main=((0x100000, 64, 32),), indexer=None, scale=None)
    plan = build([RequestRead("a", [2, 3, 4], [10, 11, 12])], src=src, dst=dst)
    assert plan.remote.tolist() == [0x1000 + 2 * 96, 0x1000 + 3 * 96, 0x1000 + 4 * 96]
    assert plan.local.tolist() == [0x100000 + 640, 0x100000 + 704, 0x100000 + 768]
    assert plan.lengths.tolist() == [64, 64, 64] and plan.nbytes == 192
    # the other way round, and both padded: still one descriptor per block
    for s, d in ((dst, src), (src, layer(main=((0x100000, 64, 32, 1, "cpu", 128),), indexer=None, scale=None))):
        assert build([RequestRead("a", [2, 3, 4], [2, 3, 4])], src=s, dst=d).lengths.tolist() == [64, 64, 64]


def test_a_padded_block_needs_only_its_own_bytes_registered():
    src = layer(main=((0x1000, 64, 4, 1, "cpu", 256),), indexer=None, scale=None)
    dst = layer(main=((0x100000, 64, 4),), indexer=None, scale=None)
    only_block_3 = RegionSet([(0x1000 + 3 * 256, 64)])
    plan = build([RequestRead("a", [3], [0]), RequestRead("b", [2], [1])], src=src, dst=dst, src_regions=only_block_3)
    assert plan.requests == ("a",) and type(plan.failed["b"]) is RegionError
    assert "range [0x1200, 0x1240) (64 bytes)" in str(plan.failed["b"])


# --------------------------------------------------------------------------- real memory


def execute(plan: LayerPlan) -> None:
    for loc, rem, n in zip(plan.local.tolist(), plan.remote.tolist(), plan.lengths.tolist()):
        ctypes.memmove(loc, rem, n)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_plan_moves_the_selected_blocks_in_real_memory(data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    block_bytes = {"main[0]": 48, "main[1]": 16, "indexer": 24, "scale": 4}
    # padding after each block (block_stride above the block's bytes), drawn per side and tensor
    src_pad = {k: data.draw(st.sampled_from([0, 0, 8, 40])) for k in block_bytes}
    dst_pad = {k: data.draw(st.sampled_from([0, 0, 8, 40])) for k in block_bytes}
    nb_src, nb_dst, nb_isrc, nb_idst = 40, 64, 12, 20

    def blocks(k, nb, nbi):
        return nbi if k in ("indexer", "scale") else nb

    src_buf = {k: rng.integers(1, 256, size=blocks(k, nb_src, nb_isrc) * (n + src_pad[k]), dtype=np.uint8)
               for k, n in block_bytes.items()}
    dst_buf = {k: np.zeros(blocks(k, nb_dst, nb_idst) * (n + dst_pad[k]), dtype=np.uint8)
               for k, n in block_bytes.items()}

    def lay(bufs, pad, nb, nbi):
        def t(k, block_len, num_blocks, scale=1):
            stride = block_bytes[k] + pad[k] if pad[k] else None
            return T(bufs[k].ctypes.data, block_len, num_blocks, scale, block_stride=stride)

        return LayerLayout((t("main[0]", 24, nb, 2), t("main[1]", 16, nb)), t("indexer", 24, nbi), t("scale", 4, nbi))

    src, dst = lay(src_buf, src_pad, nb_src, nb_isrc), lay(dst_buf, dst_pad, nb_dst, nb_idst)
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

    def rows(bufs, pad, k):  # one row per block id, padding cut off
        return bufs[k].reshape(-1, block_bytes[k] + pad[k])[:, : block_bytes[k]]

    written = {k: np.zeros(len(rows(dst_buf, dst_pad, k)), dtype=bool) for k in dst_buf}
    for bad, s_main, d_main, s_idx, d_idx in expect:
        if bad:
            continue
        for k in block_bytes:
            s_ids, d_ids = (s_idx, d_idx) if k in ("indexer", "scale") else (s_main, d_main)
            assert np.array_equal(rows(dst_buf, dst_pad, k)[d_ids], rows(src_buf, src_pad, k)[s_ids])
            written[k][d_ids] = True
    for k, buf in dst_buf.items():  # nothing else was touched, padding included
        padded = buf.reshape(-1, block_bytes[k] + dst_pad[k])
        assert not padded[~written[k]].any() and not padded[:, block_bytes[k] :].any()
