"""A Decode restarts while Prefill still holds the old connection: the frames Prefill writes
before it sees the reset are lost, the later ones reach the new Decode, which answers them
"mf_meta required". Prefill pairs a reply with the oldest readiness of its layer, so it must
not let the new Decode's answers to the frames it re-sends stand for the readiness it never
read: every readiness in flight then is sent again after the mf_meta, in order, and the replies
before that mf_meta's ACK are the stale ones.

Before the fix the lost readiness took the MR and was re-sent alone; its READ_DONE was then
paired with the next step's readiness, which the new Decode had only answered MR: that step's
blocks were never read and the final signal failed the request ("main blocks 2..3 were never
announced"), as test_vllm_pd.py's negative control once did after a restart.

A real Source and real Sinks on the memory channel; the test waits on the Source's own
condition (every reply handled), never on time."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from layers import layer_tensors
from prefill_kit import BLOCK, MemoryNamed, memory_listener, memory_source

from rd2h import plugins
from rd2h.clock import monotonic
from rd2h.decode.sink import Sink
from rd2h.prefill.source import Source
from rd2h.tensors import LayerTensors, layer_layout
from rd2h.wire import protocol
from rd2h.wire.endpoint import DecodeEndpoint

NAMES = ["l0", "l1"]
POOL = 16


class _LossyDialer(MemoryNamed):
    """Frames sent while ``lost`` is above zero vanish, as those written into a connection whose
    Decode went away before the kernel said so."""

    def __init__(self) -> None:
        super().__init__()
        self.lost = 0
        self.lost_frames: list[bytes] = []
        self.attempts = 0  # frames sent or lost
        self._tried = threading.Condition()

    def send(self, address: str, payload: bytes) -> None:
        if self.lost > 0:
            self.lost -= 1
            self.lost_frames.append(payload)
        else:
            super().send(address, payload)
        with self._tried:
            self.attempts += 1
            self._tried.notify_all()

    def wait_attempts(self, count: int) -> None:
        """Block until ``count`` frames were sent or lost (the sender thread sends them)."""
        with self._tried:
            assert self._tried.wait_for(lambda: self.attempts >= count, 30), self.attempts


class _Decode:
    """A real Sink on the memory channel, its loop running."""

    def __init__(self, port: int) -> None:
        self.dst = {n: layer_tensors(False, blocks=POOL) for n in NAMES}
        self.endpoint = DecodeEndpoint("127.0.0.1", port, 1)
        self.sink = Sink(
            rank=0, tp_size=1, engine=plugins.load_engine("local", "decode"), listener=memory_listener(port),
            layers={n: layer_layout(t) for n, t in self.dst.items()},
        )
        self.read = threading.Semaphore(0)  # released once per layer read
        self.sink.on_layer = lambda stat: self.read.release()
        self.sink.start()

    def wait_read(self, layers: int) -> None:
        for _ in range(layers):
            assert self.read.acquire(timeout=30), "Decode read fewer layers"


@pytest.fixture
def prefill() -> Iterator[tuple[Source, _LossyDialer, dict[str, LayerTensors]]]:
    src = {n: layer_tensors(True, i + 1, blocks=POOL) for i, n in enumerate(NAMES)}
    dialer = _LossyDialer()
    source = memory_source(src, monotonic, dialer, reuse_slots=False)  # vLLM's paged cache: no slot gate
    try:
        yield source, dialer, src
    finally:
        source.close()


def _step(source: Source, computed: dict[str, int]) -> None:
    source.schedule(computed)
    for name in NAMES:
        source.layer_ready(name)


def test_frames_lost_to_a_restarted_decode_are_sent_again_not_paired_with_later_replies(
    prefill: tuple[Source, _LossyDialer, dict[str, LayerTensors]], kv_port: int
) -> None:
    source, dialer, src = prefill
    first = _Decode(kv_port)
    try:  # Prefill is introduced to the first Decode, which serves a request
        first.sink.expect("warm", main_blocks=[3])
        source.add_request("warm", first.endpoint, main_block_ids=[1], num_tokens=BLOCK)
        _step(source, {"warm": BLOCK})
        assert source.wait_finished(["warm"], 30)["warm"].ok
        assert first.sink.wait(["warm"], 30)["warm"].ok
    finally:
        first.sink.close()
    second = _Decode(kv_port)  # restarted on the same address: it knows nothing of Prefill
    try:
        blocks, dest = [2, 4, 6, 8, 10, 12], [1, 3, 5, 7, 9, 11]
        second.sink.expect("r", main_blocks=dest)
        source.add_request("r", second.endpoint, main_block_ids=blocks, num_tokens=6 * BLOCK)
        dialer.lost = 2  # step 1's two layers go into the dead connection
        _step(source, {"r": 2 * BLOCK})
        dialer.wait_attempts(dialer.attempts + 2)
        assert len(dialer.lost_frames) == 2
        _step(source, {"r": 4 * BLOCK})  # step 2 reaches the new Decode: "mf_meta required"
        second.wait_read(2)  # what Prefill sent again after its mf_meta is being read
        _step(source, {"r": 6 * BLOCK})  # the final step
        prefill_side = source.wait_finished(["r"], 30)["r"]
        decode_side = second.sink.wait(["r"], 30)["r"]
        assert decode_side.ok, decode_side.error
        assert prefill_side.ok, prefill_side.error
        for name in NAMES:  # every block landed, each step's chunk included
            assert (second.dst[name].main[0][dest] == src[name].main[0][blocks]).all()
            assert (second.dst[name].indexer[dest] == src[name].indexer[blocks]).all()
        frames = [protocol.decode(f) for f in dialer.sent]
        assert sum(isinstance(m, protocol.MfMeta) for m in frames) == 2  # once per Decode: not once per MR
    finally:
        second.sink.close()


def test_an_mf_meta_required_while_nothing_was_lost_resends_the_layer_once(
    prefill: tuple[Source, _LossyDialer, dict[str, LayerTensors]], kv_port: int
) -> None:
    """The plain restart (no frame lost): step 1 reaches the new Decode, answered MR, sent
    again once after one mf_meta; nothing is read twice."""
    source, dialer, src = prefill
    first = _Decode(kv_port)
    try:
        first.sink.expect("warm", main_blocks=[3])
        source.add_request("warm", first.endpoint, main_block_ids=[1], num_tokens=BLOCK)
        _step(source, {"warm": BLOCK})
        assert source.wait_finished(["warm"], 30)["warm"].ok
    finally:
        first.sink.close()
    second = _Decode(kv_port)
    try:
        second.sink.expect("r", main_blocks=[1, 3])
        source.add_request("r", second.endpoint, main_block_ids=[2, 4], num_tokens=2 * BLOCK)
        _step(source, {"r": 2 * BLOCK})
        assert source.wait_finished(["r"], 30)["r"].ok
        assert second.sink.wait(["r"], 30)["r"].ok
        layers = [m.layer_idx for m in map(protocol.decode, dialer.sent) if isinstance(m, protocol.ReadReadyBatch)]
        assert layers[-4:] == [0, 1, 0, 1]  # each layer of the step, then each again after one mf_meta
        assert second.sink.counters.layers_read == 2  # the two re-sent ones: the first two were answered MR
    finally:
        second.sink.close()
