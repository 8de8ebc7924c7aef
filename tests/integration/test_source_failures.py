"""Source failure paths against a hand-written Decode (in-memory channel, real codec, manual
clock) and against a real Decode over zmq loopback: aborts, late and stale replies, a Decode
that falls silent and restarts, layers that cannot be announced, the consume rule."""

from __future__ import annotations

import pytest
from layers import layer_tensors
from prefill_kit import BLOCK, ScriptedDecode, memory_source

from rd2h.api import KVSink, KVSource
from rd2h.clock import ManualClock
from rd2h.errors import (
    DuplicateRequestError,
    GateTimeout,
    LayerFailedError,
    ReplyTimeout,
    UnknownRequestError,
    WaitTimeout,
)
from rd2h.outcome import TerminalState
from rd2h.wire import protocol


class _BrokenEvent:
    """A device event whose synchronize() fails (e.g. a CUDA/NPU error in the layer's kernel)."""

    def synchronize(self) -> None:
        raise RuntimeError("device error while writing the layer")


def _layers(count: int, *, shared: bool = False) -> dict:
    one = layer_tensors(True)
    return {f"l{i}": one if shared else layer_tensors(True, i) for i in range(count)}


def test_defect_2_abort_is_reported_after_decode_answered_and_cannot_poison_the_next_request(kv_port: int) -> None:
    """At 87b7601 ``abort`` dropped the request without ever reporting it, and the late
    READ_FAILED for it was stored under its id (``Source._errors``), so the next request with
    that id ended with the stale error although Decode read every layer of it."""
    with ScriptedDecode(kv_port) as decode, memory_source(_layers(2), ManualClock()) as source:
        source.add_request("r", decode.endpoint, main_block_ids=[1, 2], num_tokens=2 * BLOCK)
        source.schedule({"r": BLOCK})  # the first chunk only
        source.layer_ready("l0")
        peer, ready = decode.readiness()
        assert [r.ext_req_id for r in ready.read_reqs] == ["r"]
        source.abort("r")
        assert source.take_finished() == {}  # Decode may still be reading block 1
        decode.reply(peer, protocol.ReadFailed.from_error(0, LayerFailedError("late"), ["r"]))
        outcome = source.wait_finished(["r"], 10)["r"]
        assert outcome.state is TerminalState.ABORTED and outcome.error is None
        source.add_request("r", decode.endpoint, main_block_ids=[3], num_tokens=BLOCK)
        source.schedule({"r": BLOCK})
        for name in ("l0", "l1"):
            source.wait_for_layer_send(name, timeout=10)
            source.layer_ready(name)
            peer, ready = decode.readiness()
            assert ready.read_reqs[0].main_block_ids == (3,)
            decode.reply(peer, protocol.ReadDone(ready.layer_idx))
        outcome = source.wait_finished(["r"], 10)["r"]
        assert outcome.ok and outcome.error is None


def test_issue_9_d8_a_silent_decode_fails_its_request_not_the_next_waiter(kv_port: int) -> None:
    """At 87b7601 the abandoned layer's error was handed to the next waiter on the slot
    (``wait_for_layer_send`` raised LayerFailedError in whichever step came next), and a
    request interrupted before its final chunk got no result. Here the interrupted request
    ends FAILED with ReplyTimeout, the slot is simply released, and the next request, sent to
    the restarted Decode, ends DONE."""
    clock = ManualClock()
    layers = _layers(2, shared=True)  # l0 and l1 reuse one buffer: one storage slot
    with memory_source(layers, clock, reply_timeout=5.0) as source:
        with ScriptedDecode(kv_port) as decode:
            source.add_request("cut", decode.endpoint, main_block_ids=[1, 2], num_tokens=2 * BLOCK)
            source.schedule({"cut": BLOCK})
            source.layer_ready("l0")
            decode.readiness()  # read, never answered: this Decode dies
        clock.advance(6.0)
        source.wait_for_layer_send("l1", timeout=10)  # released, and no error of another request
        outcome = source.wait_finished(["cut"], 10)["cut"]
        assert outcome.state is TerminalState.FAILED and isinstance(outcome.error, ReplyTimeout)
        with ScriptedDecode(kv_port) as restarted:
            source.add_request("next", restarted.endpoint, main_block_ids=[3], num_tokens=BLOCK)
            source.schedule({"next": BLOCK})
            for name in ("l0", "l1"):
                source.wait_for_layer_send(name, timeout=10)
                source.layer_ready(name)
                peer, ready = restarted.readiness()  # mf_meta first: a new connection
                restarted.reply(peer, protocol.ReadDone(ready.layer_idx))
            assert source.wait_finished(["next"], 10)["next"].ok


def test_one_consume_rule_and_clear_errors(kv_port: int) -> None:
    with ScriptedDecode(kv_port) as decode, memory_source(_layers(1), ManualClock()) as source:
        with pytest.raises(UnknownRequestError):
            source.wait_finished(["never"], 10)  # at once, not after 10 s
        source.add_request("r", decode.endpoint, main_block_ids=[1], num_tokens=BLOCK)
        with pytest.raises(DuplicateRequestError):
            source.add_request("r", decode.endpoint, main_block_ids=[2], num_tokens=BLOCK)
        with pytest.raises(WaitTimeout, match=r"\['r'\]") as info:
            source.wait_finished(["r"], 0)
        assert isinstance(info.value, TimeoutError)
        source.abort("r")  # nothing in flight: ends at once
        assert {e: o.state for e, o in source.take_finished().items()} == {"r": TerminalState.ABORTED}
        assert source.take_finished() == {}
        with pytest.raises(UnknownRequestError):
            source.wait_finished(["r"], 1)  # taken: consumed
        source.add_request("r", decode.endpoint, main_block_ids=[2], num_tokens=BLOCK)  # the id is free
        source.send_all({"r": BLOCK})
        peer, ready = decode.readiness()
        decode.reply(peer, protocol.ReadDone(ready.layer_idx))
        assert source.wait_finished(["r"], 10)["r"].ok
        with pytest.raises(UnknownRequestError):
            source.wait_finished(["r"], 1)


def test_schedule_never_fails_the_step(kv_port: int) -> None:
    """An unknown id or a request short of block ids is reported per id; the others go out."""
    with ScriptedDecode(kv_port) as decode, memory_source(_layers(1), ManualClock()) as source:
        source.add_request("a", decode.endpoint, main_block_ids=[1, 2], num_tokens=2 * BLOCK)
        source.add_request("short", decode.endpoint, main_block_ids=[3], num_tokens=2 * BLOCK)
        problems = source.send_all({"a": 2 * BLOCK, "short": 2 * BLOCK, "not-added": BLOCK})
        assert isinstance(problems["not-added"], UnknownRequestError)
        assert "need 2 main" in str(problems["short"]) and "a" not in problems
        peer, ready = decode.readiness()
        assert [r.ext_req_id for r in ready.read_reqs] == ["a"] and ready.done_ext_ids == ("a",)
        decode.reply(peer, protocol.ReadDone(ready.layer_idx))
        outcomes = source.wait_finished(["a", "short"], 10)
        assert outcomes["a"].ok and outcomes["short"].state is TerminalState.FAILED


def test_blocks_learnt_step_by_step_a_cached_prefix_and_indexer_block_size(kv_port: int) -> None:
    """Chunked prefill: ids arrive by extend; Decode caches the first main block; indexer
    blocks hold twice the tokens. Each group is cut on its own and starts where it should."""
    layers = _layers(1)
    with ScriptedDecode(kv_port) as decode, memory_source(layers, ManualClock(), indexer_block_size=2 * BLOCK) as source:
        source.add_request("r", decode.endpoint, indexer_block_ids=[], num_tokens=4 * BLOCK, first_block=2)
        source.extend("r", main_block_ids=[10, 11, 12], indexer_block_ids=[20, 21])
        source.send_all({"r": 3 * BLOCK})
        peer, ready = decode.readiness()
        read = ready.read_reqs[0]
        assert (read.main_start_block, read.main_block_ids) == (2, (12,))
        assert (read.indexer_start_block, read.indexer_block_ids) == (1, ())  # tokens 32..63 not all computed
        decode.reply(peer, protocol.ReadDone(0))
        source.extend("r", main_block_ids=[13])
        source.send_all({"r": 4 * BLOCK})
        peer, ready = decode.readiness()
        read = ready.read_reqs[0]
        assert (read.main_start_block, read.main_block_ids) == (3, (13,))
        assert (read.indexer_start_block, read.indexer_block_ids) == (1, (21,))
        decode.reply(peer, protocol.ReadDone(0))
        outcome = source.wait_finished(["r"], 10)["r"]
    tensors = layers["l0"]
    per_block = sum(t[0].nbytes for t in tensors.main), tensors.indexer[0].nbytes
    assert outcome.ok and outcome.nbytes == 2 * per_block[0] + per_block[1]


# -- a real Decode over zmq loopback ----------------------------------------------------------


def test_a_layer_that_was_never_announced_fails_the_request(kv_port: int) -> None:
    """Layer l1's event failed, so it was never announced: Prefill fails the request,
    announces it no more and tells Decode, which fails it too (at once, not at a deadline)."""
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
        decode = sink.wait(["r"], 10)["r"]
    assert isinstance(result.error, LayerFailedError) and "device error" in str(result.error)
    assert isinstance(decode.error, LayerFailedError) and "device error" in str(decode.error)
    assert not dst["l1"].main[0][[5, 6]].any()  # l1 really never arrived
    assert not dst["l2"].main[0][[5, 6]].any()  # nor anything after the failure


def test_a_failed_last_layer_still_finishes_the_request_as_failed(kv_port: int) -> None:
    """The last layer's event fails: the request still gets its (failed) outcome."""
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
        results = source.wait_finished(["r"], 10)
        assert results["r"].state is TerminalState.FAILED


def test_without_slot_reuse_a_layer_goes_out_again_while_decode_still_reads_the_last_one(kv_port: int) -> None:
    """vLLM's paged cache (``reuse_slots=False``): step 2 announces layer 0 for another request
    while Decode has not answered step 1's layer 0. Nothing waits, nothing raises; the replies,
    in order, settle each request. With slot reuse the same wait times out (the gate holds)."""
    with ScriptedDecode(kv_port) as decode, memory_source(_layers(1), ManualClock(), reuse_slots=False) as source:
        for ext_id, block in (("a", 1), ("b", 2)):
            source.add_request(ext_id, decode.endpoint, main_block_ids=[block], num_tokens=BLOCK)
            source.schedule({ext_id: BLOCK})
            source.wait_for_layer_send("l0", timeout=0)  # returns at once: no slot to wait for
            source.layer_ready("l0")
        readies = [decode.readiness() for _ in range(2)]
        assert [r.read_reqs[0].ext_req_id for _, r in readies] == ["a", "b"]
        for peer, ready in readies:
            decode.reply(peer, protocol.ReadDone(ready.layer_idx))
        outcomes = source.wait_finished(["a", "b"], 10)
        assert all(o.ok for o in outcomes.values())
    with ScriptedDecode(kv_port) as decode, memory_source(_layers(1), ManualClock()) as source:
        source.add_request("a", decode.endpoint, main_block_ids=[1], num_tokens=BLOCK)
        source.schedule({"a": BLOCK})
        source.layer_ready("l0")
        peer, ready = decode.readiness()
        with pytest.raises(GateTimeout):  # the control: a reused slot waits for Decode's reply
            source.wait_for_layer_send("l0", timeout=0)
        decode.reply(peer, protocol.ReadDone(ready.layer_idx))
        assert source.wait_finished(["a"], 10)["a"].ok


def test_issue_19_item_8_a_layer_wide_read_failed_fails_its_requests_and_frees_the_slot(kv_port: int) -> None:
    """docs/protocol.md section 6 and LayerFailedError say one story: a READ_FAILED that names no
    request (here a legacy Decode's: no ids, no class) fails every request of that readiness
    and frees the storage slot; nothing is raised on the compute path, whose next layer on the
    same slot goes out at once, and a later request is served."""
    with ScriptedDecode(kv_port) as decode, memory_source(_layers(2, shared=True), ManualClock()) as source:
        for ext_id, block in (("a", 1), ("b", 2)):
            source.add_request(ext_id, decode.endpoint, main_block_ids=[block], num_tokens=BLOCK)
        source.schedule({"a": BLOCK, "b": BLOCK})
        source.layer_ready("l0")
        peer, ready = decode.readiness()
        assert sorted(r.ext_req_id for r in ready.read_reqs) == ["a", "b"]
        decode.reply(peer, protocol.ReadFailed(0, "legacy: layer failed"))
        source.wait_for_layer_send("l1", timeout=10)  # the slot is free: no GateTimeout, no error
        outcomes = source.wait_finished(["a", "b"], 10)
        assert all(isinstance(o.error, LayerFailedError) and "legacy: layer failed" in str(o.error)
                   for o in outcomes.values())
        source.add_request("c", decode.endpoint, main_block_ids=[3], num_tokens=BLOCK)
        source.schedule({"c": BLOCK})
        for name in ("l0", "l1"):
            source.wait_for_layer_send(name, timeout=10)
            source.layer_ready(name)
            peer, ready = decode.readiness()
            assert [r.ext_req_id for r in ready.read_reqs] == ["c"]
            decode.reply(peer, protocol.ReadDone(ready.layer_idx))
        assert source.wait_finished(["c"], 10)["c"].ok
