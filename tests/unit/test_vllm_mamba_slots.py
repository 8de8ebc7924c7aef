"""A Mamba model whose storage slots are not alike: some hold a Mamba layer beside attention
layers, one only attention layers (vLLM's own KV cache config and allocation, the workers over
loopback).

vLLM groups the layers of each kind in groups of one size and overlays the groups: slot i holds
the i-th layer of every group. With three Mamba layers and four attention layers (names
``layers.0/5/6`` Mamba, ``layers.1..4`` attention) the Mamba group is padded to four layers, and
the slot of ``layers.4`` holds attention only: it is announced at its save, in the forward,
while the slots with a Mamba layer wait for the forward's end (vLLM calls no save hook for a
Mamba layer). With one Mamba layer and two attention layers every group has one layer and all
three view one slot: there is no attention-only slot in such a model.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import free_base_port
from test_vllm_mamba_state import ATTN_BLOCK, PAGE, STATE_BLOCK, config_for, mamba_spec
from vllm_kit import write_model

from rd2h.vllm.config import ConnectorConfig, Mode
from rd2h.vllm.kv_groups import check_groups, pulls_groups
from rd2h.vllm.metadata import RecvSpec, SendFinish, SendSpec, StepMetadata
from rd2h.vllm.slots import SlotBook
from rd2h.vllm.state_groups import page_view
from rd2h.vllm.worker import RD2HWorker

M0, M5, M6 = "model.layers.0.mixer", "model.layers.5.mixer", "model.layers.6.mixer"
A1, A2, A3, A4 = (f"model.layers.{i}.self_attn.attn" for i in (1, 2, 3, 4))
LAYERS = [M0, A1, A2, A3, A4, M5, M6]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("mamba-slots"))


def kv_for(model: Path, layers: list[str]) -> Any:
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    attention = FullAttentionSpec(block_size=ATTN_BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32)
    specs = {n: mamba_spec() if n.endswith("mixer") else attention for n in layers}
    return get_kv_cache_configs(config_for(model), [specs], [8 << 20])[0]


def allocate(kv: Any) -> dict[str, torch.Tensor]:
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    return allocate_kv_cache(kv, torch.device("cpu"), KVCacheLayout.LBHNC)


def book_of(kv: Any, caches: dict[str, torch.Tensor]) -> SlotBook:
    groups = pulls_groups(check_groups(kv, Mode.DENSE), Mode.DENSE)
    return SlotBook(caches, dict.fromkeys(caches, kv.num_blocks), groups)


def test_slots_with_and_without_a_mamba_layer_register_apart(model: Path) -> None:
    kv = kv_for(model, LAYERS)
    assert [g.layer_names for g in kv.kv_cache_groups] == [[M0, M5, M6], [A1, A2, A3, A4]]
    caches = allocate(kv)
    book = book_of(kv, caches)
    # in the order the forward completes them (the highest layer index of each)
    assert list(book.members.items()) == [
        (M0, frozenset({M0, A1})), (A4, frozenset({A4})), (M5, frozenset({M5, A2})), (M6, frozenset({M6, A3}))]
    assert book.state_slots == {M0, M5, M6}  # fmt: skip
    starts = {caches[s].data_ptr() for s in book.members}
    assert len(starts) == 4  # four storage regions, one per slot
    for slot in book.state_slots:  # a Mamba slot: its whole padded pages, over the region it views
        pages = page_view([caches[n] for n in book.members[slot]], kv.num_blocks)
        assert pages.shape == (kv.num_blocks, PAGE) and pages.data_ptr() == caches[slot].data_ptr()


def test_one_mamba_layer_beside_two_attention_layers_is_one_slot(model: Path) -> None:
    kv = kv_for(model, [M0, A1, A2])
    assert [g.layer_names for g in kv.kv_cache_groups] == [[M0], [A1], [A2]]
    book = book_of(kv, allocate(kv))
    assert book.members == {M0: frozenset({M0, A1, A2})} and book.state_slots == {M0}


def test_the_attention_only_slot_goes_at_its_save_the_mamba_slots_after_the_forward(model: Path) -> None:
    kv = kv_for(model, LAYERS)
    config = ConnectorConfig.from_extra({"kv_port": free_base_port(1), "request_timeout": 30})
    src, dst = allocate(kv), allocate(kv)
    book = book_of(kv, src)
    regions = {s: page_view([src[n] for n in names], kv.num_blocks) for s, names in book.members.items()}
    for pages in regions.values():  # every slot's pages random (the state pages as bytes, padding included)
        pages.copy_(torch.randint(-100, 100, pages.shape, dtype=torch.int8))
    blocks, sizes = {n: kv.num_blocks for n in src}, [STATE_BLOCK, ATTN_BLOCK]
    decode = RD2HWorker(config, consumer=True, producer=False, rank=0, tp_size=1, dp_rank=0, block_sizes=sizes,
                        kv_cache_config=kv)  # fmt: skip
    prefill = RD2HWorker(config, consumer=False, producer=True, rank=0, tp_size=1, dp_rank=0, block_sizes=sizes,
                         kv_cache_config=kv)  # fmt: skip
    try:
        decode.register(dst, blocks)
        prefill.register(src, blocks)
        announced: list[str] = []
        ready = prefill.source.layer_ready

        def record(name: str, event: Any) -> None:
            announced.append(name)
            ready(name, event)

        prefill.source.layer_ready = record
        prompt = 130  # Decode's prompt; Prefill computed 129 tokens: attention blocks 0..2 and the state
        p_blocks, d_blocks = ((5,), (11, 12, 13)), ((9,), (21, 22, 23, 24))
        decode.bind(StepMetadata(recv=(RecvSpec("m-0", "d-req", d_blocks, 0, prompt),)))
        prefill.bind(StepMetadata(send_new=(SendSpec("m-0", "p-req", str(decode.sink.endpoint), p_blocks, prompt - 1,
                                                     0),), computed=(("m-0", prompt - 1),)))  # fmt: skip
        for layer in (A1, A2, A3):  # each completes a slot that holds a Mamba layer: none goes yet
            prefill.save_layer(layer, src[layer])
            assert announced == []
        prefill.save_layer(A4, src[A4])
        assert announced == [A4]  # the attention-only slot: at its save, inside the forward
        prefill.forward_done()  # vLLM's wait_for_save: the forward wrote the states
        assert announced == [A4, M0, M5, M6]
        prefill.step_done()
        prefill.bind(StepMetadata(send_finish=(SendFinish("m-0", "p-req", False),)))
        sending: set[str] = set()
        recving: set[str] = set()
        deadline = time.monotonic() + 60
        while not (sending and recving):
            sending |= prefill.transfer_results()[0]
            recving |= decode.transfer_results()[1]
            if not (sending and recving):
                assert time.monotonic() < deadline, (sending, recving)
                (decode.sink if not recving else prefill.source).wait_any(1.0)
        assert (sending, recving) == ({"p-req"}, {"d-req"})
        landed = {s: page_view([dst[n] for n in names], kv.num_blocks) for s, names in book.members.items()}
        for slot in book.members:  # every slot: the attention blocks of the tokens moved, byte for byte
            for d, p in zip((21, 22, 23), (11, 12, 13)):
                assert torch.equal(landed[slot][d], regions[slot][p]), (slot, d)
            assert not landed[slot][24].any()  # the block of the token Decode computes itself
        for slot in book.state_slots:  # the state page: conv + SSM state and its padding
            assert torch.equal(landed[slot][9], regions[slot][5]) and torch.equal(dst[slot][9], src[slot][5])
        untouched = [b for b in range(kv.num_blocks) if b not in (9, 21, 22, 23)]
        assert all(not landed[s][untouched].any() for s in book.members)
    finally:
        prefill.close()
        decode.close()
