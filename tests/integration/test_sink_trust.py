"""Issue 9, trust model on the Decode runtime: a request expected from one Prefill is
announced by that Prefill only. Hand-written peers through the real codec, the real local
engine (a second Prefill in a process of its own, so its proven identity differs), the
in-memory channel and a manual clock.

On 87b7601 ``Sink.expect`` took no Prefill identity, and any admitted peer's readiness
naming a request read its own memory into the request's destinations and completed it
(or, from a refused peer, failed it): these tests fail there.
"""

from __future__ import annotations

import numpy as np
import pytest
from layers import layer_tensors
from test_sink_peer import LAYERS, HandPeer

from rd2h import plugins
from rd2h.api import layer_layout
from rd2h.cli.peer import PeerProcess
from rd2h.clock import ManualClock
from rd2h.decode.sink import Sink
from rd2h.layout.layers import LayerLayout, TensorLayout
from rd2h.outcome import TerminalState
from rd2h.wire import protocol


@pytest.fixture
def world(request: pytest.FixtureRequest):
    """A started Sink, Alice (a Prefill engine in this process) and Mallory (another
    Prefill process with memory of the same layout), both admitted peers."""
    src = {name: layer_tensors(True, seed=i) for i, name in enumerate(LAYERS)}
    dst = {name: layer_tensors(False) for name in LAYERS}
    engine = plugins.load_engine("local", "prefill")
    src_layouts = {name: layer_layout(t) for name, t in src.items()}
    metadata = engine.register([r for layout in src_layouts.values() for r in layout.regions()])
    listener = plugins.load_channel("memory").listen(f"memory://trust-{request.node.name}")
    sink = Sink(
        rank=0, tp_size=1, engine=plugins.load_engine("local", "decode"), listener=listener,
        layers={name: layer_layout(t) for name, t in dst.items()}, clock=ManualClock(), poll_seconds=0.02,
    )  # fmt: skip
    alice = HandPeer(listener.address, src_layouts, metadata, p_session="alice")
    with PeerProcess("local", sizes=[4096], seed=9) as other:
        base = other.regions[0][0]
        forged = LayerLayout((TensorLayout(base, 64, 8),), TensorLayout(base + 1024, 16, 8))
        mallory = HandPeer(listener.address, {name: forged for name in LAYERS}, other.metadata, p_session="mallory")
        with sink:
            yield sink, alice, mallory, engine.session_id, other.session_id, src, dst
        mallory.close()
    alice.close()
    engine.close()


def test_another_prefill_cannot_complete_or_poison_a_bound_request(world) -> None:
    sink, alice, mallory, alice_id, mallory_id, src, dst = world
    assert alice_id != mallory_id
    sink.expect("r", [1, 2], prefill=alice_id)
    mallory.introduce()
    for layer in LAYERS:  # all of it, with the final signal: enough to complete it
        reply = mallory.ready(layer, [("r", [0, 1], 0)], done=("r",) if layer == LAYERS[-1] else ())
        assert isinstance(reply, protocol.ReadFailed) and reply.failed_ext_ids == ("r",)
        assert "may not announce" in reply.error
    refused = HandPeer(alice.address, alice.layers, alice.engine_metadata, p_session="refused")
    try:  # a peer whose handshake was refused names it too: that must not fail it either
        refused.introduce(protocol_version=99)
        assert isinstance(refused.ready("l0", [("r", [0], 0)]), protocol.ReadFailed)
    finally:
        refused.close()
    assert sink.take() == {}  # neither completed nor failed
    assert not any(t.main[0].any() or t.indexer.any() for t in dst.values())  # nothing written
    alice.introduce()
    assert isinstance(alice.ready("l0", [("r", [0, 1], 0)]), protocol.ReadDone)
    assert isinstance(alice.ready("l1", [("r", [0, 1], 0)], done=("r",)), protocol.ReadDone)
    assert sink.wait(["r"], 10)["r"].state is TerminalState.DONE
    for name in LAYERS:
        assert np.array_equal(dst[name].main[0][1:3], src[name].main[0][0:2])


def test_an_early_announcement_by_another_prefill_does_not_fail_a_bound_request(world) -> None:
    """An id announced before expect fails the late expect (a rendezvous race), but only if
    the announcer is the Prefill the request is bound to."""
    sink, alice, mallory, alice_id, _, _, _ = world
    mallory.introduce()
    assert isinstance(mallory.ready("l0", [("early", [0], 0)]), protocol.ReadFailed)
    sink.expect("early", [3], prefill=alice_id)
    alice.introduce()
    assert isinstance(alice.ready("l0", [("early", [0], 0)]), protocol.ReadDone)
    assert isinstance(alice.ready("l1", [("early", [0], 0)], done=("early",)), protocol.ReadDone)
    assert sink.wait(["early"], 10)["early"].state is TerminalState.DONE


def test_an_unbound_request_is_open_to_any_admitted_prefill(world) -> None:
    """Without ``prefill=`` nothing changes: any admitted peer may announce it."""
    sink, _, mallory, _, _, _, _ = world
    sink.expect("open", [4])
    mallory.introduce()
    assert isinstance(mallory.ready("l0", [("open", [0], 0)]), protocol.ReadDone)
    assert isinstance(mallory.ready("l1", [("open", [0], 0)], done=("open",)), protocol.ReadDone)
    assert sink.wait(["open"], 10)["open"].state is TerminalState.DONE
