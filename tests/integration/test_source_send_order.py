"""What a Prefill records in its send tracker reaches the dialer in that order, whichever thread
writes it (rd2h.prefill.send_order).

A restarted Decode answers "mf_meta required" (MR); Prefill then sends every readiness in flight
to it again after one mf_meta. The compute thread records a layer's readiness, then writes it:
were an MR handled between the two, the readiness would be sent again AND its original write
would come after the new mf_meta, so Decode would read the layer twice and answer it twice, the
extra answer standing for a later readiness of the layer that Decode has not read. A send that
raises in the middle of that resend must fail every readiness it did not write, not only one.

A real Source and a real Sink on the memory channel; the interleaving is made with events: the
dialer holds the Decode's replies back and pauses one write until the other thread has either
written its resend (the race) or waits for its turn to (the fix). No sleeps."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator

import pytest
from layers import layer_tensors
from prefill_kit import BLOCK, MemoryNamed, memory_listener

from rd2h import plugins
from rd2h.clock import monotonic
from rd2h.decode.sink import Sink
from rd2h.errors import ChannelError
from rd2h.prefill.source import Source
from rd2h.tensors import LayerTensors, layer_layout
from rd2h.wire import protocol
from rd2h.wire.endpoint import DecodeEndpoint

NAMES = ["l0", "l1"]
POOL = 8
WAIT = 30.0  # a bound on each wait for an event, never a duration the test needs


class _Dialer(MemoryNamed):
    """The memory dialer, sending from any thread (so the compute thread announces inline), with
    three controls: replies are held back while ``holding``; the first write of a layer-1
    readiness after ``pause_layer1`` waits for ``go``; the next mf_meta after ``fail_meta`` raises."""

    concurrent_send = True

    def __init__(self) -> None:
        super().__init__()
        self.cond = threading.Condition()
        self.holding = False
        self.held: deque[tuple[str, bytes]] = deque()
        self.pause_layer1 = False
        self.paused, self.go = threading.Event(), threading.Event()
        self.fail_meta = False
        self.turn_waited = False  # a thread waited for the Source's turn while a write was paused (_WatchedTurn)

    def send(self, address: str, payload: bytes) -> None:
        message = protocol.decode(payload)
        with self.cond:
            pause = self.pause_layer1 and isinstance(message, protocol.ReadReadyBatch) and message.layer_idx == 1
            fail = self.fail_meta and isinstance(message, protocol.MfMeta)
            self.pause_layer1 = self.pause_layer1 and not pause
            self.fail_meta = self.fail_meta and not fail
        if fail:
            raise ChannelError("connection reset")
        if pause:
            with self.cond:
                self.turn_waited = False
            self.paused.set()
            assert self.go.wait(WAIT), "the test never let the paused write go"
        super().send(address, payload)
        with self.cond:
            self.cond.notify_all()

    def recv(self, timeout: float) -> tuple[str, bytes] | None:
        with self.cond:
            item = None if self.holding or not self.held else self.held.popleft()
        if item is None:
            item = super().recv(timeout)
            with self.cond:
                if item is not None and (self.holding or self.held):  # later replies queue behind held ones
                    self.held.append(item)
                    item = None
        return item

    def release_replies(self) -> None:
        with self.cond:
            self.holding = False
        self.wakeup()  # the sender thread may wait in recv

    def frames(self) -> list[protocol.Message]:
        with self.cond:
            return [protocol.decode(f) for f in self.sent]


class _WatchedTurn:
    """The Source's turn lock, telling the dialer when a thread has to wait for it."""

    def __init__(self, dialer: _Dialer) -> None:
        self._lock, self._dialer = threading.Lock(), dialer

    def __enter__(self) -> None:
        if not self._lock.acquire(blocking=False):
            with self._dialer.cond:
                self._dialer.turn_waited = True
                self._dialer.cond.notify_all()
            self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def _sink(port: int) -> tuple[Sink, dict[str, LayerTensors]]:
    dst = {n: layer_tensors(False, blocks=POOL) for n in NAMES}
    sink = Sink(
        rank=0, tp_size=1, engine=plugins.load_engine("local", "decode"), listener=memory_listener(port),
        layers={n: layer_layout(t) for n, t in dst.items()},
    )
    return sink.start(), dst


@pytest.fixture
def restarted(kv_port: int) -> Iterator[tuple[Source, _Dialer, Sink, dict[str, LayerTensors], dict[str, LayerTensors]]]:
    """A Source introduced to a Decode that then restarted on the same address (it knows no
    Prefill): the Source, its dialer, the new Sink and both sides' tensors."""
    src = {n: layer_tensors(True, i + 1, blocks=POOL) for i, n in enumerate(NAMES)}
    dialer = _Dialer()
    source = Source(
        rank=0, tp_size=1, engine=plugins.load_engine("local", "prefill"), dialer=dialer,
        layers={n: layer_layout(t) for n, t in src.items()}, block_size=BLOCK, clock=monotonic, reuse_slots=False,
    )
    source._sends.turn = _WatchedTurn(dialer)  # the Source orders its writes by turns: watch who waits for one
    source.start()
    first, _ = _sink(kv_port)
    try:
        first.expect("warm", main_blocks=[3])
        source.add_request("warm", DecodeEndpoint("127.0.0.1", kv_port, 1), main_block_ids=[1], num_tokens=BLOCK)
        source.send_all({"warm": BLOCK})
        assert source.wait_finished(["warm"], WAIT)["warm"].ok
    finally:
        first.close()
    second, dst = _sink(kv_port)
    try:
        yield source, dialer, second, src, dst
    finally:
        second.close()
        source.close()


def _announce(source: Source, ext_id: str) -> None:
    """One final step of ``ext_id``, every layer announced on this thread (inline)."""
    source.schedule({ext_id: 2 * BLOCK})
    for name in NAMES:
        source.layer_ready(name)


def test_a_readiness_recorded_before_an_mr_is_handled_is_written_before_the_resend(
    restarted: tuple[Source, _Dialer, Sink, dict[str, LayerTensors], dict[str, LayerTensors]], kv_port: int
) -> None:
    """The compute thread records layer 1's readiness; its write pauses; the sender thread gets
    the MR for layer 0. Without turns the MR's resend (mf_meta, l0, l1) went out first and the
    paused original l1 after it: l1 was written twice after the mf_meta, and Decode read it twice."""
    source, dialer, sink, src, dst = restarted
    blocks, dest = [2, 4], [1, 3]
    sink.expect("r", main_blocks=dest)
    source.add_request("r", DecodeEndpoint("127.0.0.1", kv_port, 1), main_block_ids=blocks, num_tokens=2 * BLOCK)
    with dialer.cond:
        dialer.holding, dialer.pause_layer1 = True, True
        metas_before = sum(isinstance(m, protocol.MfMeta) for m in map(protocol.decode, dialer.sent))
    compute = threading.Thread(target=_announce, args=(source, "r"), name="compute")
    compute.start()
    try:
        assert dialer.paused.wait(WAIT), "layer 1's write never started"
        dialer.release_replies()  # the MR for layer 0 reaches the sender thread now

        def resent_or_waiting() -> bool:
            metas = [i for i, f in enumerate(dialer.sent) if isinstance(protocol.decode(f), protocol.MfMeta)]
            resent = len(metas) > metas_before and any(
                isinstance(m := protocol.decode(f), protocol.ReadReadyBatch) and m.layer_idx == 1
                for f in dialer.sent[metas[-1] :]
            )
            return resent or dialer.turn_waited

        with dialer.cond:
            assert dialer.cond.wait_for(resent_or_waiting, WAIT), "the MR was neither handled nor waiting"
    finally:
        dialer.go.set()
        compute.join(WAIT)
    assert not compute.is_alive()
    prefill_side = source.wait_finished(["r"], WAIT)["r"]
    decode_side = sink.wait(["r"], WAIT)["r"]
    assert prefill_side.ok, prefill_side.error
    assert decode_side.ok, decode_side.error
    frames = dialer.frames()
    last_meta = max(i for i, m in enumerate(frames) if isinstance(m, protocol.MfMeta))
    layers_after = [m.layer_idx for m in frames[last_meta:] if isinstance(m, protocol.ReadReadyBatch)]
    assert layers_after == [0, 1], f"readiness written after the last mf_meta: {layers_after}"
    assert sum(isinstance(m, protocol.MfMeta) for m in frames) == metas_before + 1  # one mf_meta per MR
    for name in NAMES:
        assert (dst[name].main[0][dest] == src[name].main[0][blocks]).all()


def test_a_send_that_raises_in_a_resend_fails_every_readiness_it_did_not_write(
    restarted: tuple[Source, _Dialer, Sink, dict[str, LayerTensors], dict[str, LayerTensors]], kv_port: int
) -> None:
    """The MR's resend is (mf_meta, l0, l1); the mf_meta's send raises. Both readiness were not
    written: both must leave the tracker (the request fails now, its slots released). Before, only
    layer 0's was reported and layer 1's waited for a reply that could not come (reply_timeout),
    or took the reply to a later readiness of the layer."""
    source, dialer, sink, _, _ = restarted
    sink.expect("r", main_blocks=[1, 3])
    source.add_request("r", DecodeEndpoint("127.0.0.1", kv_port, 1), main_block_ids=[2, 4], num_tokens=2 * BLOCK)
    with dialer.cond:
        dialer.holding, dialer.fail_meta = True, True
    _announce(source, "r")  # both layers written; their MRs held back
    dialer.release_replies()
    outcome = source.wait_finished(["r"], 10.0)["r"]  # before: still waiting for layer 1 (reply_timeout 30 s)
    assert not outcome.ok and isinstance(outcome.error, ChannelError), outcome.error
