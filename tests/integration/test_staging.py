"""Host staging end to end over real zmq sockets and the local engine, with the host stand-in
(rd2h.device.HostStandIn): torch CPU tensors play the device, every copy of the staging path
runs as it would on CUDA or Ascend, and every byte is checked."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

from rd2h import plugins
from rd2h.api import DecodeLanding, KVSink, LayerTensors, PrefillMirror, StagedKVSource, layer_layout
from rd2h.decode.sink import Sink
from rd2h.device import HostStandIn
from rd2h.outcome import TerminalState
from rd2h.prefill.source import DecodeEndpoint
from rd2h.staging.decode_landing import LandingEngine

BLOCK = 16


def device_layers(n: int, blocks: int = 40, seed: int = 0) -> dict[str, LayerTensors]:
    """DeepSeek-like: main K/V (bf16), indexer (fp8 as uint8) and its scale (fp32); random."""
    g = torch.Generator().manual_seed(seed)
    return {
        f"layer.{i}": LayerTensors(
            main=[torch.randn(blocks, BLOCK, 36, generator=g, dtype=torch.float32).to(torch.bfloat16)],
            indexer=torch.randint(1, 255, (blocks, BLOCK, 8), generator=g, dtype=torch.uint8),
            scale=torch.rand(blocks, BLOCK, 1, generator=g),
        )
        for i in range(n)
    }


def zeros_like(layers: dict[str, LayerTensors]) -> dict[str, LayerTensors]:
    return {n: LayerTensors([torch.zeros_like(t.main[0])], torch.zeros_like(t.indexer), torch.zeros_like(t.scale))
            for n, t in layers.items()}  # fmt: skip


def same(dst: LayerTensors, src: LayerTensors, d: list[int], s: list[int]) -> bool:
    return all(torch.equal(a[d], b[s]) for a, b in zip((dst.main[0], dst.indexer, dst.scale),
                                                        (src.main[0], src.indexer, src.scale)))  # fmt: skip


def staged_sink(dst: dict[str, LayerTensors], kv_port: int, capacity: int = 1 << 16, **kw: Any) -> KVSink:
    """The sfa placement: main K/V in host memory (read directly), indexer and scale on the
    "device" (through the landing buffer)."""
    staged = [t for layer in dst.values() for t in (layer.indexer, layer.scale)]
    return KVSink(dst, kv_port=kv_port, landing=DecodeLanding(staged, capacity_bytes=capacity, device=HostStandIn()), **kw)


def test_requests_with_their_own_block_ids_arrive_byte_for_byte_over_more_layers_than_slots(kv_port: int) -> None:
    src, dst = device_layers(5), zeros_like(device_layers(5))
    mirror = PrefillMirror(src, blocks_per_slot=8, slots=2, device=HostStandIn())
    assert mirror.nbytes < sum(t.main[0].nbytes + t.indexer.nbytes + t.scale.nbytes for t in src.values()) / 4
    ids = {"a": ([10, 3, 27], [0, 1, 2]), "b": ([5, 6], [30, 31]), "c": ([39], [12])}  # prefill ids, decode ids
    with staged_sink(dst, kv_port) as sink, StagedKVSource(mirror=mirror, block_size=BLOCK) as source:
        for ext_id, (p, d) in ids.items():
            sink.expect(ext_id, main_blocks=d)
            source.add_request(ext_id, sink.endpoint, main_block_ids=p, num_tokens=len(p) * BLOCK - 3)
        assert source.send_all({e: len(p) * BLOCK - 3 for e, (p, _) in ids.items()}) == {}
        assert all(o.ok for o in source.wait_finished(list(ids), 20).values())
        assert all(o.state is TerminalState.DONE for o in sink.wait(list(ids), 20).values())
    for name in src:
        for p, d in ids.values():
            assert same(dst[name], src[name], d, p), name
        untouched = sorted(set(range(40)) - {b for _, d in ids.values() for b in d})
        assert not dst[name].main[0][untouched].any() and not dst[name].indexer[untouched].any()


def test_chunked_steps_reuse_the_slots_and_a_small_landing_buffer_goes_in_rounds(kv_port: int) -> None:
    src, dst = device_layers(3, seed=1), zeros_like(device_layers(3))
    mirror = PrefillMirror(src, blocks_per_slot=4, slots=2, device=HostStandIn())
    p_ids, d_ids = [1, 9, 17, 25, 33, 2, 8], [7, 6, 5, 4, 3, 2, 1]
    # 8 KiB: a half holds 4 KiB, one layer's indexer and scale for 4 blocks are 2.5 KiB + 1 KiB
    with staged_sink(dst, kv_port, capacity=8192) as sink, StagedKVSource(mirror=mirror, block_size=BLOCK) as source:
        sink.expect("r", main_blocks=d_ids)
        source.add_request("r", sink.endpoint, main_block_ids=p_ids[:3], num_tokens=7 * BLOCK)
        for tokens, more in ((3 * BLOCK, [25, 33, 2]), (6 * BLOCK + 5, [8]), (7 * BLOCK, [])):
            source.extend("r", main_block_ids=more)  # the next chunk's blocks come later, as in vLLM
            assert source.send_all({"r": tokens}) == {}
        assert source.wait_finished(["r"], 20)["r"].ok
        assert sink.wait(["r"], 20)["r"].state is TerminalState.DONE
    for name in src:
        assert same(dst[name], src[name], d_ids, p_ids), name


def test_a_step_that_does_not_fit_a_slot_fails_that_request_and_says_why(kv_port: int) -> None:
    src, dst = device_layers(2), zeros_like(device_layers(2))
    mirror = PrefillMirror(src, blocks_per_slot=3, device=HostStandIn())
    with staged_sink(dst, kv_port, request_timeout=5) as sink, StagedKVSource(mirror=mirror, block_size=BLOCK) as source:
        sink.expect("ok", main_blocks=[0, 1])
        sink.expect("big", main_blocks=[2, 3])
        source.add_request("ok", sink.endpoint, main_block_ids=[4, 5], num_tokens=2 * BLOCK)
        source.add_request("big", sink.endpoint, main_block_ids=[6, 7], num_tokens=2 * BLOCK)
        problems = source.send_all({"ok": 2 * BLOCK, "big": 2 * BLOCK})
        assert "blocks_per_slot" in str(problems["big"])
        out = source.wait_finished(["ok", "big"], 20)
        assert out["ok"].ok and out["big"].state is TerminalState.FAILED
        assert sink.wait(["ok"], 20)["ok"].state is TerminalState.DONE
    assert same(dst["layer.1"], src["layer.1"], [0, 1], [4, 5])


class HeldReads(LandingEngine):
    """Decode's engine, holding the read of one layer's readiness until ``go`` is set."""

    def __init__(self, inner: Any, landing: DecodeLanding) -> None:
        super().__init__(inner, landing)
        self.reads, self.held, self.go = 0, threading.Event(), threading.Event()

    def read_batch(self, session: Any, local: Any, remote: Any, lengths: Any) -> None:
        self.reads += 1
        if self.reads == 1:
            self.held.set()
            assert self.go.wait(30)
        super().read_batch(session, local, remote, lengths)


def test_a_mirror_slot_is_not_refilled_while_decode_still_reads_the_layer_it_holds(kv_port: int) -> None:
    """Layers 0 and 2 share mirror slot 0: while Decode's read of layer 0 is held, Prefill's
    layer 2 waits; refilled early, Decode would read layer 2's bytes as layer 0's."""
    src, dst = device_layers(4, seed=2), zeros_like(device_layers(4))
    mirror = PrefillMirror(src, blocks_per_slot=4, slots=2, device=HostStandIn())
    landing = DecodeLanding([t.indexer for t in dst.values()], device=HostStandIn())
    engine = HeldReads(plugins.load_engine("local", "decode"), landing)
    listener = plugins.load_channel("zmq").listen(f"tcp://127.0.0.1:{kv_port}")
    sink = Sink(rank=0, tp_size=1, engine=engine, listener=listener, layers={n: layer_layout(t) for n, t in dst.items()})

    done_layer2 = threading.Event()
    with sink.start(), StagedKVSource(mirror=mirror, block_size=BLOCK) as source:
        sink.expect("r", main_blocks=[1, 2])
        source.add_request("r", DecodeEndpoint("127.0.0.1", kv_port, 1), main_block_ids=[20, 21], num_tokens=2 * BLOCK)
        source.schedule({"r": 2 * BLOCK})

        def compute() -> None:
            for name in src:
                source.wait_for_layer_send(name)
                source.layer_ready(name)
                if name == "layer.2":
                    done_layer2.set()

        worker = threading.Thread(target=compute)
        worker.start()
        assert engine.held.wait(20)
        assert not done_layer2.wait(1.0)  # waits for Decode's reply to layer 0
        engine.go.set()
        worker.join(20)
        assert source.wait_finished(["r"], 20)["r"].ok
        assert sink.wait(["r"], 20)["r"].state is TerminalState.DONE
    sink.close()
    for name in src:
        assert same(dst[name], src[name], [1, 2], [20, 21]), name


class HeldCopy(HostStandIn):
    """The stand-in, holding the device-to-host copy of one layer until ``go`` is set."""

    def __init__(self, hold: int) -> None:
        self.calls, self.hold = 0, hold
        self.entered, self.go = threading.Event(), threading.Event()

    def gather_to_host(self, stream: Any, src_rows: Any, ids: np.ndarray, dst_rows: Any) -> None:
        self.calls += 1
        if self.calls == self.hold:
            self.entered.set()
            assert self.go.wait(30)
        super().gather_to_host(stream, src_rows, ids, dst_rows)


def test_a_request_aborted_mid_copy_ends_aborted_and_the_others_arrive_intact(kv_port: int) -> None:
    src, dst = device_layers(4, seed=3), zeros_like(device_layers(4))
    device = HeldCopy(hold=2 * 3 + 1)  # three tensors a layer: the first copy of layer 2
    mirror = PrefillMirror(src, blocks_per_slot=8, slots=2, device=device)
    with staged_sink(dst, kv_port) as sink, StagedKVSource(mirror=mirror, block_size=BLOCK) as source:
        sink.expect("keep", main_blocks=[0, 1, 2])
        sink.expect("drop", main_blocks=[3, 4])
        source.add_request("keep", sink.endpoint, main_block_ids=[30, 31, 32], num_tokens=3 * BLOCK)
        source.add_request("drop", sink.endpoint, main_block_ids=[33, 34], num_tokens=2 * BLOCK)
        source.schedule({"keep": 3 * BLOCK, "drop": 2 * BLOCK})
        names = list(src)
        for name in names[:2]:
            source.wait_for_layer_send(name)
            source.layer_ready(name)
        worker = threading.Thread(target=lambda: source.layer_ready(names[2]))
        worker.start()
        assert device.entered.wait(20)
        assert source.abort("drop")
        device.go.set()
        worker.join(20)
        source.wait_for_layer_send(names[3])
        source.layer_ready(names[3])
        out = source.wait_finished(["keep", "drop"], 20)
        assert out["keep"].ok and out["drop"].state is TerminalState.ABORTED
        got = sink.wait(["keep", "drop"], 20)
        assert got["keep"].state is TerminalState.DONE and got["drop"].state is not TerminalState.DONE
    for name in names:
        assert same(dst[name], src[name], [0, 1, 2], [30, 31, 32]), name
    assert not dst[names[3]].main[0][[3, 4]].any()  # announced no more after the abort
