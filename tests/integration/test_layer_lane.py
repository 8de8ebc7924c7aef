"""A step's small layers go down a lane (rd2h.decode.layer_lane): after one clean read, the
step's next layers skip admission and planning. The lane must answer every readiness exactly
as the general path does, and leave for it whatever it cannot vouch for.

A real Sink (local engine, in-memory channel) is fed real readiness frames on this thread,
from tensors of this process read with ``process_vm_readv`` like any peer's."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from rd2h import plugins
from rd2h.api import LayerTensors, host_buffer, layer_layout
from rd2h.decode.layer_lane import MAX_LANE_DESCRIPTORS
from rd2h.decode.sink import Sink
from rd2h.errors import RD2HError
from rd2h.outcome import TerminalState
from rd2h.wire import protocol
from rd2h.wire.layer_metadata import encode_layer_metadata
from rd2h.wire.mf_meta import MfMeta

LAYERS = 12
POOL = 200
ODD = 8  # the layer whose Decode layout disagrees with Prefill's in the comparison


class _Peer:
    """A Sink with this process admitted as its one Prefill peer."""

    def __init__(self, name: str, *, lanes: bool, odd_layer: int | None = None) -> None:
        rng = np.random.default_rng(7)
        self.names = [f"layer.{i}" for i in range(LAYERS)]

        def tensors(fill: bool, main: int = 64) -> LayerTensors:
            main_t, index_t = host_buffer((POOL, main)), host_buffer((POOL, 16))
            if fill:
                main_t[:] = rng.integers(1, 255, main_t.shape, dtype=np.uint8)
                index_t[:] = rng.integers(1, 255, index_t.shape, dtype=np.uint8)
            return LayerTensors(main=[main_t], indexer=index_t)

        self.src = {n: tensors(True) for n in self.names}
        # one Decode layer may disagree with Prefill's (bytes per block): that layer fails
        self.dst = {n: tensors(False, 32 if i == odd_layer else 64) for i, n in enumerate(self.names)}
        self.engine = plugins.load_engine("local", "prefill")
        src = {n: layer_layout(t) for n, t in self.src.items()}
        metadata = self.engine.register([r for layout in src.values() for r in layout.regions()])
        listener = plugins.load_channel("memory").listen(f"memory://lane-{name}")
        self.sink = Sink(rank=0, tp_size=1, engine=plugins.load_engine("local", "decode"), listener=listener,
                         layers={n: layer_layout(t) for n, t in self.dst.items()})
        self.sink._reader.lanes = lanes
        self.dialer = plugins.load_channel("memory").dialer()
        self.dialer.send(listener.address, protocol.encode(MfMeta("lane", encode_layer_metadata(src), engine_metadata=metadata)))
        got = listener.recv(10.0)
        assert got is not None
        self.identity = got[0]
        self.sink._handle(*got)
        assert self.sink._admissions.wait_any(30.0) if self.sink._admissions else True
        self.sink._finish_handshakes()
        assert self.dialer.recv(10.0) is not None  # the ACK

    def ready(self, layer: int, reads: list[protocol.ReadRequest], done: tuple[str, ...] = ()) -> Any:
        """One readiness handled on this thread; Decode's reply, decoded."""
        frame = protocol.encode(protocol.ReadReadyBatch(layer, self.names[layer], tuple(reads), done))
        self.sink._handle(self.identity, frame)
        got = self.dialer.recv(0)
        assert got is not None, f"no reply to layer {layer}"
        return protocol.decode_reply(got[1])

    def settled(self, *done: str) -> None:
        """Prefill's word that ``done`` ended DONE on its side (protocol 4)."""
        self.sink._handle(self.identity, protocol.encode(protocol.Settled(done_ext_ids=done)))

    def close(self) -> None:
        self.sink.close()
        self.dialer.close()
        self.engine.close()


@pytest.fixture
def peers(request: pytest.FixtureRequest) -> Any:
    made: list[_Peer] = []

    def make(**kwargs: Any) -> _Peer:
        made.append(_Peer(f"{request.node.name}-{len(made)}", **kwargs))
        return made[-1]

    yield make
    for peer in made:
        peer.close()


def _request(ext_id: str, src: list[int]) -> protocol.ReadRequest:
    return protocol.ReadRequest(ext_id, src, src, 0, 0)


def test_a_steps_next_small_layers_take_its_lane_and_land_whole(peers: Any) -> None:
    peer = peers(lanes=True)
    src, dst = [3, 9], [20, 4]
    peer.sink.expect("r", dst, deadline=600)
    reads = [_request("r", src)]
    replies = [peer.ready(k, reads, ("r",) if k == LAYERS - 1 else ()) for k in range(LAYERS)]
    assert replies == [protocol.ReadDone(k) for k in range(LAYERS)]
    # the first layer plans the step; the last carries the final signal, so takes the general path
    assert peer.sink.counters.lane_reads == LAYERS - 2
    for name in peer.names:
        for s, d in zip(src, dst):
            assert np.array_equal(peer.dst[name].main[0][d], peer.src[name].main[0][s])
            assert np.array_equal(peer.dst[name].indexer[d], peer.src[name].indexer[s])
    peer.settled("r")
    assert peer.sink.wait(["r"], 10.0)["r"].ok


def test_without_lanes_every_layer_takes_the_general_path(peers: Any) -> None:
    peer = peers(lanes=False)
    peer.sink.expect("r", [1], deadline=600)
    assert [peer.ready(k, [_request("r", [2])]) for k in range(4)] == [protocol.ReadDone(k) for k in range(4)]
    assert peer.sink.counters.lane_reads == 0


def test_a_big_layer_keeps_the_batched_path(peers: Any) -> None:
    peer = peers(lanes=True)
    blocks = MAX_LANE_DESCRIPTORS  # main and indexer: twice as many descriptors as blocks, none adjacent
    peer.sink.expect("big", list(range(0, 2 * blocks, 2)), deadline=600)
    reads = [_request("big", list(range(1, 2 * blocks, 2)))]
    assert [peer.ready(k, reads) for k in range(4)] == [protocol.ReadDone(k) for k in range(4)]
    assert peer.sink.counters.lane_reads == 0


def _script(peer: _Peer) -> list[Any]:
    """Readiness, an abort and a failure between layers, a new step, a layer whose layouts
    disagree (``odd_layer``); every reply, the outcomes and the bytes written, in order."""
    sink, out = peer.sink, []
    sink.expect("a", [1, 2], deadline=600)
    sink.expect("b", [5], deadline=600)
    step = [_request("a", [10, 11]), _request("b", [12])]
    out += [peer.ready(k, step) for k in range(4)]
    sink.abort("b")  # between layers: the next reply names it failed, and its blocks are not written again
    out += [peer.ready(k, step) for k in (4, 5)]
    step = [_request("a", [10, 11])]  # another step: the general path, then its own lane
    out += [peer.ready(k, step) for k in (6, 7, ODD, 9)]  # the odd layer fails it
    sink.expect("d", [8], deadline=600)
    step = [_request("d", [14])]
    out += [peer.ready(k, step) for k in range(3)]
    sink.fail("d", RD2HError("given up on Decode"))
    out += [peer.ready(k, step) for k in (3, 4)]
    sink.expect("c", [7], deadline=600)
    step = [_request("c", [13])]
    out += [peer.ready(k, step, ("c",) if k == ODD - 1 else ()) for k in range(ODD)]  # a final, layers missing
    peer.settled("c")
    outcomes = {e: (o.state, type(o.error).__name__) for e, o in sink.wait(["a", "b", "c", "d"], 10.0).items()}
    written = [peer.dst[n].main[0][[1, 2, 5, 7, 8]].copy() for n in peer.names]
    return [out, outcomes, written]


def _readable(result: list[Any]) -> list[Any]:
    replies, outcomes, written = result
    shown = [r if isinstance(r, protocol.ReadDone) else (type(r).__name__, r.layer_idx, r.failed_ext_ids) for r in replies]
    return [shown, outcomes, [w.tobytes() for w in written]]


def test_the_lane_answers_as_the_general_path_does(peers: Any) -> None:
    with_lanes, without = peers(lanes=True, odd_layer=ODD), peers(lanes=False, odd_layer=ODD)
    got, expected = _script(with_lanes), _script(without)
    assert with_lanes.sink.counters.lane_reads > 0 and without.sink.counters.lane_reads == 0
    assert _readable(got) == _readable(expected)
    replies = got[0]
    assert isinstance(replies[4], protocol.ReadFailed) and replies[4].failed_ext_ids == ("b",)
    assert replies[6:8] == [protocol.ReadDone(6), protocol.ReadDone(7)]
    assert isinstance(replies[8], protocol.ReadFailed) and replies[8].error_kind == "MainBlockLengthMismatch"
    assert got[1] == {"a": (TerminalState.FAILED, "MainBlockLengthMismatch"), "b": (TerminalState.ABORTED, "NoneType"),
                      "c": (TerminalState.FAILED, "BlockRangeError"), "d": (TerminalState.FAILED, "RD2HError")}


def test_an_abort_between_layers_leaves_the_lane(peers: Any) -> None:
    peer = peers(lanes=True)
    peer.sink.expect("r", [1], deadline=600)
    reads = [_request("r", [2])]
    assert peer.ready(0, reads) == protocol.ReadDone(0)
    assert peer.ready(1, reads) == protocol.ReadDone(1)
    assert peer.sink.counters.lane_reads == 1
    peer.sink.abort("r")
    reply = peer.ready(2, reads)  # the tracker would not admit it again: the general path refuses it
    assert isinstance(reply, protocol.ReadFailed) and reply.failed_ext_ids == ("r",)
    assert peer.sink.counters.lane_reads == 1
