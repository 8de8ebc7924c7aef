"""Faults on the wire against a live KVSink over zmq loopback: every layout mismatch class,
out-of-range and overlapping blocks, an oversized frame, unauthenticated and wrongly
authenticated peers. Decode runs in this process (its loop thread, real sockets, the local
engine); the peers are a real KVSource or a raw zmq DEALER that sends hand-built frames
through the real codec.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import zmq
import zmq.auth

from rd2h import plugins
from rd2h.api import KVSink, KVSource, LayerTensors, layer_layout
from rd2h.errors import DestinationError
from rd2h.outcome import TerminalState
from rd2h.wire import protocol
from rd2h.wire.layer_metadata import encode_layer_metadata
from rd2h.wire.mf_meta import MfMeta

pytestmark = pytest.mark.faults

BLOCK = 16
NB = 16  # blocks per tensor


def _tensors(fill: bool, *, main: tuple[int, ...] = (128, 32), indexer: int | None = 32,
             scale: int | None = 8, seed: int = 0) -> LayerTensors:
    rng = np.random.default_rng(seed)

    def make(width: int) -> np.ndarray:
        return rng.integers(1, 255, (NB, width), np.uint8) if fill else np.zeros((NB, width), np.uint8)

    return LayerTensors(
        main=[make(w) for w in main],
        indexer=None if indexer is None else make(indexer),
        scale=None if scale is None else make(scale),
    )


def _untouched(dst: LayerTensors) -> bool:
    arrays = [*dst.main, dst.indexer, dst.scale]
    return not any(np.asarray(a).any() for a in arrays if a is not None)


def _torch_layer(dtype_name: str, fill: bool) -> LayerTensors:
    torch = pytest.importorskip("torch")
    dtype = getattr(torch, dtype_name)
    make = (lambda w: torch.ones(NB, w, dtype=dtype)) if fill else (lambda w: torch.zeros(NB, w, dtype=dtype))
    return LayerTensors(main=[make(64), make(16)], indexer=make(16), scale=make(4))


MISMATCHES = {
    "MainTensorCountMismatch": {"main": (128,)},
    "MainBlockLengthMismatch": {"main": (128, 16)},
    "IndexerPresenceMismatch": {"indexer": None, "scale": None},  # a scale follows an indexer
    "IndexerBlockLengthMismatch": {"indexer": 64},
    "ScalePresenceMismatch": {"scale": None},
    "ScaleLayoutMismatch": {"scale": 16},
    "LayoutTagMismatch": None,  # float16 against bfloat16: the same bytes per block
}


@pytest.mark.parametrize("kind", list(MISMATCHES))
def test_every_layout_mismatch_fails_the_request_on_both_sides_and_writes_nothing(kv_port: int, kind: str) -> None:
    """A layer whose layouts differ fails the request with the class that names the
    difference, on Decode and (through READ_FAILED) on Prefill; no byte of it is written,
    and a layer that matches beside it is read."""
    if MISMATCHES[kind] is None:
        src = {"good": _tensors(True), "bad": _torch_layer("float16", True)}
        dst = {"good": _tensors(False), "bad": _torch_layer("bfloat16", False)}
    else:
        src = {"good": _tensors(True), "bad": _tensors(True, seed=1)}
        dst = {"good": _tensors(False), "bad": _tensors(False, **MISMATCHES[kind])}
    with KVSink(dst, kv_port=kv_port) as sink, KVSource(src, block_size=BLOCK, reply_timeout=10) as source:
        sink.expect("r", main_blocks=[3, 4])
        source.add_request("r", sink.endpoint, main_block_ids=[1, 2], num_tokens=2 * BLOCK)
        source.send_all({"r": 2 * BLOCK})
        on_prefill = source.wait_finished(["r"], 10)["r"]
        on_decode = sink.wait(["r"], 10)["r"]
    assert on_decode.state is TerminalState.FAILED and type(on_decode.error).__name__ == kind, on_decode
    assert on_prefill.state is TerminalState.FAILED and type(on_prefill.error).__name__ == kind, on_prefill
    assert "'bad'" in str(on_decode.error)
    bad = dst["bad"]
    assert not any(bool((t != 0).any()) for t in (*bad.main, bad.indexer, bad.scale) if t is not None)
    assert np.array_equal(dst["good"].main[0][[3, 4]], src["good"].main[0][[1, 2]])


def test_destinations_out_of_range_repeated_or_overlapping_are_refused_at_expect(kv_port: int) -> None:
    dst = {"l": _tensors(False)}
    with KVSink(dst, kv_port=kv_port) as sink:
        sink.expect("a", main_blocks=[2, 3, 4])
        for blocks, match in (([NB], "outside|range"), ([-1], "outside|range|negative"),
                              ([5, 5], "given twice"), ([4, 6], "held by live request 'a'")):
            with pytest.raises(DestinationError, match=match):
                sink.expect("b", main_blocks=blocks)
        sink.abort("a")
        sink.take()
        sink.expect("b", main_blocks=[4, 6])  # free once 'a' settled


class RawPeer:
    """A Prefill written by hand over a real zmq DEALER: its memory is registered with the
    real local engine in this process, its frames go through the real codec."""

    def __init__(self, address: str, layers: dict[str, LayerTensors]) -> None:
        self.layouts = {name: layer_layout(t) for name, t in layers.items()}
        self.engine = plugins.load_engine("local", "prefill")
        self.metadata = self.engine.register([r for lay in self.layouts.values() for r in lay.regions()])
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)

    def send(self, payload: bytes) -> None:
        self.socket.send(payload)

    def introduce(self) -> None:
        self.send(protocol.encode(MfMeta(
            self.engine.session_id, encode_layer_metadata(self.layouts), engine_metadata=self.metadata
        )))
        assert self.recv() == protocol.ACK_FRAME

    def recv(self, timeout: float = 10.0) -> bytes:
        assert self.socket.poll(int(timeout * 1000)), f"Decode did not reply within {timeout} s"
        return [f for f in self.socket.recv_multipart() if f][-1]  # Decode sends (b"", payload)

    def ready(self, layer_idx: int, name: str, reqs: list[tuple[str, list[int], int]], done: tuple[str, ...]) -> protocol.Reply:
        """Announce a layer; the reply. Then, as a Prefill of protocol 4 does, say that the
        ``done`` requests the reply names as read are done."""
        read_reqs = tuple(protocol.ReadRequest(e, ids, ids, start, start) for e, ids, start in reqs)
        self.send(protocol.encode(protocol.ReadReadyBatch(layer_idx, name, read_reqs, done)))
        reply = protocol.decode_reply(self.recv())
        confirmed = protocol.read_ok(reply, done)
        if confirmed:
            self.send(protocol.encode(protocol.Settled(confirmed)))
        return reply

    def close(self) -> None:
        self.socket.close(0)
        self.context.term()
        self.engine.close()


@pytest.fixture
def raw(kv_port: int):
    src = {"l": _tensors(True)}
    dst = {"l": _tensors(False)}
    with KVSink(dst, kv_port=kv_port) as sink:
        peer = RawPeer(f"tcp://127.0.0.1:{kv_port}", src)
        try:
            yield sink, peer, src["l"], dst["l"]
        finally:
            peer.close()


def test_source_blocks_out_of_range_are_refused_for_that_request_only(raw) -> None:
    """A readiness naming Prefill block ids outside the tensors it registered: that request
    fails with BlockRangeError (named in READ_FAILED), the one beside it is read."""
    sink, peer, src, dst = raw
    peer.introduce()
    sink.expect("bad", main_blocks=[1, 2])
    sink.expect("good", main_blocks=[5, 6])
    reply = peer.ready(0, "l", [("bad", [3, NB + 100], 0), ("good", [7, 8], 0)], ("bad", "good"))
    assert isinstance(reply, protocol.ReadFailed) and reply.failed_ext_ids == ("bad",), reply
    outcomes = sink.wait(["bad", "good"], 10)
    assert type(outcomes["bad"].error).__name__ == "BlockRangeError", outcomes["bad"]
    assert outcomes["good"].state is TerminalState.DONE
    assert np.array_equal(dst.main[0][[5, 6]], src.main[0][[7, 8]])
    assert not dst.main[0][[1, 2]].any() and not dst.indexer[[1, 2]].any()


def test_overlapping_chunks_of_one_request_stay_inside_its_destinations(raw) -> None:
    """Two chunks of one request that overlap (positions 0-1, then 1-2, the final one): the
    position they share is read twice, into the same destination block, from the block
    Prefill named for it. Coverage only asks that the chunks tile the request to its end, so
    the request is DONE with Prefill's bytes; nothing outside its destinations is written."""
    sink, peer, src, dst = raw
    peer.introduce()
    sink.expect("r", main_blocks=[4, 5, 6])
    first = peer.ready(0, "l", [("r", [1, 2], 0)], ())
    second = peer.ready(0, "l", [("r", [2, 3], 1)], ("r",))
    assert isinstance(first, protocol.ReadDone) and isinstance(second, protocol.ReadDone), (first, second)
    assert sink.wait(["r"], 10)["r"].state is TerminalState.DONE
    assert np.array_equal(dst.main[0][[4, 5, 6]], src.main[0][[1, 2, 3]])
    mask = np.ones(NB, bool)
    mask[[4, 5, 6]] = False
    assert not dst.main[0][mask].any() and not dst.indexer[mask].any() and not dst.scale[mask].any()


def test_an_oversized_frame_drops_that_connection_and_decode_serves_on(raw, kv_port: int) -> None:
    """A frame above max_frame_bytes (16 MiB, plus libzmq's room for a CURVE box): libzmq
    drops the sender's connection before the frame reaches the loop; Decode answers nothing
    to it and serves the next peer."""
    sink, peer, src, dst = raw
    peer.send(b"\x93" + b"\0" * (17 * 2**20))
    with KVSource({"l": src}, block_size=BLOCK, reply_timeout=10) as source:
        sink.expect("r", main_blocks=[9])
        source.add_request("r", sink.endpoint, main_block_ids=[3], num_tokens=BLOCK)
        source.send_all({"r": BLOCK})
        assert source.wait_finished(["r"], 10)["r"].ok
        assert sink.wait(["r"], 10)["r"].ok
    assert not peer.socket.poll(0)  # never answered
    assert sink.counters.malformed == 0  # it never reached the decoder
    assert np.array_equal(dst.main[0][9], src.main[0][3])


# -- authentication ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("curve")
    made: dict[str, Path] = {}
    for name in ("decode", "impostor", "alice", "stranger"):
        public, secret = zmq.auth.create_certificates(root, name)
        made[name], made[name + "_secret"] = Path(public), Path(secret)
    authorized = root / "authorized"
    authorized.mkdir()
    (authorized / "alice.key").write_bytes(made["alice"].read_bytes())
    made["authorized"] = authorized
    return made


PEERS = {
    "no-curve": lambda k: {},
    "unauthorized-key": lambda k: {"curve_secret_key": str(k["stranger_secret"]), "curve_server_key": str(k["decode"])},
    "wrong-server-key": lambda k: {"curve_secret_key": str(k["alice_secret"]), "curve_server_key": str(k["impostor"])},
}


@pytest.mark.parametrize("who", list(PEERS))
def test_an_unauthenticated_or_wrongly_authenticated_prefill_is_never_heard(keys, kv_port: int, who: str) -> None:
    """Decode listens with CURVE. A Prefill without CURVE, with a key Decode does not
    authorize, or dialing with the wrong server key never completes a handshake: its request
    fails on Prefill with ReplyTimeout after reply_timeout, Decode's request stays pending
    and untouched, and the authorized Prefill then completes it."""
    src, dst = {"l": _tensors(True)}, {"l": _tensors(False)}
    server = {"curve_secret_key": str(keys["decode_secret"]), "curve_authorized_keys": str(keys["authorized"])}
    with KVSink(dst, kv_port=kv_port, channel_options=server) as sink:
        sink.expect("r", main_blocks=[2, 3])
        with KVSource(src, block_size=BLOCK, reply_timeout=1.0, channel_options=PEERS[who](keys)) as bad:
            bad.add_request("r", sink.endpoint, main_block_ids=[5, 6], num_tokens=2 * BLOCK)
            bad.send_all({"r": 2 * BLOCK})
            started = time.monotonic()
            refused = bad.wait_finished(["r"], 10)["r"]
            took = time.monotonic() - started
        assert refused.state is TerminalState.FAILED and type(refused.error).__name__ == "ReplyTimeout", refused
        assert took < 5, took
        assert sink.take() == {} and _untouched(dst["l"])
        alice = {"curve_secret_key": str(keys["alice_secret"]), "curve_server_key": str(keys["decode"])}
        with KVSource(src, block_size=BLOCK, reply_timeout=10, channel_options=alice) as good:
            good.add_request("r", sink.endpoint, main_block_ids=[5, 6], num_tokens=2 * BLOCK)
            good.send_all({"r": 2 * BLOCK})
            assert good.wait_finished(["r"], 10)["r"].ok
        assert sink.wait(["r"], 10)["r"].ok
    assert np.array_equal(dst["l"].main[0][[2, 3]], src["l"].main[0][[5, 6]])
