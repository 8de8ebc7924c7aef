"""Source and Sink end to end over real zmq sockets and the local engine, in one process.

The multi-process topologies run in test_demo.py; here the failure paths are driven
precisely: the slot gate, a dead Decode, layout mismatches, one bad request among good
ones, a restarted Decode.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from rd2h import plugins
from rd2h.api import KVSink, KVSource, LayerTensors, layer_layout
from rd2h.decode.sink import Sink
from rd2h.errors import GateTimeout, ReplyTimeout
from rd2h.outcome import TerminalState
from rd2h.prefill.source import DecodeEndpoint

BLOCK = 16  # tokens per block
NB = 32  # blocks per tensor


def _tensors(fill: bool, main_bytes: int = 256, seed: int = 0) -> LayerTensors:
    rng = np.random.default_rng(seed)

    def make(width: int) -> np.ndarray:
        if fill:
            return rng.integers(1, 255, (NB, width), dtype=np.uint8)
        return np.zeros((NB, width), np.uint8)

    return LayerTensors(main=[make(main_bytes), make(main_bytes // 2)], indexer=make(64), scale=make(8))


def _same(dst: LayerTensors, src: LayerTensors, dst_ids: list[int], src_ids: list[int]) -> bool:
    pairs = list(zip(dst.main, src.main)) + [(dst.indexer, src.indexer), (dst.scale, src.scale)]
    return all(np.array_equal(d[dst_ids], s[src_ids]) for d, s in pairs)


def _untouched(dst: LayerTensors) -> bool:
    return not any(t.any() for t in (*dst.main, dst.indexer, dst.scale))


def test_every_layer_arrives_byte_exact(kv_port: int) -> None:
    src = {f"l{i}": _tensors(True, seed=i) for i in range(3)}
    dst = {f"l{i}": _tensors(False) for i in range(3)}
    with KVSink(dst, kv_port=kv_port) as sink, KVSource(src, block_size=BLOCK) as source:
        sink.expect("r", main_blocks=[9, 4, 20])
        source.add_request("r", sink.endpoint, main_block_ids=[1, 2, 3], num_tokens=3 * BLOCK - 5)
        source.send_all({"r": 3 * BLOCK - 5})
        assert source.wait_finished(["r"], 10)["r"].ok
        assert sink.wait(["r"], 10)["r"].state is TerminalState.DONE
    for name in src:
        assert _same(dst[name], src[name], [9, 4, 20], [1, 2, 3])


def test_chunked_prefill_announces_each_block_once(kv_port: int) -> None:
    src, dst = {"l": _tensors(True)}, {"l": _tensors(False)}
    with KVSink(dst, kv_port=kv_port) as sink, KVSource(src, block_size=BLOCK) as source:
        sink.expect("r", main_blocks=list(range(10, 15)))
        source.add_request("r", sink.endpoint, main_block_ids=[0, 1, 2, 3, 4], num_tokens=4 * BLOCK + 3)
        for tokens in (BLOCK + 5, 3 * BLOCK, 4 * BLOCK + 3):  # partial blocks wait for the next chunk
            source.send_all({"r": tokens})
        assert source.wait_finished(["r"], 10)["r"].ok
        sink.wait(["r"], 10)
        stats = sink.counters.stats
    assert [s.nbytes // (256 + 128 + 64 + 8) for s in stats] == [1, 2, 2]  # blocks read per step
    assert _same(dst["l"], src["l"], list(range(10, 15)), [0, 1, 2, 3, 4])


def _reused_slot_layers() -> tuple[dict[str, LayerTensors], dict[str, LayerTensors]]:
    shared = _tensors(True)  # one physical buffer for two logical layers
    return {"l0": shared, "l1": shared}, {"l0": _tensors(False), "l1": _tensors(False)}


def test_slot_gate_holds_a_reused_buffer_until_decode_read_it(kv_port: int) -> None:
    src, dst = _reused_slot_layers()
    endpoint = DecodeEndpoint("127.0.0.1", kv_port, 1)
    with KVSource(src, block_size=BLOCK) as source:
        source.add_request("r", endpoint, main_block_ids=[5], num_tokens=BLOCK)
        source.schedule({"r": BLOCK})
        source.wait_for_layer_send("l0")
        source.layer_ready("l0")  # nobody listens yet: the readiness waits in the queue
        with pytest.raises(GateTimeout):
            source.wait_for_layer_send("l1", timeout=0.3)
        engine = plugins.load_engine("local", "decode")
        listener = plugins.load_channel("zmq").listen(f"tcp://127.0.0.1:{kv_port}")
        sink = Sink(rank=0, tp_size=1, engine=engine, listener=listener,
                    layers={n: layer_layout(t) for n, t in dst.items()})
        sink.expect("r", [7])
        with sink.start():
            source.wait_for_layer_send("l1", timeout=10)  # released by Decode's reply
            assert _same(dst["l0"], src["l0"], [7], [5])


def test_dead_decode_releases_the_compute_path_and_fails_its_request(kv_port: int) -> None:
    """A dead Decode cannot hang Prefill: its slots are released after the reply timeout,
    and the failure goes to the request it held (issue 9 D8), not to the compute path."""
    src, _ = _reused_slot_layers()
    endpoint = DecodeEndpoint("127.0.0.1", kv_port, 1)  # never bound
    with KVSource(src, block_size=BLOCK, reply_timeout=0.5) as source:
        source.add_request("r", endpoint, main_block_ids=[5], num_tokens=BLOCK)
        source.schedule({"r": BLOCK})
        source.layer_ready("l0")
        started = time.monotonic()
        source.wait_for_layer_send("l1", timeout=10)
        assert time.monotonic() - started < 5
        outcome = source.wait_finished(["r"], 5)["r"]
    assert isinstance(outcome.error, ReplyTimeout) and "did not reply" in str(outcome.error)


def test_layout_mismatch_fails_the_layer_and_writes_nothing(kv_port: int) -> None:
    src = {"good": _tensors(True), "bad": _tensors(True, main_bytes=256)}
    dst = {"good": _tensors(False), "bad": _tensors(False, main_bytes=128)}
    with KVSink(dst, kv_port=kv_port) as sink, KVSource(src, block_size=BLOCK) as source:
        sink.expect("r", main_blocks=[3, 4])
        source.add_request("r", sink.endpoint, main_block_ids=[1, 2], num_tokens=2 * BLOCK)
        source.send_all({"r": 2 * BLOCK})
        result = source.wait_finished(["r"], 10)["r"]
        outcome = sink.wait(["r"], 10)["r"]
        assert outcome.state is TerminalState.FAILED
        assert "main" in str(outcome.error) and "layer 'bad'" in str(outcome.error)
    assert result.error is not None and "bad" in str(result.error)
    assert _untouched(dst["bad"])
    assert _same(dst["good"], src["good"], [3, 4], [1, 2])


def test_one_bad_request_fails_alone(kv_port: int) -> None:
    src, dst = {"l": _tensors(True)}, {"l": _tensors(False)}
    with KVSink(dst, kv_port=kv_port) as sink, KVSource(src, block_size=BLOCK) as source:
        sink.expect("good", main_blocks=[10, 11])
        sink.expect("short", main_blocks=[12])  # Decode allocated too few destinations
        for ext_id, ids in (("good", [1, 2]), ("short", [3, 4]), ("unknown", [5, 6])):
            source.add_request(ext_id, sink.endpoint, main_block_ids=ids, num_tokens=2 * BLOCK)
        source.send_all({"good": 2 * BLOCK, "short": 2 * BLOCK, "unknown": 2 * BLOCK})
        results = source.wait_finished(["good", "short", "unknown"], 10)
        outcomes = sink.wait(["good", "short"], 10)
        assert {e: o.state for e, o in outcomes.items()} == {"good": TerminalState.DONE, "short": TerminalState.FAILED}
    assert results["good"].ok
    assert "beyond" in str(results["short"].error) and "not expected" in str(results["unknown"].error)
    assert _same(dst["l"], src["l"], [10, 11], [1, 2])
    assert not dst["l"].main[0][12].any()


def test_restarted_decode_gets_mf_meta_again(kv_port: int) -> None:
    src = {"l": _tensors(True)}
    with KVSource(src, block_size=BLOCK) as source:
        for generation, (ext_id, dst_block) in enumerate((("first", 2), ("second", 6))):
            dst = {"l": _tensors(False)}
            with KVSink(dst, kv_port=kv_port) as sink:
                sink.expect(ext_id, main_blocks=[dst_block])
                source.add_request(ext_id, sink.endpoint, main_block_ids=[generation], num_tokens=BLOCK)
                source.send_all({ext_id: BLOCK})
                result = source.wait_finished([ext_id], 10)[ext_id]
                assert sink.wait([ext_id], 10)[ext_id].ok, result
            assert _same(dst["l"], src["l"], [dst_block], [generation])


def test_aborted_request_is_terminal_and_not_written(kv_port: int) -> None:
    src, dst = {"l": _tensors(True)}, {"l": _tensors(False)}
    with KVSink(dst, kv_port=kv_port) as sink, KVSource(src, block_size=BLOCK) as source:
        sink.expect("r", main_blocks=[8])
        sink.abort("r")
        assert {e: o.state for e, o in sink.take().items()} == {"r": TerminalState.ABORTED}
        source.add_request("r", sink.endpoint, main_block_ids=[1], num_tokens=BLOCK)
        source.send_all({"r": BLOCK})
        assert not source.wait_finished(["r"], 10)["r"].ok
    assert _untouched(dst["l"])


def test_device_memory_is_refused_by_a_host_only_engine_at_once() -> None:
    """A tensor on an accelerator reaches the engine with its device: the local engine (host
    memory only) refuses it when the runtime registers, not with EFAULT at the first read."""
    from rd2h.errors import TransferError
    from rd2h.layout.layers import LayerLayout, TensorLayout

    on_gpu = LayerLayout((TensorLayout(0x7F0000000000, 4096, 8, kind="cuda:0"),))
    with pytest.raises(TransferError, match="cuda:0 memory"):
        KVSource({"l": on_gpu}, block_size=BLOCK)


def test_merge_by_kind_keeps_kinds_apart() -> None:
    from rd2h.interfaces import Region
    from rd2h.layout.regions import merge_by_kind

    merged = merge_by_kind([Region(0, 10), Region(10, 5), Region(0, 8, "cuda:0"), Region(100, 1), Region(8, 8, "cuda:1")])
    assert sorted(merged, key=lambda r: (r.kind, r.addr)) == [
        Region(0, 8, "cuda:0"), Region(8, 8, "cuda:1"), Region(0, 15), Region(100, 1),
    ]
    assert [r.kind for r in sorted(merged, key=lambda r: (r.kind, r.addr))] == ["cuda:0", "cuda:1", "host", "host"]


def test_take_finished_reports_each_request_once(kv_port: int) -> None:
    src, dst = {"l": _tensors(True)}, {"l": _tensors(False)}
    with KVSink(dst, kv_port=kv_port) as sink, KVSource(src, block_size=BLOCK) as source:
        sink.expect("r", main_blocks=[3])
        source.add_request("r", sink.endpoint, main_block_ids=[1], num_tokens=BLOCK)
        assert source.take_finished() == {}  # nothing announced yet
        source.send_all({"r": BLOCK})
        sink.wait(["r"], 10)
        deadline = time.monotonic() + 10
        taken: dict = {}
        while not taken and time.monotonic() < deadline:
            taken = source.take_finished()
            time.sleep(0.01)
        assert list(taken) == ["r"] and taken["r"].ok
        assert source.take_finished() == {}


def test_a_sink_binds_one_address_and_advertises_another(kv_port: int) -> None:
    """KVSink(host=...) binds; advertise_host is what its endpoint names for Prefill."""
    from rd2h.errors import ConfigError

    src, dst = {"l": _tensors(True)}, {"l": _tensors(False)}
    with pytest.raises(ConfigError, match="advertise_host"):
        KVSink(dst, host="0.0.0.0", kv_port=kv_port, channel_options={"allow_insecure": True})
    with KVSink(dst, host="0.0.0.0", advertise_host="127.0.0.1", kv_port=kv_port,
                channel_options={"allow_insecure": True}) as sink, KVSource(src, block_size=BLOCK) as source:
        assert sink.endpoint.host == "127.0.0.1" and sink.address.startswith("tcp://0.0.0.0:")
        sink.expect("r", main_blocks=[3])
        source.add_request("r", sink.endpoint, main_block_ids=[1], num_tokens=BLOCK)
        source.send_all({"r": BLOCK})
        assert sink.wait(["r"], 10)["r"].ok
    assert _same(dst["l"], src["l"], [3], [1])


def test_wait_any_wakes_when_an_outcome_settles_on_either_side(kv_port: int) -> None:
    """What an idle vLLM step waits on: True once some outcome is there (not consumed),
    False after the timeout when none is."""
    from layers import layer_tensors

    src, dst = {"l": layer_tensors(True)}, {"l": layer_tensors(False)}
    with KVSink(dst, kv_port=kv_port) as sink, KVSource(src, block_size=BLOCK) as source:
        sink.expect("r", main_blocks=[5])
        source.add_request("r", sink.endpoint, main_block_ids=[1], num_tokens=BLOCK)
        assert not sink.wait_any(0.0) and not source.wait_any(0.0)
        source.send_all({"r": BLOCK})
        assert source.wait_any(10) and sink.wait_any(10)
        assert sink.take()["r"].ok and source.take_finished()["r"].ok  # still there: not consumed
        assert not sink.wait_any(0.0) and not source.wait_any(0.0)
