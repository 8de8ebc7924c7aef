"""Fault suite (issue 9): mutated frames from an admitted peer through the real Sink.

Valid mf_meta and readiness frames are mutated (bytes flipped, cut, grown, array headers
claiming billions of entries, ids beyond the limit) and sent by a hand-written peer over the
in-memory channel. Remote input must never raise out of the loop, never make Decode write a
block no live request holds, and never stop the rank: a valid request afterwards completes
with the right bytes. Deterministic (seeded), bounded in time.
"""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest
from layers import layer_tensors
from test_sink_peer import LAYERS, HandPeer

from rd2h import plugins
from rd2h.api import layer_layout
from rd2h.clock import ManualClock
from rd2h.decode.peer_limits import PeerLimits
from rd2h.decode.sink import Sink
from rd2h.outcome import TerminalState
from rd2h.wire import protocol
from rd2h.wire.layer_metadata import encode_layer_metadata
from rd2h.wire.mf_meta import MfMeta


def _mutate(frame: bytes, rng: random.Random) -> bytes:
    data = bytearray(frame)
    kind = rng.randrange(6)
    if kind == 0 and data:  # flip a few bytes
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
    elif kind == 1 and len(data) > 1:  # cut
        del data[rng.randrange(1, len(data)) :]
    elif kind == 2:  # grow with garbage
        data += rng.randbytes(rng.randint(1, 64))
    elif kind == 3 and data:  # an array header that claims 4 billion entries
        at = rng.randrange(len(data))
        data[at : at + 1] = b"\xdd\xff\xff\xff\xff"
    elif kind == 4 and data:  # a map or a string where an array was
        data[rng.randrange(len(data))] = rng.choice([0x80, 0xA5, 0xC0, 0xC4, 0xDE])
    else:  # swap two spans
        i, j = sorted(rng.sample(range(len(data) + 1), 2))
        data = data[j:] + data[i:j] + data[:i]
    return bytes(data) or b"\x00"


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_mutated_frames_never_break_the_rank(seed: int, request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture) -> None:
    rng = random.Random(seed)
    src = {name: layer_tensors(True, seed=i) for i, name in enumerate(LAYERS)}
    dst = {name: layer_tensors(False) for name in LAYERS}
    engine = plugins.load_engine("local", "prefill")
    layouts = {name: layer_layout(t) for name, t in src.items()}
    metadata = engine.register([r for lay in layouts.values() for r in lay.regions()])
    listener = plugins.load_channel("memory").listen(f"memory://fuzz-{request.node.name}")
    sink = Sink(
        rank=0, tp_size=1, engine=plugins.load_engine("local", "decode"), listener=listener,
        layers={name: layer_layout(t) for name, t in dst.items()}, clock=ManualClock(), poll_seconds=0.02,
        peer_limits=PeerLimits(max_ids_per_message=64),
    )  # fmt: skip
    peer = HandPeer(listener.address, layouts, metadata)
    meta = protocol.encode(MfMeta("fuzz", encode_layer_metadata(layouts), engine_metadata=metadata))
    caplog.set_level(logging.ERROR, logger="rd2h.decode.sink")
    try:
        with sink:
            sink.expect("a", [1, 2])
            sink.expect("b", [3])
            peer.introduce()
            for _ in range(400):
                reqs = tuple(
                    protocol.ReadRequest(rng.choice(["a", "b", "c"]), ids, ids, rng.randrange(3), rng.randrange(3))
                    for ids in ([rng.randrange(8) for _ in range(rng.randrange(1, 40))] for _ in range(rng.randrange(1, 4)))
                )
                layer = rng.choice(LAYERS)
                valid = protocol.ReadReadyBatch(LAYERS.index(layer), layer, reqs, tuple(r.ext_req_id for r in reqs[:1]))
                frame = meta if rng.random() < 0.1 else protocol.encode(valid)
                peer.dialer.send(peer.address, _mutate(frame, rng) if rng.random() < 0.8 else frame)
            # a sentinel after the fuzz: once its reply is back, every mutated frame was handled
            peer.introduce()
            peer.send(protocol.ReadReadyBatch(1, "l1", (protocol.ReadRequest("sentinel", (0,), (0,), 0, 0),), ()))
            while True:
                got = peer.dialer.recv(10.0)
                assert got is not None, "Decode stopped answering"
                reply = protocol.decode_reply(got[1])
                if isinstance(reply, protocol.ReadFailed) and reply.failed_ext_ids == ("sentinel",):
                    break
            # the rank still serves: a request read whole
            sink.expect("ok", [6])
            assert isinstance(peer.ready("l0", [("ok", [0], 0)]), protocol.ReadDone)
            assert isinstance(peer.ready("l1", [("ok", [0], 0)], done=("ok",)), protocol.ReadDone)
            assert sink.wait(["ok"], 10)["ok"].state is TerminalState.DONE
            assert sink.counters.malformed > 50 and sink.counters.oversized > 0  # the fuzz reached both refusals
            for name in LAYERS:
                assert np.array_equal(dst[name].main[0][6], src[name].main[0][0])
                untouched = [0, 4, 5, 7]  # held by no request, ever
                assert not dst[name].main[0][untouched].any() and not dst[name].indexer[untouched].any()
    finally:
        peer.close()
        engine.close()
    crashes = [r for r in caplog.records if "unexpected error" in r.getMessage()]
    assert not crashes, crashes[0].getMessage()
