"""vLLM's hybrid allocator (full + sliding-window layers, issue 20 item 1) over vLLM's own objects.

The KV cache config comes from vLLM's grouping (``get_kv_cache_configs``), the caches from
vLLM's own allocator (``allocate_kv_cache``: the groups' layers view one allocation), and the
block ids from vLLM's own Scheduler and KV cache manager, so the tests follow what vLLM really
allocates for a sliding window: a Decode request's null blocks, a chunked Prefill's freed ones.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import free_base_port
from test_vllm_scheduler import decode_params, ext, meta_of, prefill_params
from vllm_kit import BLOCK, engine_config, make_request, record_posts, runner_output, write_model

from rd2h.errors import ConfigError
from rd2h.vllm.config import ConnectorConfig, Mode
from rd2h.vllm.kv_groups import (
    NULL_BLOCK,
    check_groups,
    gather_blocks,
    pull_ranges,
    pulls_groups,
    storage_slots,
    transfer_tokens,
)
from rd2h.vllm.metadata import RecvSpec, SendFinish, SendSpec, StepMetadata
from rd2h.vllm.worker import RD2HWorker

WINDOW = 64
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]


def specs(window: int = WINDOW) -> dict[str, Any]:
    """Gemma-2 style: even layers slide over ``window`` tokens, odd ones see everything."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32)
    swa = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32,
                            sliding_window=window)  # fmt: skip
    return {name: swa if i % 2 == 0 else full for i, name in enumerate(LAYERS)}


def vllm_config(model: Path, role: str | None = None, *, batched: int = 512) -> Any:
    return engine_config(model, role, batched=batched)


def kv_cache_config(config: Any, memory: int = 4 << 20) -> Any:
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs

    return get_kv_cache_configs(config, [specs()], [memory])[0]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("hybrid"))


def hybrid_scheduler(model: Path, role: str, *, batched: int = 512) -> Any:
    from vllm.plugins import load_general_plugins
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    load_general_plugins()
    config = vllm_config(model, role, batched=batched)
    kv = kv_cache_config(config)
    config.cache_config.num_gpu_blocks = kv.num_blocks
    assert len(kv.kv_cache_groups) == 2  # the hybrid allocator's sliding and full groups
    scheduler = Scheduler(config, kv_cache_config=kv, structured_output_manager=StructuredOutputManager(config),
                          block_size=BLOCK, log_stats=False)  # fmt: skip
    record_posts(scheduler)
    return scheduler


# -- the groups --------------------------------------------------------------------------------


def test_every_group_of_the_hybrid_allocator_is_pulled_in_dense_mode(model: Path) -> None:
    kv = kv_cache_config(vllm_config(model))
    infos = check_groups(kv, Mode.DENSE)
    groups = pulls_groups(infos, Mode.DENSE)
    assert [(g.kind, g.window, g.layers) for g in groups] == [
        (f"sliding window ({WINDOW} tokens)", WINDOW, (LAYERS[0], LAYERS[2])),
        ("full attention", 0, (LAYERS[1], LAYERS[3])),
    ]
    with pytest.raises(ConfigError, match=r"group 1 \(full attention.*does not pull"):  # sfa: main + indexer only
        check_groups(kv, Mode.SFA)


def test_a_lone_sliding_window_group_is_refused_naming_it() -> None:
    """One group: its block ids would be pulled as they are, null blocks before the window too."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    kv = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(LAYERS, specs()[LAYERS[0]])])
    with pytest.raises(ConfigError, match=rf"group 0 \(sliding window \({WINDOW} tokens\).*does not transfer"):
        check_groups(kv, Mode.DENSE)


def test_chunked_local_attention_beside_full_is_refused_naming_it() -> None:
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32)
    local = ChunkedLocalAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32,
                                      attention_chunk_size=128)  # fmt: skip
    kv = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(LAYERS[:2], full), KVCacheGroupSpec(LAYERS[2:], local)])  # fmt: skip
    with pytest.raises(ConfigError, match=r"group 1 \(chunked local attention \(128 tokens\).*does not transfer"):
        check_groups(kv, Mode.DENSE)


def test_the_groups_layers_share_storage_slots_as_vllm_allocates_them(model: Path) -> None:
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    kv = kv_cache_config(vllm_config(model))
    caches = allocate_kv_cache(kv, torch.device("cpu"), KVCacheLayout.LBHNC)
    storage = {name: t.data_ptr() for name, t in caches.items()}
    assert len(set(storage.values())) == 2  # 4 layers, 2 slots: a sliding and a full layer each
    slots = storage_slots(storage, pulls_groups(check_groups(kv, Mode.DENSE), Mode.DENSE))
    assert list(slots.items()) == [(LAYERS[0], (LAYERS[0], LAYERS[1])), (LAYERS[2], (LAYERS[2], LAYERS[3]))]


@pytest.mark.parametrize("prompt", [40, 95, 96, 127, 200, 287, 300])
def test_decode_pulls_exactly_what_vllm_allocated_for_each_group(model: Path, prompt: int) -> None:
    """vLLM's own Decode allocation for a remote prefill: the sliding group holds only the
    window of the token Decode computes (null blocks before it), and every held block is pulled."""
    scheduler = hybrid_scheduler(model, "kv_consumer")
    req = "cmpl-h-0-abcdef12"
    scheduler.add_request(make_request(req, prompt, decode_params("h")))
    (spec,) = meta_of(scheduler.schedule()).recv
    tokens = transfer_tokens(prompt)
    assert scheduler.requests[req].num_computed_tokens == tokens  # Decode computes the last token itself
    groups = pulls_groups(check_groups(scheduler.kv_cache_config, Mode.DENSE), Mode.DENSE)
    flat = gather_blocks(groups, spec.blocks, tokens, 0, decode=True)
    held = scheduler.kv_cache_manager.get_block_ids(req)
    assert flat == [b for g in held for b in g if b != NULL_BLOCK]  # all it holds, nothing else
    window_start = (prompt - 1 - WINDOW + 1) // BLOCK  # first block the last token's window reads
    assert all(b != NULL_BLOCK for b in held[0][max(0, window_start):])
    scheduler.connector.shutdown()


def test_loading_every_prompt_token_would_free_a_block_the_last_tokens_window_reads() -> None:
    """Why Decode loads all but the last token: for the token after them vLLM frees one block
    more than the recomputed last token's window allows when the window starts on a block."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    from rd2h.vllm.kv_groups import GroupInfo

    swa = GroupInfo(0, "sliding window", (), BLOCK, True, True, window=WINDOW)
    prompt = 95  # token 94 reads tokens 31..94; token 31 sits in block 0
    assert pull_ranges([swa], prompt, 0) == [(1, 3)]  # all 95 tokens: block 0 would be freed
    assert pull_ranges([swa], transfer_tokens(prompt), 0) == [(0, 3)]
    spec = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32,
                             sliding_window=WINDOW)  # fmt: skip
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager

    skipped = SlidingWindowManager.get_num_skipped_tokens
    assert skipped(SimpleManager(spec), prompt) // BLOCK == 1 and skipped(SimpleManager(spec), prompt - 1) // BLOCK == 0


class SimpleManager:
    """The two attributes vLLM's get_num_skipped_tokens reads."""

    def __init__(self, spec: Any) -> None:
        self.sliding_window, self.extra_retained_tokens = spec.sliding_window, spec.extra_retained_tokens


def test_decode_refuses_an_allocation_that_holds_a_block_before_the_window() -> None:
    from rd2h.vllm.kv_groups import GroupInfo

    groups = [GroupInfo(0, "sliding window", (), BLOCK, True, True, window=WINDOW),
              GroupInfo(1, "full attention", (), BLOCK, True, True)]  # fmt: skip
    blocks = ((NULL_BLOCK, NULL_BLOCK, 7, 8), (1, 2, 3, 4))
    assert gather_blocks(groups, blocks, 127, 0, decode=True) == [7, 8, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="before the window"):
        gather_blocks(groups, ((5, NULL_BLOCK, 7, 8), (1, 2, 3, 4)), 127, 0, decode=True)
    with pytest.raises(ValueError, match="position 2 to pull holds no block"):
        gather_blocks(groups, ((NULL_BLOCK, NULL_BLOCK, NULL_BLOCK, 8), (1, 2, 3, 4)), 127, 0, decode=False)
    # a local prefix hit of 2 blocks: only the tail of each group moves
    assert gather_blocks(groups, blocks, 127, 2 * BLOCK, decode=True) == [7, 8, 3, 4]


def test_prefill_sends_a_chunked_request_whole_with_its_last_chunk(model: Path) -> None:
    """Chunked prefill frees sliding-window blocks behind the window; the request goes to the
    workers once, with every group's blocks, and none it sends was freed."""
    scheduler = hybrid_scheduler(model, "kv_producer", batched=128)
    req, prompt = "cmpl-p-0-abcdef12", 300
    scheduler.add_request(make_request(req, prompt, prefill_params("p", "10.0.0.2:5600/1"), max_tokens=1))
    sent: list[SendSpec] = []
    computed: list[tuple[str, int]] = []
    done = 0
    for _ in range(3):
        out = scheduler.schedule()
        meta = meta_of(out)
        assert not meta.send_blocks
        sent += meta.send_new
        computed += meta.computed
        done += out.num_scheduled_tokens[req]
        last = done >= prompt
        if not last:
            assert not meta.send_new
        held = scheduler.kv_cache_manager.get_block_ids(req)
        scheduler.update_from_output(out, runner_output(out, sampled={req: 7} if last else None))
    assert computed == [(ext("p"), prompt)]
    (spec,) = sent
    groups = pulls_groups(check_groups(scheduler.kv_cache_config, Mode.DENSE), Mode.DENSE)
    assert NULL_BLOCK in held[0]  # vLLM freed the window's early blocks while it computed
    flat = gather_blocks(groups, spec.blocks, transfer_tokens(prompt), 0, decode=False)
    still = set(b for g in held for b in g)
    assert set(flat) <= still and len(flat) == len(set(flat))  # every block sent is still the request's
    (finish,) = meta_of(scheduler.schedule()).send_finish
    assert finish.ext_id == ext("p")
    scheduler.connector.shutdown()


# -- the workers over vLLM's own allocation ----------------------------------------------------


def _workers(model: Path, port: int) -> tuple[RD2HWorker, RD2HWorker, dict, dict]:
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    kv = kv_cache_config(vllm_config(model))
    config = ConnectorConfig.from_extra({"kv_port": port, "request_timeout": 30})
    src = allocate_kv_cache(kv, torch.device("cpu"), KVCacheLayout.LBHNC)
    dst = allocate_kv_cache(kv, torch.device("cpu"), KVCacheLayout.LBHNC)
    for name, view in src.items():
        view.copy_(torch.randint(-100, 100, view.shape, dtype=view.dtype))
    blocks = {n: kv.num_blocks for n in src}
    decode = RD2HWorker(config, consumer=True, producer=False, rank=0, tp_size=1, dp_rank=0,
                        block_sizes=[BLOCK, BLOCK], kv_cache_config=kv)  # fmt: skip
    prefill = RD2HWorker(config, consumer=False, producer=True, rank=0, tp_size=1, dp_rank=0,
                         block_sizes=[BLOCK, BLOCK], kv_cache_config=kv)  # fmt: skip
    decode.register(dst, blocks)
    prefill.register(src, blocks)
    return prefill, decode, src, dst


def _poll(prefill: RD2HWorker, decode: RD2HWorker, want_sending: bool = True) -> tuple[set, set, set]:
    sending: set[str] = set()
    recving: set[str] = set()
    failed: set[str] = set()
    tick, deadline = threading.Event(), time.monotonic() + 60
    while not (recving and (sending or not want_sending)):
        assert time.monotonic() < deadline, (sending, recving)
        sending |= prefill.transfer_results()[0]
        _, r, f = decode.transfer_results()
        recving, failed = recving | r, failed | f
        tick.wait(0.01)
    return sending, recving, failed


def test_workers_move_every_groups_blocks_through_the_shared_slots(model: Path) -> None:
    prefill, decode, src, dst = _workers(model, free_base_port(1))
    try:
        prompt = 200  # 199 tokens move: full blocks 0..6, sliding blocks 4..6 (the window of token 199)
        p_blocks = ((11, 12, 13, 14, 15, 16, 17), (21, 22, 23, 24, 25, 26, 27))
        d_blocks = ((0, 0, 0, 0, 35, 36, 37), (41, 42, 43, 44, 45, 46, 47))
        decode.bind(StepMetadata(recv=(RecvSpec("h-0", "d-req", d_blocks, 0, prompt),)))
        endpoint = decode.sink.endpoint
        prefill.bind(StepMetadata(send_new=(SendSpec("h-0", "p-req", str(endpoint), p_blocks, prompt, 0),),
                                  computed=(("h-0", prompt),)))  # fmt: skip
        for name in LAYERS:  # the forward's order: a slot goes out once both its layers were saved
            prefill.save_layer(name, src[name])
        prefill.step_done()
        prefill.bind(StepMetadata(send_finish=(SendFinish("h-0", "p-req", False),)))
        assert _poll(prefill, decode) == ({"p-req"}, {"d-req"}, set())
        for name in LAYERS:
            group = 0 if name in (LAYERS[0], LAYERS[2]) else 1
            pulled = [(p, d) for p, d in zip(p_blocks[group], d_blocks[group]) if d != 0]
            for p, d in pulled:
                assert torch.equal(dst[name][d], src[name][p]), (name, p, d)
            assert len(pulled) == (3 if group == 0 else 7)
        assert not dst[LAYERS[0]][0].any()  # Decode's null block: never written
        untouched = sorted(set(range(dst[LAYERS[0]].shape[0])) - {b for g in d_blocks for b in g})
        assert not dst[LAYERS[0]][untouched].any() and not dst[LAYERS[1]][untouched].any()
    finally:
        prefill.close()
        decode.close()


def test_a_slot_is_not_announced_before_each_of_its_layers_was_saved(model: Path) -> None:
    """Only the sliding layers saved: the full layers' blocks in the same slots are unwritten,
    so nothing may be announced and Decode gets no request."""
    prefill, decode, src, dst = _workers(model, free_base_port(1))
    try:
        p_blocks, d_blocks = ((11, 12), (21, 22)), ((31, 32), (41, 42))
        decode.bind(StepMetadata(recv=(RecvSpec("h-1", "d-req", d_blocks, 0, 40),)))
        prefill.bind(StepMetadata(send_new=(SendSpec("h-1", "p-req", str(decode.sink.endpoint), p_blocks, 40, 0),),
                                  computed=(("h-1", 40),)))  # fmt: skip
        for name in (LAYERS[0], LAYERS[2]):
            prefill.save_layer(name, src[name])
        prefill.step_done()
        assert not any(dst[n].any() for n in LAYERS)
        assert decode.transfer_results() == (set(), set(), set())
    finally:
        prefill.close()
        decode.close()


def test_registration_refuses_a_pulled_groups_layer_without_a_cache(model: Path) -> None:
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    kv = kv_cache_config(vllm_config(model))
    caches = allocate_kv_cache(kv, torch.device("cpu"), KVCacheLayout.LBHNC)
    del caches[LAYERS[3]]
    worker = RD2HWorker(ConnectorConfig(), consumer=False, producer=True, rank=0, tp_size=1, dp_rank=0,
                        block_sizes=[BLOCK, BLOCK], kv_cache_config=kv)  # fmt: skip
    with pytest.raises(ConfigError, match=r"1 layers of pulled KV cache groups have no registered cache \(model.layers.3"):
        worker.register(caches, dict.fromkeys(caches, kv.num_blocks))
    assert worker.source is None


def test_the_connector_starts_with_the_hybrid_allocator_in_both_roles(model: Path) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from rd2h.vllm.connector import RD2HConnector

    for role in ("kv_consumer", "kv_producer"):
        config = vllm_config(model, role)
        kv = kv_cache_config(config)
        assert len(kv.kv_cache_groups) > 1  # what used to be refused: the hybrid allocator's groups
        connector = RD2HConnector(config, KVConnectorRole.SCHEDULER, kv)
        try:
            assert connector.scheduler is not None  # started: no refusal for full + sliding-window groups
        finally:
            connector.shutdown()
