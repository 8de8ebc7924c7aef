"""Prefill's workers when its targets came after its KV was written (rd2h.vllm.late_sends): a
Prefill worker and a Decode worker in one process over real tensors (test_vllm_worker's pair)."""

from __future__ import annotations

import pytest
import test_vllm_worker as kit
import torch

from rd2h.vllm.metadata import RecvSpec, SendBlocks, SendFinish, SendSpec, StepMetadata

pair = kit.pair  # the fixture: a Prefill and a Decode worker over real tensors
DENSE, results, run_prefill = kit.DENSE, kit.results, kit.run_prefill


@pytest.mark.parametrize("pair", DENSE, indirect=True)
def test_targets_after_every_layer_was_written_announce_them_all_in_the_next_step(pair) -> None:
    prefill, decode, src, dst, endpoint = pair
    run_prefill(prefill, src, [StepMetadata()])  # the prompt's step: no targets yet, nothing announced
    decode.bind(StepMetadata(recv=(RecvSpec("r-0", "d-req", ((9, 3, 12),), 0, 80),)))  # its rendezvous
    run_prefill(prefill, {}, [StepMetadata(  # an idle step: no layer is saved in it
        send_new=(SendSpec("r-0", "p-req", endpoint, ((0, 1, 2),), 80, 0, written=80),),
        send_finish=(SendFinish("r-0", "p-req", False),), idle=True,
    )])
    assert results(prefill, decode, timeout=20) == ({"p-req"}, {"d-req"}, set())
    for name in src:
        assert torch.equal(dst[name][[9, 3, 12]], src[name][[0, 1, 2]])


@pytest.mark.parametrize("pair", DENSE, indirect=True)
def test_targets_between_chunks_announce_the_written_chunk_then_the_rest_as_computed(pair) -> None:
    prefill, decode, src, dst, endpoint = pair
    run_prefill(prefill, src, [StepMetadata()])  # chunk 1 (64 tokens), no targets yet
    decode.bind(StepMetadata(recv=(RecvSpec("r-0", "d-req", ((9, 3, 12),), 0, 80),)))
    run_prefill(prefill, src, [
        StepMetadata(send_new=(SendSpec("r-0", "p-req", endpoint, ((0, 1),), 80, 0, written=64),),
                     send_blocks=(SendBlocks("r-0", ((2,),)),), computed=(("r-0", 80),)),
        StepMetadata(send_finish=(SendFinish("r-0", "p-req", False),)),
    ])
    assert results(prefill, decode, timeout=20) == ({"p-req"}, {"d-req"}, set())
    for name in src:
        assert torch.equal(dst[name][[9, 3, 12]], src[name][[0, 1, 2]])


@pytest.mark.parametrize("pair", DENSE, indirect=True)
def test_a_request_released_for_targets_that_never_came_is_finished_sending_at_once(pair) -> None:
    prefill, _, _, _, _ = pair
    prefill.bind(StepMetadata(release=("p-req",), idle=True))
    assert prefill.transfer_results()[0] == {"p-req"}
