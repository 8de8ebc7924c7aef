"""Layouts of strided tensors and their tags (rd2h.tensors), down to the bytes a plan moves."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from rd2h.errors import ConfigError, LayoutTagMismatch
from rd2h.layout.layers import LayoutTag, validate_layer
from rd2h.layout.planning import RequestRead, build_layer_plan
from rd2h.layout.regions import Region, RegionSet
from rd2h.tensors import LayerTensors, layer_layout, layout_tag, tensor_layout


def test_a_block_outermost_view_of_one_allocation_registers_as_it_is() -> None:
    # vLLM-like: one allocation, blocks outermost, each block holding every layer's page
    blocks, layers, page = 6, 3, (2, 16, 8)  # (K/V, tokens, head size) in bfloat16
    big = torch.zeros(blocks, layers, *page, dtype=torch.bfloat16)
    page_bytes = 2 * 16 * 8 * 2
    for i in range(layers):
        t = tensor_layout(big[:, i])
        assert (t.base_addr, t.num_blocks, t.block_bytes) == (big.data_ptr() + i * page_bytes, blocks, page_bytes)
        assert t.block_stride == t.stride == layers * page_bytes and not t.dense
        # the registered range ends with the last block: inside the allocation for every layer
        (region,) = layer_layout(LayerTensors(main=[big[:, i]])).regions()
        assert region == Region(t.base_addr, (blocks - 1) * layers * page_bytes + page_bytes)
        assert region.end <= big.data_ptr() + big.numel() * 2


@pytest.mark.parametrize("make", [lambda: torch.zeros(8, 24)[:, :16], lambda: np.zeros((8, 24), np.float32)[:, :16]])
def test_padded_pages_keep_their_stride(make) -> None:
    t = tensor_layout(make(), block_size_scale=2)
    assert (t.block_len, t.block_size_scale, t.block_bytes, t.stride) == (32, 2, 64, 96)


def test_a_dense_tensor_stays_dense() -> None:
    for dense in (torch.zeros(4, 2, 8), np.zeros((4, 16), np.uint8), torch.zeros(1, 8)[:, :4], torch.zeros(4, 1, 8)):
        assert tensor_layout(dense).dense


@pytest.mark.parametrize(
    "bad, match",
    [
        (torch.zeros(4, 8, 2)[:, :, 0], "contiguous"),  # every other element of each block
        (np.zeros((4, 8, 2))[:, ::2], "contiguous"),
        (torch.zeros(16).as_strided((4, 8), (2, 1)), "overlap"),  # blocks overlap
        (np.zeros((4, 8))[::-1], "overlap or run backwards"),
        (torch.zeros(4, 8).expand(3, 4, 8), "overlap"),  # every block id is the same memory
        (np.zeros((4, 6), np.uint8), "does not split into 4 rows"),
    ],
)
def test_what_cannot_be_addressed_block_by_block_is_refused(bad, match) -> None:
    with pytest.raises(ConfigError, match=match):
        tensor_layout(bad, block_size_scale=4 if "rows" in match else 1)


def test_padded_prefill_pages_land_in_dense_decode_pages_byte_for_byte() -> None:
    torch.manual_seed(0)
    src_pool = torch.randn(10, 80, dtype=torch.float16)  # pages of 64 values and 16 of padding
    src = LayerTensors(main=[src_pool[:, :64].unflatten(1, (2, 32))], indexer=torch.randn(10, 40)[:, :24])
    dst = LayerTensors(main=[torch.zeros(12, 2, 32, dtype=torch.float16)], indexer=torch.zeros(12, 24))
    src_layout, dst_layout = layer_layout(src), layer_layout(dst)
    reads = [RequestRead("r", [4, 5, 6, 1], [0, 1, 2, 9], [2, 3], [7, 8])]
    plan = build_layer_plan(
        src_layout, dst_layout, reads,
        src_regions=RegionSet(src_layout.regions()), dst_regions=RegionSet(dst_layout.regions()),
    )  # fmt: skip
    assert plan.failed == {} and plan.lengths.tolist() == [128] * 4 + [96] * 2
    for local, remote, n in zip(plan.local.tolist(), plan.remote.tolist(), plan.lengths.tolist()):
        ctypes.memmove(local, remote, n)
    assert torch.equal(dst.main[0][[0, 1, 2, 9]], src.main[0][[4, 5, 6, 1]])
    assert torch.equal(dst.indexer[[7, 8]], src.indexer[[2, 3]])
    assert not dst.main[0][3:9].any() and not dst.indexer[:7].any()


def test_torch_layers_are_tagged_with_dtype_and_block_shape() -> None:
    kv = torch.zeros(4, 2, 16, 8, dtype=torch.bfloat16)
    tensors = LayerTensors(main=[kv, torch.zeros(4, 64)], indexer=torch.zeros(4, 8))
    assert layer_layout(tensors).tag == LayoutTag("bfloat16", (2, 16, 8), 0, "")
    tagged = layer_layout(tensors, block_tokens=16, layout_name="LBHNC")
    assert tagged.tag == LayoutTag("bfloat16", (2, 16, 8), 16, "LBHNC")
    assert layer_layout(tensors, tag=False).tag is None
    assert layer_layout(LayerTensors(main=[np.zeros((4, 512), np.uint8)])).tag is None  # raw bytes: unstated
    assert layout_tag(torch.zeros(4, 3, dtype=torch.int8)) == LayoutTag("int8", (3,), 0)


@pytest.mark.parametrize(
    "other",
    [
        torch.zeros(4, 2, 16, 8, dtype=torch.float16),  # same bytes, another dtype
        torch.zeros(4, 16, 2, 8, dtype=torch.bfloat16),  # same bytes, another head layout
    ],
)
def test_same_bytes_but_other_contents_are_refused(other: torch.Tensor) -> None:
    prefill = layer_layout(LayerTensors(main=[torch.zeros(4, 2, 16, 8, dtype=torch.bfloat16)]))
    decode = layer_layout(LayerTensors(main=[other]))
    with pytest.raises(LayoutTagMismatch, match="'layer.0'"):
        validate_layer("layer.0", prefill, decode)
