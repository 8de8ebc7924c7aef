"""The Decode runtime against a hand-written Prefill peer: raw protocol messages through the
real codec, the real local engine, the in-memory channel and a manual clock, so nothing
here sleeps to synchronise. The legacy peer runs over real zmq against a live KVSink."""

from __future__ import annotations

import numpy as np
import pytest
import zmq
from layers import layer_tensors

from rd2h import plugins
from rd2h.api import KVSink, layer_layout
from rd2h.cli.peer import PeerProcess
from rd2h.clock import ManualClock
from rd2h.decode.sink import Sink
from rd2h.errors import DeadlineExceeded, IncompatiblePeerError, PeerGoneError, StateError, UnknownRequestError
from rd2h.layout.layers import LayerLayout, TensorLayout
from rd2h.outcome import TerminalState
from rd2h.wire import protocol
from rd2h.wire.layer_metadata import encode_layer_metadata
from rd2h.wire.mf_meta import MetaForm, MfMeta

LAYERS = ("l0", "l1")


class HandPeer:
    """A Prefill written by hand: it sends what it is told and reads the one reply."""

    def __init__(self, address: str, layers: dict[str, LayerLayout], engine_metadata: bytes, p_session: str = "hand") -> None:
        self.address = address
        self.layers = layers
        self.engine_metadata = engine_metadata
        self.p_session = p_session
        self.dialer = plugins.load_channel("memory").dialer()

    def send(self, message: protocol.Message) -> None:
        self.dialer.send(self.address, protocol.encode(message))

    def introduce(self, **fields: object) -> None:
        self.send(MfMeta(self.p_session, encode_layer_metadata(self.layers), engine_metadata=self.engine_metadata, **fields))

    def ready(
        self, layer: str, reqs: list[tuple[str, list[int], int]], done: tuple[str, ...] = (), confirm: bool = True
    ) -> protocol.Reply:
        """Announce ``layer`` for ``reqs`` (id, Prefill block ids, destination start); the reply.
        With ``confirm``, then say that the ``done`` requests the reply names as read are done
        (``settled``), as a Prefill of protocol 4 does."""
        read_reqs = tuple(protocol.ReadRequest(e, ids, ids, start, start) for e, ids, start in reqs)
        self.send(protocol.ReadReadyBatch(LAYERS.index(layer), layer, read_reqs, done))
        reply = self.reply()
        confirmed = protocol.read_ok(reply, done) if confirm else ()
        if confirmed:
            self.send(protocol.Settled(confirmed))
        return reply

    def reply(self) -> protocol.Reply:
        got = self.dialer.recv(10.0)
        assert got is not None, "Decode did not reply within 10 s"
        reply = protocol.decode_reply(got[1])
        if isinstance(reply, protocol.Ack):
            return self.reply()
        return reply

    def close(self) -> None:
        self.dialer.close()


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def world(clock: ManualClock, request: pytest.FixtureRequest):
    """A started Sink on memory://, the source tensors in this process, their engine, a peer."""
    src = {name: layer_tensors(True, seed=i) for i, name in enumerate(LAYERS)}
    dst = {name: layer_tensors(False) for name in LAYERS}
    engine = plugins.load_engine("local", "prefill")
    src_layouts = {name: layer_layout(t) for name, t in src.items()}
    metadata = engine.register([r for layout in src_layouts.values() for r in layout.regions()])
    listener = plugins.load_channel("memory").listen(f"memory://sink-{request.node.name}")
    sink = Sink(
        rank=0, tp_size=1, engine=plugins.load_engine("local", "decode"), listener=listener,
        layers={name: layer_layout(t) for name, t in dst.items()}, clock=clock, poll_seconds=0.02,
    )
    peer = HandPeer(listener.address, src_layouts, metadata)
    with sink:
        yield sink, peer, src, dst
    peer.close()
    engine.close()


def test_a_request_past_its_deadline_fails_without_waiting_for_it(world, clock: ManualClock) -> None:
    """Defect 6: Decode never gave up on a request whose Prefill stopped announcing."""
    sink, peer, _, _ = world
    sink.expect("r", [1, 2], deadline=5.0)
    peer.introduce()
    assert isinstance(peer.ready("l0", [("r", [0, 1], 0)]), protocol.ReadDone)
    clock.advance(5.0)
    outcome = sink.wait(["r"], 10)["r"]
    assert outcome.state is TerminalState.FAILED and isinstance(outcome.error, DeadlineExceeded)
    assert outcome.seconds == 5.0 and outcome.nbytes == 2 * (64 + 16)


def test_a_refused_handshake_sends_its_reason_and_fails_the_request_on_both_sides(world) -> None:
    """Defect 3: on a version mismatch Prefill only saw "mf_meta required" and Decode's
    request waited for ever."""
    sink, peer, _, _ = world
    sink.expect("r", [1])
    peer.introduce(protocol_version=99)
    reply = peer.ready("l0", [("r", [0], 0)])
    assert isinstance(reply, protocol.ReadFailed) and not reply.needs_meta
    assert reply.failed_ext_ids == ("r",) and isinstance(reply.exception(), IncompatiblePeerError)
    assert "protocol 99" in reply.error
    outcome = sink.wait(["r"], 10)["r"]
    assert isinstance(outcome.error, IncompatiblePeerError)


def test_an_old_rd2h_peer_is_told_to_upgrade(world) -> None:
    sink, peer, _, _ = world
    sink.expect("r", [1])
    peer.send(MfMeta("old", encode_layer_metadata(peer.layers), 2, 2, peer.engine_metadata, form=MetaForm.RD2H_V2, reference_version=1))
    reply = peer.ready("l0", [("r", [0], 0)])
    assert isinstance(reply.exception(), IncompatiblePeerError) and "upgrade" in reply.error.lower()


def test_a_readiness_before_expect_fails_the_late_expect(world) -> None:
    """Defect 6: a readiness that came before expect (a rendezvous race) was refused, and the
    request then waited for bytes Prefill would never send again."""
    sink, peer, _, _ = world
    peer.introduce()
    reply = peer.ready("l0", [("r", [0], 0)], done=("r",))
    assert isinstance(reply.exception(), UnknownRequestError)
    sink.expect("r", [1])
    outcome = sink.wait(["r"], 1)["r"]
    assert outcome.state is TerminalState.FAILED and "rendezvous race" in str(outcome.error)


def test_a_settled_request_named_again_fails_alone(world) -> None:
    """Defect 1: a readiness naming a DONE-but-untaken request raised inside the sink; its
    batch neighbours stayed RECEIVING and Prefill heard the wrong reason."""
    sink, peer, src, dst = world
    sink.expect("first", [1])
    peer.introduce()
    for layer in LAYERS:
        assert isinstance(peer.ready(layer, [("first", [4], 0)], ("first",) if layer == "l1" else ()), protocol.ReadDone)
    sink.expect("second", [2])
    replies = [peer.ready(layer, [("first", [4], 0), ("second", [5], 0)], ("first", "second") if layer == "l1" else ()) for layer in LAYERS]
    assert all(r.failed_ext_ids == ("first",) for r in replies)
    assert isinstance(replies[0].exception(), StateError) and "already finished" in replies[0].error
    outcomes = sink.wait(["first", "second"], 10)
    assert outcomes["first"].ok and outcomes["second"].ok
    for layer in LAYERS:
        assert np.array_equal(dst[layer].main[0][2], src[layer].main[0][5])


def test_a_dead_prefill_fails_what_it_announced(clock: ManualClock, request: pytest.FixtureRequest) -> None:
    """Defect 6: a Prefill killed after Decode's expect left the request RECEIVING for ever."""
    dst = {name: layer_tensors(False, blocks=4, main_bytes=4096, indexer_bytes=4096) for name in LAYERS}
    listener = plugins.load_channel("memory").listen(f"memory://sink-{request.node.name}")
    sink = Sink(
        rank=0, tp_size=1, engine=plugins.load_engine("local", "decode"), listener=listener,
        layers={name: layer_layout(t) for name, t in dst.items()}, clock=clock, poll_seconds=0.02,
        liveness_seconds=0.05,
    )
    with sink, PeerProcess("local", sizes=[8 * 4096, 8 * 4096], seed=3) as prefill:
        (main_addr, _), (index_addr, _) = prefill.regions
        layout = LayerLayout((TensorLayout(main_addr, 4096, 8),), TensorLayout(index_addr, 4096, 8))
        peer = HandPeer(listener.address, dict.fromkeys(LAYERS, layout), prefill.metadata, prefill.session_id)
        sink.expect("r", [0, 1])
        peer.introduce()
        assert isinstance(peer.ready("l0", [("r", [2, 3], 0)]), protocol.ReadDone)
        assert np.array_equal(dst["l0"].main[0][0], prefill.expected(0)[2 * 4096 : 3 * 4096])
        prefill.kill()
        outcome = sink.wait(["r"], 30)["r"]  # found by the liveness check, not by a deadline
        assert isinstance(outcome.error, PeerGoneError)
        peer.close()


def test_wait_consumes_and_abort_of_a_collected_id_reports_nothing(world) -> None:
    """Defect 7: wait did not consume, so expecting the id again raised; abort of an unknown
    or collected id created a record that was reported again."""
    sink, peer, _, _ = world
    sink.expect("r", [1])
    assert sink.abort("r") is True
    assert sink.wait(["r"], 1)["r"].state is TerminalState.ABORTED
    assert sink.abort("r") is False and sink.abort("never") is False
    assert sink.take() == {}
    sink.expect("r", [1])  # the id is free again
    with pytest.raises(UnknownRequestError):
        sink.wait(["never"], 1)


def test_a_legacy_peer_against_a_live_kvsink_gets_a_clear_refusal(kv_port: int) -> None:
    """Defect 4: accept_legacy=True could accept no reference-shaped peer (its 3-field mf_meta
    has no engine blob, which the local engine refused without a word to the peer). The local
    engine cannot connect from a session id alone: the refusal, naming why, reaches the peer."""
    dst = {"l0": layer_tensors(False)}
    with KVSink(dst, kv_port=kv_port, accept_legacy=True) as sink:
        sink.expect("r", [1])
        socket = zmq.Context.instance().socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(f"tcp://127.0.0.1:{kv_port}")
        try:
            layers = {"l0": LayerLayout((TensorLayout(0x10000, 64, 8),), TensorLayout(0x20000, 16, 8))}
            socket.send(protocol.encode(MfMeta.reference("10.0.0.1:11000", encode_layer_metadata(layers))))
            socket.send(protocol.encode(protocol.ReadReadyBatch(0, "l0", (protocol.ReadRequest("r", (0,), (0,)),), ("r",))))
            assert socket.poll(10_000), "no reply from Decode"
            reply = protocol.decode_reply(socket.recv_multipart()[-1])
        finally:
            socket.close()
        assert isinstance(reply, protocol.ReadFailed) and reply.failed_ext_ids == ("r",)
        assert isinstance(reply.exception(), IncompatiblePeerError) and "local" in reply.error
        assert isinstance(sink.wait(["r"], 10)["r"].error, IncompatiblePeerError)


def test_every_reply_goes_out_after_the_tracker_recorded_the_read(world) -> None:
    """Replies follow the bookkeeping, with or without a final signal: answering a non-final
    layer first was measured slower on 2 cores (docs/performance.md, section 3)."""
    sink, peer, src, dst = world
    order: list[str] = []
    on_read, send = sink._tracker.on_read, sink._listener.send

    def recording_on_read(*args: object, **kwargs: object):
        order.append("recorded")
        return on_read(*args, **kwargs)

    def recording_send(identity: bytes, frame: bytes) -> None:
        if isinstance(protocol.decode_reply(frame), (protocol.ReadDone, protocol.ReadFailed)):
            order.append("replied")
        send(identity, frame)

    sink._tracker.on_read = recording_on_read
    sink._listener.send = recording_send
    sink.expect("r", [1, 2])
    peer.introduce()
    assert isinstance(peer.ready("l0", [("r", [0, 1], 0)]), protocol.ReadDone)
    assert isinstance(peer.ready("l1", [("r", [0, 1], 0)], done=("r",)), protocol.ReadDone)
    assert sink.wait(["r"], 10)["r"].state is TerminalState.DONE
    assert order == ["recorded", "replied", "recorded", "replied"]
    assert np.array_equal(dst["l1"].main[0][[1, 2]], src["l1"].main[0][[0, 1]])
