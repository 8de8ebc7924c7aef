"""KV heads over TP ranks (rd2h.layout.heads): vLLM's split, and Decode's blocks assembled
from the head ranges of the Prefill ranks that hold them, byte for byte, over every Prefill/
Decode TP pair vLLM can run a model at (replicated heads included)."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rd2h.decode.rank_reads import Destinations, MainSplit, plan_reads
from rd2h.errors import LayoutError, TopologyError
from rd2h.layout.heads import HeadViews, check_heads, head_slice, kv_heads_of, narrow_heads, reads_heads
from rd2h.layout.layers import HeadSpan, LayerLayout, LayoutTag, TensorLayout
from rd2h.layout.planning import build_layer_plan
from rd2h.layout.regions import RegionSet
from rd2h.layout.topology import Topology
from rd2h.wire.protocol import ReadReadyBatch, ReadRequest


def _valid(total: int, tp: int) -> bool:
    return total % tp == 0 or tp % total == 0


CASES = [
    (total, p, d)
    for total in (1, 2, 4, 8)
    for p in (1, 2, 4, 8)
    for d in (1, 2, 4, 8)
    if _valid(total, p) and _valid(total, d)
]


@pytest.mark.parametrize("total,tp", [(t, tp) for t in (1, 2, 3, 4, 6, 8) for tp in (1, 2, 3, 4, 6, 8) if _valid(t, tp)])
def test_kv_heads_of_is_vllms_split(total: int, tp: int) -> None:
    """Each head on max(1, tp // total) ranks, each rank max(1, total // tp) consecutive heads,
    and rank r's heads are vLLM's QKVParallelLinear shard ``r // replicas``."""
    spans = [kv_heads_of(total, tp, r) for r in range(tp)]
    replicas = max(1, tp // total)
    assert all(s.count == max(1, total // tp) for s in spans)
    held = [h for s in spans for h in range(s.first, s.end)]
    assert sorted(set(held)) == list(range(total)) and all(held.count(h) == replicas for h in range(total))
    assert [s.first for s in spans] == [(r // replicas) * spans[0].count for r in range(tp)]


def test_kv_heads_per_rank_agree_with_vllms_model_config() -> None:
    model_config = pytest.importorskip("vllm.config.model")
    for total, tp in [(2, 1), (2, 2), (2, 4), (8, 2), (1, 8)]:
        fake = SimpleNamespace(use_mla=False, model_arch_config=SimpleNamespace(total_num_kv_heads=total))
        ours = kv_heads_of(total, tp, 0).count
        assert model_config.ModelConfig.get_num_kv_heads(fake, SimpleNamespace(tensor_parallel_size=tp)) == ours


def test_heads_that_do_not_split_are_refused_with_the_counts() -> None:
    with pytest.raises(TopologyError, match="a model of 3 KV heads cannot be split over Decode TP 2"):
        check_heads(3, 2, "Decode")
    with pytest.raises(TopologyError, match="rank 2 is out of range for TP 2"):
        kv_heads_of(2, 2, 2)


HEAD_BYTES = 16  # a head of a block: block_size x 2 * head_size elements, as bytes here
BLOCKS = 6


def _cache(heads: int, fill: int = 0) -> np.ndarray:
    return np.full((BLOCKS, heads, HEAD_BYTES), fill, dtype=np.uint8)


def _layout(cache: np.ndarray, span: HeadSpan | None = None) -> LayerLayout:
    heads = cache.shape[1]
    tensor = TensorLayout(cache.ctypes.data, heads * HEAD_BYTES, BLOCKS)
    return LayerLayout((tensor,), tag=LayoutTag("uint8", (heads, HEAD_BYTES), 32, "vllm"), heads=span)


def _run(plan) -> None:  # type: ignore[no-untyped-def]
    for local, remote, length in zip(plan.local.tolist(), plan.remote.tolist(), plan.lengths.tolist()):
        ctypes.memmove(local, remote, length)


@settings(max_examples=len(CASES) * 2, deadline=None)
@given(st.sampled_from(CASES), st.permutations(range(BLOCKS)))
def test_every_decode_block_gets_each_of_its_heads_once_from_a_rank_that_holds_it(
    case: tuple[int, int, int], dst_order: list[int]
) -> None:
    total, p_tp, d_tp = case
    topo = Topology(p_tp, d_tp)
    # Prefill rank p's block b, head slot k holds global head h: every byte is 1 + 8 * b + h
    prefill = []
    for p in range(p_tp):
        span = kv_heads_of(total, p_tp, p)
        cache = _cache(span.count)
        for b in range(BLOCKS):
            for k in range(span.count):
                cache[b, k] = 1 + 8 * b + span.first + k
        prefill.append(cache)
    src_ids = tuple(range(BLOCKS))
    batch_of = {
        p: ReadReadyBatch(0, "l", (ReadRequest("r", src_ids, (), 0, 0),), (), topo.member_of(p), topo.ratio)
        for p in range(p_tp)
    }
    for d in range(d_tp):
        span = kv_heads_of(total, d_tp, d)
        decode = _cache(span.count)
        dst = _layout(decode, span)
        views = HeadViews(decode_tp=d_tp, decode_rank=d)
        written = 0
        for p in topo.contributors_of(d):
            batch = batch_of[p]
            reads, refused = plan_reads(
                batch, {"r": Destinations.of(dst_order)}, decode_rank=d, decode_tp=d_tp,
                main_split=MainSplit.REPLICATED, kv_heads=total,
            )  # fmt: skip
            assert refused == {}
            src_view, dst_view = views.pair(_layout(prefill[p]), dst, batch.tp_ratio, batch.group_member_idx)
            regions = RegionSet([(prefill[p].ctypes.data, prefill[p].nbytes)])
            plan = build_layer_plan(
                src_view, dst_view, reads, src_regions=regions, dst_regions=RegionSet([(decode.ctypes.data, decode.nbytes)])
            )
            assert plan.failed == {}
            _run(plan)
            written += int(plan.lengths.sum())
        expected = np.empty_like(decode)
        for i, b in enumerate(dst_order):
            for k in range(span.count):
                expected[b, k] = 1 + 8 * i + span.first + k
        assert np.array_equal(decode, expected), (case, d)
        assert written == decode.nbytes  # no head read twice (replicas give nothing)


def test_a_replica_gives_no_blocks_and_the_others_all() -> None:
    # 2 KV heads, Prefill TP 4 (ranks 0, 1 hold head 0; 2, 3 head 1), Decode TP 1
    assert [reads_heads(2, 1, 0, 4, m) for m in range(4)] == [True, False, True, False]
    batch = ReadReadyBatch(0, "l", (ReadRequest("r", (3, 4, 5), (), 2, 2),), (), 1, 4)
    dest = {"r": Destinations.of(range(10, 15))}
    reads, _ = plan_reads(batch, dest, decode_rank=0, decode_tp=1, main_split=MainSplit.REPLICATED, kv_heads=2)
    assert reads[0].src_main.size == 0
    batch = ReadReadyBatch(0, "l", (ReadRequest("r", (3, 4, 5), (), 2, 2),), (), 2, 4)
    reads, _ = plan_reads(batch, dest, decode_rank=0, decode_tp=1, main_split=MainSplit.REPLICATED, kv_heads=2)
    assert reads[0].src_main.tolist() == [3, 4, 5] and reads[0].dst_main.tolist() == [12, 13, 14]
    # without kv_heads (MLA: the same latent everywhere) the contributors split the blocks
    reads, _ = plan_reads(batch, dest, decode_rank=0, decode_tp=1, main_split=MainSplit.REPLICATED)
    assert reads[0].src_main.size < 3


def test_incompatible_head_counts_fail_the_layer_with_both_sides_named() -> None:
    dst = HeadSpan(4, 0, 4)  # Decode TP 1 of a 4-KV-head model
    # two contributors must each hold 2 heads; this one says 1
    with pytest.raises(LayoutError, match="blocks hold 1 KV head.*4 KV heads split over Prefill TP 2.*puts 2"):
        head_slice(dst, 1, 0, 2, 0, 1)
    # one contributor holding fewer heads than Decode's block
    with pytest.raises(LayoutError, match="blocks hold 2 KV head"):
        head_slice(HeadSpan(4, 0, 4), 1, 0, 1, 0, 2)
    # heads not outermost in a block (NHD): a head range is not contiguous
    nhd = LayerLayout((TensorLayout(0x1000, 64, 4),), tag=LayoutTag("bf16", (32, 2, 16), 32, "vllm"))
    with pytest.raises(LayoutError, match="does not hold its 2 KV heads outermost"):
        narrow_heads(nhd, 1, 1, 2, "Prefill")


def test_equal_tp_keeps_the_layouts_and_their_merged_runs() -> None:
    cache = _cache(2)
    src, dst = _layout(cache), _layout(_cache(2), HeadSpan(4, 2, 2))
    views = HeadViews(decode_tp=2, decode_rank=1)
    assert views.pair(src, dst, 1, 0) == (src, dst)
    assert views.pair(src, dst, 1, 0)[0] is src


def test_narrowed_pairs_are_kept_so_step_plans_see_the_same_layouts() -> None:
    src, dst = _layout(_cache(1)), _layout(_cache(2), HeadSpan(2, 0, 2))
    views = HeadViews(decode_tp=1, decode_rank=0)
    first = views.pair(src, dst, 2, 1)
    assert views.pair(src, dst, 2, 1)[1] is first[1]
    assert first[1].main[0].base_addr == dst.main[0].base_addr + HEAD_BYTES
    assert first[1].main[0].block_bytes == HEAD_BYTES and first[1].main[0].stride == 2 * HEAD_BYTES
