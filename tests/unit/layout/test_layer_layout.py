"""Layouts, their validation and region checks (rd2h.layout.layers, rd2h.layout.regions)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from layout_cases import T, layer, naive_inside

from rd2h.errors import (
    IndexerBlockLengthMismatch,
    IndexerPresenceMismatch,
    LayoutError,
    LayoutTagMismatch,
    MainBlockLengthMismatch,
    MainTensorCountMismatch,
    RegionError,
    ScaleLayoutMismatch,
    ScalePresenceMismatch,
)
from rd2h.layout.layers import LayerLayout, LayoutTag, TensorLayout, validate_layer
from rd2h.layout.regions import Region, RegionSet

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


def test_block_stride_spaces_blocks_but_each_moves_its_own_bytes():
    t = T(0x1000, 64, 4, 2, block_stride=200)
    assert (t.block_bytes, t.stride, t.dense) == (128, 200, False)
    assert t.nbytes == 3 * 200 + 128  # up to the last block's end: no padding after it
    assert LayerLayout((t,)).regions() == (Region(0x1000, 728),)
    dense = T(0x1000, 64, 4, 2)
    assert (dense.stride, dense.nbytes, dense.dense) == (128, 512, True)
    assert T(0x1000, 64, 4, 2, block_stride=np.int64(128)) == dense  # dense, stated: stored as None
    assert T(0x1000, 64, 4, 2, block_stride=200) != t.__class__(0x1000, 64, 4, 2, block_stride=256)
    assert T(0, 64, 0, block_stride=100).nbytes == 0
    with pytest.raises(ValueError, match="overlap"):
        T(0, 64, 4, 2, block_stride=127)
    with pytest.raises(ValueError, match="int64"):
        T(0, 8, 3, block_stride=2**62)


def test_layout_tag_fields():
    tag = LayoutTag("int8", [np.int64(2), 3], np.int32(16))
    assert tag.block_shape == (2, 3) and type(tag.block_tokens) is int and tag.name == ""
    for bad in (dict(block_tokens=-1), dict(block_shape=(2, -3))):
        with pytest.raises(ValueError):
            dataclasses.replace(tag, **bad)
    assert layer().tag is None and dataclasses.replace(layer(), tag=tag).tag == tag


# --------------------------------------------------------------------------- validation

ORDER = [
    ("count", MainTensorCountMismatch),
    ("main_len", MainBlockLengthMismatch),
    ("indexer_presence", IndexerPresenceMismatch),
    ("indexer_len", IndexerBlockLengthMismatch),
    ("scale_presence", ScalePresenceMismatch),
    ("scale_len", ScaleLayoutMismatch),
    ("tag", LayoutTagMismatch),
]
TAG = LayoutTag("bfloat16", (8, 64, 256), 64, "LBHNC")


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
    if what == "tag":
        return dataclasses.replace(lay, tag=dataclasses.replace(TAG, dtype="float16"))
    raise AssertionError(what)


@given(
    st.sets(st.sampled_from([w for w, _ in ORDER])),
    st.integers(0, 1),
    st.booleans(),
    st.booleans(),
)
def test_validation_reports_first_mismatch_in_spec_order(mutations, tensor, on_decode, harmless):
    src = dst = dataclasses.replace(layer(), tag=TAG)
    if harmless:  # other base addresses, block counts, strides; the same bytes per block split otherwise
        dst = LayerLayout(
            tuple(T(0x70000 + i * 0x8000, 32, 5, 2, block_stride=96) for i in range(2)),
            T(0x90000, 8, 3, 2),
            T(0x99000, 2, 3, 2, block_stride=64),
            tag=TAG,
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


def test_validation_compares_bytes_per_block_not_strides():
    padded = layer(main=((0x1000, 64, 16, 1, "cpu", 96), (0x9000, 32, 16, 2, "cpu", 4096)))
    validate_layer("L", padded, layer())  # a padded Prefill page feeds a dense Decode page
    validate_layer("L", layer(), padded)
    same_stride_fewer_bytes = layer(main=((0x1000, 32, 16, 1, "cpu", 64), (0x9000, 64, 16)))
    with pytest.raises(MainBlockLengthMismatch, match=r"main tensor 0 .*Prefill 64 .*Decode 32"):
        validate_layer("L", layer(), same_stride_fewer_bytes)


@pytest.mark.parametrize(
    "field, value", [("dtype", "float16"), ("block_shape", (8, 32, 512)), ("block_tokens", 32), ("name", "BLHNC")]
)
def test_a_tag_mismatch_names_the_layer_the_field_and_both_values(field, value):
    src = dataclasses.replace(layer(), tag=TAG)
    dst = dataclasses.replace(layer(), tag=dataclasses.replace(TAG, **{field: value}))
    with pytest.raises(LayoutTagMismatch) as info:
        validate_layer("model.layers.5", src, dst)
    msg = str(info.value)
    assert "'model.layers.5'" in msg and field in msg
    assert f"Prefill {getattr(TAG, field)!r}, Decode {value!r}" in msg


def test_tags_are_compared_only_where_both_sides_state_them():
    tagged = dataclasses.replace(layer(), tag=TAG)
    validate_layer("L", tagged, layer())
    validate_layer("L", layer(), tagged)
    unstated = dataclasses.replace(layer(), tag=dataclasses.replace(TAG, block_tokens=0, name=""))
    validate_layer("L", tagged, unstated)
    validate_layer("L", unstated, tagged)


def test_a_byte_mismatch_keeps_its_own_error_when_the_tags_differ_too():
    src = dataclasses.replace(layer(), tag=TAG)
    dst = dataclasses.replace(layer(indexer=(0x20000, 8, 8)), tag=dataclasses.replace(TAG, dtype="float16"))
    with pytest.raises(IndexerBlockLengthMismatch):
        validate_layer("L", src, dst)


# --------------------------------------------------------------------------- regions


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


@given(
    st.lists(st.tuples(st.integers(0, 300), st.integers(1, 60)), max_size=6),
    st.integers(0, 200),
    st.integers(1, 24),
    st.sampled_from([0, 0, 1, 7, 30]),
    st.integers(0, 12),
)
def test_block_intervals_match_per_block_lookups(pairs, base, length, pad, num_blocks):
    rs = RegionSet(pairs)
    stride = length + pad
    inside = [b for b in range(num_blocks) if naive_inside(pairs, base + b * stride, length)]
    intervals = rs.block_intervals(base, stride, num_blocks, length if pad else None)  # None: dense
    assert [b for lo, hi in intervals for b in range(lo, hi)] == inside
    # sorted and disjoint; dense blocks cannot straddle the gap between two merged ranges, so
    # their intervals are never adjacent (a padded block's padding can hold the gap)
    assert all(hi1 < lo2 or (pad and hi1 == lo2) for (_, hi1), (lo2, _) in zip(intervals, intervals[1:]))
