"""A Decode that does not read costs Prefill nothing but that Decode's own requests
(rd2h.prefill.send_order): while a write to it blocks, as a send does when the Decode's socket
buffer is full (for up to the channel's send timeout), the layers of another Decode are
announced and its replies handled, and the compute path that announces them does not block.

Before, one lock ordered every write of the Source: the compute thread, blocked writing to the
stopped Decode, held it, so the other Decode heard of no layer and no reply of it was handled
until that write ended.

A real Source and two real Sinks on the memory channel; the dialer blocks every write to one
Decode until the test lets it go (the memory channel never blocks by itself). Events only."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from layers import layer_tensors
from prefill_kit import BLOCK, MemoryNamed, memory_listener

from rd2h import plugins
from rd2h.clock import monotonic
from rd2h.decode.sink import Sink
from rd2h.prefill.source import Source
from rd2h.tensors import LayerTensors, layer_layout
from rd2h.wire.endpoint import DecodeEndpoint

NAMES = ["l0", "l1", "l2"]
POOL = 8
WAIT = 30.0  # a bound on each wait for an event, never a duration the test needs


class _StuckDialer(MemoryNamed):
    """The memory dialer, sending from any thread; every write to ``stuck`` blocks until ``go``,
    as a write to a Decode that stopped reading does once its socket buffer is full."""

    concurrent_send = True

    def __init__(self, stuck: str) -> None:
        super().__init__()
        self.stuck = stuck
        self.blocked, self.go = threading.Event(), threading.Event()

    def send(self, address: str, payload: bytes) -> None:
        if address == self.stuck and not self.go.is_set():
            self.blocked.set()
            assert self.go.wait(WAIT), "the test never let the blocked write go"
        super().send(address, payload)


def _sink(port: int) -> tuple[Sink, dict[str, LayerTensors]]:
    dst = {n: layer_tensors(False, blocks=POOL) for n in NAMES}
    sink = Sink(
        rank=0, tp_size=1, engine=plugins.load_engine("local", "decode"), listener=memory_listener(port),
        layers={n: layer_layout(t) for n, t in dst.items()},
    )
    return sink.start(), dst


@pytest.fixture
def two_decodes(kv_port: int) -> Iterator[tuple[Source, _StuckDialer, list[Sink], list[dict[str, LayerTensors]], dict]]:
    """A Source (inline announce) and two Decodes at ``kv_port`` (stopped: writes to it block)
    and ``kv_port + 1``."""
    src = {n: layer_tensors(True, i + 1, blocks=POOL) for i, n in enumerate(NAMES)}
    stopped = DecodeEndpoint("127.0.0.1", kv_port, 1)
    dialer = _StuckDialer(stopped.address(0))
    source = Source(
        rank=0, tp_size=1, engine=plugins.load_engine("local", "prefill"), dialer=dialer,
        layers={n: layer_layout(t) for n, t in src.items()}, block_size=BLOCK, clock=monotonic, reuse_slots=False,
    ).start()
    sinks, dsts = zip(*(_sink(port) for port in (kv_port, kv_port + 1)))
    try:
        yield source, dialer, list(sinks), list(dsts), src
    finally:
        dialer.go.set()
        for sink in sinks:
            sink.close()
        source.close()


def test_a_decode_whose_writes_block_delays_no_other_decode(two_decodes, kv_port: int) -> None:  # type: ignore[no-untyped-def]
    source, dialer, (stopped, live), (_, live_dst), src = two_decodes
    blocks, dest = [2, 4], [1, 3]
    for sink, ext_id in ((stopped, "a"), (live, "b")):
        sink.expect(ext_id, main_blocks=dest)
    # "a" first: its Decode comes first in every layer's frames
    source.add_request("a", DecodeEndpoint("127.0.0.1", kv_port, 1), main_block_ids=blocks, num_tokens=2 * BLOCK)
    source.add_request("b", DecodeEndpoint("127.0.0.1", kv_port + 1, 1), main_block_ids=blocks, num_tokens=2 * BLOCK)

    def compute() -> None:  # one final step, every layer announced on this thread
        source.schedule({"a": 2 * BLOCK, "b": 2 * BLOCK})
        for name in NAMES:
            source.layer_ready(name)

    thread = threading.Thread(target=compute, name="compute", daemon=True)
    thread.start()
    try:
        assert dialer.blocked.wait(WAIT), "no write to the stopped Decode started"
        outcome = source.wait_finished(["b"], WAIT)["b"]  # every layer of "b" announced, every reply handled
        assert not dialer.go.is_set()  # ... while the write to the stopped Decode still blocks
        assert outcome.ok, outcome.error
        thread.join(WAIT)
        assert not thread.is_alive(), "the compute thread blocked on the stopped Decode"
        assert live.wait(["b"], WAIT)["b"].ok
        for name in NAMES:
            assert (live_dst[name].main[0][dest] == src[name].main[0][blocks]).all()
    finally:
        dialer.go.set()
    # once the stopped Decode reads again, its request completes too, its frames in order
    assert source.wait_finished(["a"], WAIT)["a"].ok
    assert stopped.wait(["a"], WAIT)["a"].ok
