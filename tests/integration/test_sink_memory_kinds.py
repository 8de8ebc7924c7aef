"""Decode's handshake and the memory kinds a Prefill declares (issue 22): a peer whose layers
live in memory Decode's engine cannot read is refused with the reason sent back, a peer whose
kinds are malformed is dropped as malformed, and neither stops the loop. Raw messages through
the real codec, the local engine and the in-memory channel; nothing sleeps to synchronise."""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest
from layers import layer_tensors

from rd2h import plugins
from rd2h.api import layer_layout
from rd2h.decode.sink import Sink
from rd2h.errors import IncompatiblePeerError
from rd2h.layout.layers import LayerLayout
from rd2h.wire import protocol
from rd2h.wire.layer_metadata import encode_layer_metadata
from rd2h.wire.mf_meta import MfMeta

LAYERS = ("l0",)


def _on(kind: str, layout: LayerLayout) -> LayerLayout:
    """``layout`` with its indexer declared in memory of ``kind``."""
    assert layout.indexer is not None
    return dataclasses.replace(layout, indexer=dataclasses.replace(layout.indexer, kind=kind))


@pytest.fixture
def world(request: pytest.FixtureRequest):
    src = {name: layer_tensors(True, seed=i) for i, name in enumerate(LAYERS)}
    dst = {name: layer_tensors(False) for name in LAYERS}
    prefill = plugins.load_engine("local", "prefill")
    layouts = {name: layer_layout(t) for name, t in src.items()}
    metadata = prefill.register([r for layout in layouts.values() for r in layout.regions()])
    listener = plugins.load_channel("memory").listen(f"memory://kinds-{request.node.name}")
    sink = Sink(
        rank=0, tp_size=1, engine=plugins.load_engine("local", "decode"), listener=listener,
        layers={name: layer_layout(t) for name, t in dst.items()}, poll_seconds=0.02,
    )  # fmt: skip
    dialer = plugins.load_channel("memory").dialer()
    with sink:
        yield sink, dialer, listener.address, layouts, metadata, src, dst
    dialer.close()
    prefill.close()


def _reply(dialer) -> protocol.Reply:
    while True:
        got = dialer.recv(10.0)
        assert got is not None, "Decode did not reply within 10 s"
        reply = protocol.decode_reply(got[1])
        if not isinstance(reply, protocol.Ack):
            return reply


def _ready(dialer, address: str, ext_id: str) -> protocol.Reply:
    request = protocol.ReadRequest(ext_id, (3,), (3,), 0, 0)
    dialer.send(address, protocol.encode(protocol.ReadReadyBatch(0, "l0", (request,), (ext_id,))))
    return _reply(dialer)


def test_a_peer_in_memory_decodes_engine_cannot_read_is_refused_with_the_reason(world) -> None:
    sink, dialer, address, layouts, metadata, _, _ = world
    sink.expect("r", [1], [1])
    on_gpu = {name: _on("cuda:0", layout) for name, layout in layouts.items()}
    dialer.send(address, protocol.encode(MfMeta("gpu-peer", encode_layer_metadata(on_gpu), engine_metadata=metadata)))
    reply = _ready(dialer, address, "r")
    assert isinstance(reply, protocol.ReadFailed) and reply.failed_ext_ids == ("r",)
    assert isinstance(reply.exception(), IncompatiblePeerError)
    assert "cuda:0 memory" in reply.error and "local engine reads from host memory only" in reply.error
    assert "nixl" in reply.error  # the installed engine that can
    outcome = sink.wait(["r"], 10)["r"]
    assert isinstance(outcome.error, IncompatiblePeerError)


def test_malformed_kinds_are_dropped_and_the_loop_goes_on(world) -> None:
    sink, dialer, address, layouts, metadata, src, dst = world
    raw = msgpack.unpackb(encode_layer_metadata(layouts))
    raw["l0"]["memory_kind"] = ["gpu", "host"]
    bad = protocol.encode(MfMeta("bad-peer", b"\x80", engine_metadata=metadata))
    dialer.send(address, bad.replace(b"\xc4\x01\x80", msgpack.packb(msgpack.packb(raw)), 1))  # that map inside
    # the same peer then introduces itself properly and is served: the bad mf_meta stopped nothing
    sink.expect("r", [1], [1])
    dialer.send(address, protocol.encode(MfMeta("bad-peer", encode_layer_metadata(layouts), engine_metadata=metadata)))
    reply = _ready(dialer, address, "r")
    assert isinstance(reply, protocol.ReadDone)
    dialer.send(address, protocol.encode(protocol.Settled(protocol.read_ok(reply, ("r",)))))  # as Prefill does
    assert sink.counters.malformed == 1
    assert sink.wait(["r"], 10)["r"].ok
    assert np.array_equal(dst["l0"].main[0][1], src["l0"].main[0][3])
