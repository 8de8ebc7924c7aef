"""Issue 19, items 1, 2 and 5 on the Decode runtime: readiness that names a request twice, a
read that breaks in a way nobody foresaw, aborts during and after a request's final read.

Real zmq on loopback, a raw DEALER written by hand (every frame through the real codec), the
real local engine; where a test must act while a read is in flight, the engine is wrapped
to pause in ``read_batch`` until the test lets it go. Each test says what the code before
the fix did.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest
import zmq
from layers import layer_tensors

from rd2h import plugins
from rd2h.api import layer_layout
from rd2h.decode.sink import Sink
from rd2h.errors import DestinationError, ProtocolError, StateError
from rd2h.outcome import TerminalState
from rd2h.wire import protocol
from rd2h.wire.layer_metadata import encode_layer_metadata
from rd2h.wire.mf_meta import MfMeta

LAYERS = ("l0", "l1")
REPLY_MS = 10_000


class _Engine:
    """A real engine; ``read_batch`` pauses until ``go`` once ``pause`` is set, or raises
    ``breaks`` (a defect of the kind no check foresaw)."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self.pause, self.entered, self.go = threading.Event(), threading.Event(), threading.Event()
        self.breaks: BaseException | None = None

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def read_batch(self, session, local, remote, lengths) -> None:
        if self.pause.is_set():
            self.entered.set()
            assert self.go.wait(REPLY_MS / 1000)
        if self.breaks is not None:
            raise self.breaks
        self._inner.read_batch(session, local, remote, lengths)


class Peer:
    """A Prefill written by hand over a raw DEALER: it sends what it is told."""

    def __init__(self, sink: Sink, layouts: dict, metadata: bytes) -> None:
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.connect(sink.address)
        self.sock.send(protocol.encode(MfMeta("hand", encode_layer_metadata(layouts), engine_metadata=metadata)))
        assert self.reply() == protocol.Ack()

    def announce(self, layer: str, reqs: list[tuple[str, list[int], int]], done: tuple[str, ...] = ()) -> None:
        """Announce ``layer`` for ``reqs`` (id, Prefill block ids, destination start)."""
        read_reqs = tuple(protocol.ReadRequest(e, ids, ids, start, start) for e, ids, start in reqs)
        self.sock.send(protocol.encode(protocol.ReadReadyBatch(LAYERS.index(layer), layer, read_reqs, done)))

    def reply(self) -> protocol.Reply:
        assert self.sock.poll(REPLY_MS), "Decode did not reply"
        return protocol.decode_reply(self.sock.recv_multipart()[-1])

    def ready(self, layer: str, reqs: list[tuple[str, list[int], int]], done: tuple[str, ...] = ()) -> protocol.Reply:
        self.announce(layer, reqs, done)
        return self.reply()

    def settled(self, message: protocol.Settled) -> None:
        self.sock.send(protocol.encode(message))

    def close(self) -> None:
        self.context.destroy(linger=0)


@pytest.fixture
def world() -> Iterator[tuple[Sink, Peer, _Engine, dict, dict]]:
    src = {name: layer_tensors(True, seed=i) for i, name in enumerate(LAYERS)}
    dst = {name: layer_tensors(False) for name in LAYERS}
    prefill_engine = plugins.load_engine("local", "prefill")
    layouts = {name: layer_layout(t) for name, t in src.items()}
    metadata = prefill_engine.register([r for lay in layouts.values() for r in lay.regions()])
    engine = _Engine(plugins.load_engine("local", "decode"))
    sink = Sink(
        rank=0, tp_size=1, engine=engine, listener=plugins.load_channel("zmq").listen("tcp://127.0.0.1:0"),
        layers={name: layer_layout(t) for name, t in dst.items()}, poll_seconds=0.02,
    )  # fmt: skip
    with sink:
        peer = Peer(sink, layouts, metadata)
        try:
            yield sink, peer, engine, src, dst
        finally:
            engine.go.set()
            peer.close()
    prefill_engine.close()


def _at_once(call, *args: object) -> object:
    """``call(*args)``'s result; fails if it does not return within 5 s (it used to wait for
    the read, for ever when the read's mark was never cleared)."""
    result: list[object] = []
    thread = threading.Thread(target=lambda: result.append(call(*args)), daemon=True)
    thread.start()
    thread.join(5)
    assert result, f"{call.__name__} did not return"
    return result[0]


def _serves(sink: Sink, peer: Peer, src: dict, dst: dict, block: int) -> None:
    """The rank still serves: a new request into ``block`` is read whole and DONE."""
    sink.expect("next", [block])
    assert isinstance(peer.ready("l0", [("next", [3], 0)]), protocol.ReadDone)
    assert isinstance(peer.ready("l1", [("next", [3], 0)], ("next",)), protocol.ReadDone)
    peer.settled(protocol.Settled(("next",)))
    assert sink.wait(["next"], 10)["next"].state is TerminalState.DONE
    for name in LAYERS:
        assert np.array_equal(dst[name].main[0][block], src[name].main[0][3])


def test_a_request_named_twice_in_one_readiness_fails_on_both_sides_and_frees_its_blocks(world) -> None:
    """One entry in range, one beyond: the reply refused the request, but Decode kept it live
    and marked as being read for ever; abort and fail then blocked without bound, it never
    failed, the sides disagreed and its destination blocks stayed held."""
    sink, peer, _, src, dst = world
    sink.expect("r", [1, 2])
    sink.expect("n", [4])
    reply = peer.ready("l0", [("r", [0], 0), ("n", [5], 0), ("r", [1, 2, 3, 4, 5, 6, 7], 1)])
    assert isinstance(reply, protocol.ReadFailed) and reply.failed_ext_ids == ("r",)  # Prefill fails it
    assert "named twice" in reply.error
    outcome = sink.wait(["r"], 10)["r"]  # before the fix: WaitTimeout
    assert outcome.state is TerminalState.FAILED and isinstance(outcome.error, ProtocolError)
    assert _at_once(sink.abort, "r") is False  # settled: nothing left to abort, nothing waits
    assert not dst["l0"].main[0][[1, 2]].any()  # not read
    assert np.array_equal(dst["l0"].main[0][4], src["l0"].main[0][5])  # its neighbour was
    _serves(sink, peer, src, dst, 2)  # block 2 was r's: released


def test_a_final_signal_named_twice_fails_the_request_and_an_abort_during_that_read_settles(world) -> None:
    """``done_ext_ids`` naming requests twice raised StateError out of the tracker: no reply
    (Prefill waited for its reply_timeout), and a request aborted while that layer was read
    never settled, its blocks held for ever (expiry skips ended requests)."""
    sink, peer, engine, src, dst = world
    sink.expect("r", [1])
    sink.expect("a", [2])
    assert isinstance(peer.ready("l0", [("r", [0], 0), ("a", [1], 0)]), protocol.ReadDone)
    engine.pause.set()
    peer.announce("l1", [("r", [0], 0), ("a", [1], 0)], ("r", "a", "r", "a"))
    assert engine.entered.wait(10)
    assert _at_once(sink.abort, "a") is True  # while the read is still paused
    with pytest.raises(DestinationError, match="held by live request 'a'"):
        sink.expect("b", [2])  # the read may still write it
    engine.pause.clear()
    engine.go.set()
    reply = peer.reply()
    assert isinstance(reply, protocol.ReadFailed) and set(reply.failed_ext_ids) == {"r", "a"}
    outcomes = sink.wait(["r", "a"], 10)
    assert outcomes["r"].state is TerminalState.FAILED and "named 2 times" in str(outcomes["r"].error)
    assert outcomes["a"].state is TerminalState.ABORTED
    _serves(sink, peer, src, dst, 2)  # block 2 was a's: released


def test_an_unforeseen_error_in_a_read_fails_what_the_readiness_named_and_the_rank_serves_on(world) -> None:
    """A read that raised something other than an rd2h error (a defect) escaped the handler:
    no reply, and the requests stayed marked as read, held for ever."""
    sink, peer, engine, src, dst = world
    sink.expect("r", [1])
    engine.breaks = ZeroDivisionError("a defect")
    reply = peer.ready("l0", [("r", [0], 0), ("ghost", [1], 0)])
    assert isinstance(reply, protocol.ReadFailed) and set(reply.failed_ext_ids) == {"r", "ghost"}
    outcome = sink.wait(["r"], 10)["r"]
    assert outcome.state is TerminalState.FAILED and "ZeroDivisionError" in str(outcome.error)
    engine.breaks = None
    _serves(sink, peer, src, dst, 1)


def test_an_abort_during_the_final_read_fails_it_on_both_sides(world) -> None:
    """The abort landed while the final layer was read: the reply said READ_DONE, so Prefill
    reported DONE against Decode's ABORTED."""
    sink, peer, engine, _, _ = world
    sink.expect("r", [1])
    assert isinstance(peer.ready("l0", [("r", [0], 0)]), protocol.ReadDone)
    engine.pause.set()
    peer.announce("l1", [("r", [0], 0)], ("r",))
    assert engine.entered.wait(10)
    assert _at_once(sink.abort, "r") is True
    engine.go.set()
    reply = peer.reply()
    assert isinstance(reply, protocol.ReadFailed) and reply.failed_ext_ids == ("r",)
    assert isinstance(reply.exception(), StateError) and "aborted on Decode" in reply.error
    assert sink.wait(["r"], 10)["r"].state is TerminalState.ABORTED


@pytest.mark.parametrize("prefill_says", ["done", "failed"])
def test_an_abort_after_the_final_layer_was_answered_ends_as_prefill_says(world, prefill_says: str) -> None:
    """Issue 19, item 5: READ_DONE answered the final layer, so Prefill reports DONE; the
    caller's abort then made Decode report ABORTED. It changes nothing now: the request ends
    as Prefill confirms it, and its blocks stay held until then."""
    sink, peer, _, src, dst = world
    sink.expect("r", [1])
    assert isinstance(peer.ready("l0", [("r", [0], 0)]), protocol.ReadDone)
    assert isinstance(peer.ready("l1", [("r", [0], 0)], ("r",)), protocol.ReadDone)
    assert sink.abort("r") is True
    assert sink.take() == {}
    with pytest.raises(DestinationError):
        sink.expect("s", [1])
    if prefill_says == "done":
        peer.settled(protocol.Settled(("r",)))
    else:
        peer.settled(protocol.Settled.failure(["r"], StateError("aborted on Prefill")))
    outcome = sink.wait(["r"], 10)["r"]
    assert outcome.state is (TerminalState.DONE if prefill_says == "done" else TerminalState.FAILED)
    if outcome.ok:
        for name in LAYERS:
            assert np.array_equal(dst[name].main[0][1], src[name].main[0][0])
