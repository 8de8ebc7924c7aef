"""Source failure paths: a layer that cannot be announced, a schedule() that raises."""

from __future__ import annotations

import pytest
from layers import layer_tensors

from rd2h.api import KVSink, KVSource
from rd2h.tracking import TerminalState

BLOCK = 16


class _BrokenEvent:
    """A device event whose synchronize() fails (e.g. a CUDA/NPU error in the layer's kernel)."""

    def synchronize(self) -> None:
        raise RuntimeError("device error while writing the layer")


def test_a_layer_that_was_never_announced_fails_the_request(kv_port: int) -> None:
    """Layer l1's event failed, so it was never announced: both sides must say so (Prefill
    records the error; Decode's coverage check refuses to call the request DONE)."""
    src = {f"l{i}": layer_tensors(True, i) for i in range(3)}
    dst = {f"l{i}": layer_tensors(False) for i in range(3)}
    with KVSink(dst, kv_port=kv_port) as sink, KVSource(src, block_size=BLOCK) as source:
        sink.expect("r", main_blocks=[5, 6])
        source.add_request("r", sink.endpoint, main_block_ids=[1, 2], num_tokens=2 * BLOCK)
        source.schedule({"r": 2 * BLOCK})
        for name in src:
            source.wait_for_layer_send(name)
            source.layer_ready(name, _BrokenEvent() if name == "l1" else None)
        result = source.wait_finished(["r"], 10)["r"]
        state = sink.wait(["r"], 10)["r"]
    l1_written = dst["l1"].main[0][[5, 6]].any()
    assert not l1_written  # l1 really never arrived
    # at least one side must say the request failed
    assert not result.ok or state is not TerminalState.DONE, (
        "layer l1 was never transferred, but Prefill reports OK and Decode reports DONE"
    )


def test_a_failed_last_layer_still_finishes_the_request_as_failed(kv_port: int) -> None:
    """The last layer's event fails: the request still gets its (failed) SendResult."""
    src = {f"l{i}": layer_tensors(True, i) for i in range(2)}
    dst = {f"l{i}": layer_tensors(False) for i in range(2)}
    with KVSink(dst, kv_port=kv_port) as sink, KVSource(src, block_size=BLOCK) as source:
        sink.expect("r", main_blocks=[5])
        source.add_request("r", sink.endpoint, main_block_ids=[1], num_tokens=BLOCK)
        source.schedule({"r": BLOCK})
        source.wait_for_layer_send("l0")
        source.layer_ready("l0")
        source.wait_for_layer_send("l1")
        source.layer_ready("l1", _BrokenEvent())
        results = source.wait_finished(["r"], 3)
        assert not results["r"].ok


def test_schedule_is_atomic(kv_port: int) -> None:
    """A schedule() that raises for one request changes nothing for the others."""
    src, dst = {"l": layer_tensors(True)}, {"l": layer_tensors(False)}
    with KVSink(dst, kv_port=kv_port) as sink, KVSource(src, block_size=BLOCK) as source:
        sink.expect("a", main_blocks=[3, 4])
        source.add_request("a", sink.endpoint, main_block_ids=[1, 2], num_tokens=2 * BLOCK)
        with pytest.raises(Exception):
            source.schedule({"a": 2 * BLOCK, "not-added": BLOCK})  # UnknownRequestError
        source.send_all({"a": 2 * BLOCK})  # ConfigError: final chunk was already announced
        assert source.wait_finished(["a"], 5)["a"].ok
