"""A Prefill run with pipeline parallel (issue 20, item 3): each stage is a peer of its own
that announces only the layers it computed, and its mf_meta says which stage it is. A Decode
rank completes a request once the stages' final signals, per contributor member, cover every
layer it holds; a stage's final covers that stage's layers only, and a peer that is no stage
must still cover them all."""

from __future__ import annotations

import pytest
from test_receive_tracker import LAYERS, PEER, deliver, layouts, readiness

from rd2h.decode.rank_reads import Destinations
from rd2h.decode.receive_tracker import ReceiveState, ReceiveTracker
from rd2h.errors import BlockRangeError
from rd2h.outcome import TerminalState

STAGE0, STAGE1 = b"prefill-stage-0", b"prefill-stage-1"


def staged(ratio_members: int = 1) -> ReceiveTracker:
    t = ReceiveTracker(layouts())
    for member in range(ratio_members):
        t.peer_admitted(STAGE0 + bytes([member]), "s0", stage=0, stage_layers=[LAYERS[0], "layer.elsewhere"])
        t.peer_admitted(STAGE1 + bytes([member]), "s1", stage=1, stage_layers=[LAYERS[1]])
    return t


def stage_sends(t: ReceiveTracker, stage: int, ext_id: str, n: int, member: int = 0, ratio: int = 1) -> dict:
    """Stage ``stage`` (member ``member``) announces its one layer with its final signal."""
    identity = (STAGE0, STAGE1)[stage] + bytes([member])
    batch = readiness(LAYERS[stage], [(ext_id, 0, n)], (ext_id,), member=member, ratio=ratio)
    return deliver(t, batch, identity=identity)


def test_a_request_is_done_once_every_stage_sent_its_layers() -> None:
    t = staged()
    t.expect("r", Destinations.of([3, 5, 7]), now=0.0)
    assert stage_sends(t, 0, "r", 3) == {}  # stage 0's final: its layer is in, layer 1 is not
    assert t.state("r") is ReceiveState.RECEIVING and t.take() == {}
    assert stage_sends(t, 1, "r", 3) == {}
    [outcome] = t.take().values()
    assert outcome.state is TerminalState.DONE


def test_stages_may_finish_in_any_order_and_a_repeated_final_counts_once() -> None:
    t = staged()
    t.expect("r", Destinations.of([1, 2]), now=0.0)
    assert stage_sends(t, 1, "r", 2) == {}
    assert stage_sends(t, 1, "r", 2) == {} and t.take() == {}  # stage 1 again: still waiting for stage 0
    assert stage_sends(t, 0, "r", 2) == {}
    assert t.take()["r"].state is TerminalState.DONE


def test_each_member_needs_every_stage() -> None:
    """TP 2 -> 1 with two stages: four peers; member 0's stages alone complete nothing."""
    t = staged(ratio_members=2)
    t.expect("r", Destinations.of([0, 1, 2, 3]), now=0.0)
    for stage in (0, 1):
        assert stage_sends(t, stage, "r", 4, member=0, ratio=2) == {}
    assert t.take() == {}
    assert stage_sends(t, 0, "r", 4, member=1, ratio=2) == {}
    assert t.take() == {}
    assert stage_sends(t, 1, "r", 4, member=1, ratio=2) == {}
    assert t.take()["r"].state is TerminalState.DONE


def test_a_stage_must_still_send_every_layer_it_holds() -> None:
    """Stage 0 holds layer 0 but announces its final with a chunk read on no layer of its own."""
    t = ReceiveTracker(layouts())
    t.peer_admitted(STAGE0, "s0", stage=0, stage_layers=list(LAYERS))  # both layers: a one-stage split
    t.expect("r", Destinations.of([0, 1]), now=0.0)
    failures = deliver(t, readiness(LAYERS[0], [("r", 0, 2)], ("r",)), identity=STAGE0)
    assert isinstance(failures["r"], BlockRangeError)
    assert "contributor 0 of pipeline stage 0 never announced layer(s) l1" in str(failures["r"])


def test_a_peer_that_is_no_stage_must_send_every_layer() -> None:
    """Without a stage in its mf_meta a peer's final covers the whole rank, as before."""
    t = ReceiveTracker(layouts())
    t.peer_admitted(PEER, "p")
    t.expect("r", Destinations.of([0, 1]), now=0.0)
    failures = deliver(t, readiness(LAYERS[0], [("r", 0, 2)], ("r",)))
    assert isinstance(failures["r"], BlockRangeError) and "contributor 0 never announced layer(s) l1" in str(failures["r"])
    assert t.take()["r"].state is TerminalState.FAILED


@pytest.mark.parametrize("first", [0, 1])
def test_a_stage_final_that_skips_part_of_the_request_fails_it(first: int) -> None:
    t = staged()
    t.expect("r", Destinations.of([0, 1, 2]), now=0.0)
    assert stage_sends(t, first, "r", 3) == {}
    identity = (STAGE0, STAGE1)[1 - first] + b"\x00"
    failures = deliver(t, readiness(LAYERS[1 - first], [("r", 0, 2)], ("r",)), identity=identity)  # block 2 missing
    assert "blocks 2..2 were never announced" in str(failures["r"])
    assert t.take()["r"].state is TerminalState.FAILED
