"""The storage-slot table (rd2h.prefill.slots, pure): scenarios and a stateful check against a small
model (every reply is matched or counted stray; a slot is free exactly when its layer is released)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from rd2h.errors import StateError
from rd2h.prefill.slots import LayerState, SlotState, SlotTable

MAIN, IDX = ("main", 0x1000), ("indexer", 0x2000)

# -- scenarios ---------------------------------------------------------------------------------


def test_a_released_layer_frees_its_slots_whatever_its_readers_said() -> None:
    """READ_FAILED and READ_DONE release alike: the gate never raises a reader's failure on
    the compute path (the send tracker fails the requests instead)."""
    table = SlotTable()
    table.claim(1, [MAIN])
    table.claim(2, [IDX])
    table.sent(1, [])
    table.sent(2, ["d0"])
    assert table.replied(2, "d0") is True
    assert table.check([MAIN, IDX]) is True


def test_replies_before_sent_are_held() -> None:
    table = SlotTable()
    table.claim(0, [MAIN])
    table.replied(0, "d0")
    table.replied(0, "d1")
    table.replied(0, "d9")  # never announced: stray once sent() says so
    assert table.state(MAIN) is SlotState.BUSY
    assert table.sent(0, ["d0", "d1", "d2"]) is False
    assert table.pending(0) == {"d2"}
    assert table.stray_replies == 1
    assert table.replied(0, "d2") is True
    assert table.check([MAIN]) is True


def test_all_early_replies_release_on_sent() -> None:
    table = SlotTable()
    table.claim(0, [MAIN])
    table.replied(0, "d0")
    assert table.sent(0, ["d0"]) is True
    assert table.check([MAIN]) is True


def test_stray_replies_are_ignored_and_counted() -> None:
    table = SlotTable()
    table.replied(9, "d0")  # unknown layer
    table.claim(0, [MAIN])
    table.sent(0, ["d0", "d1"])
    table.replied(0, "d7")  # not announced
    table.replied(0, "d0")
    table.replied(0, "d0")  # duplicate
    table.replied(0, "d1")
    table.replied(0, "d1")  # late
    assert table.stray_replies == 4
    assert table.check([MAIN]) is True


def test_illegal_layer_events() -> None:
    table = SlotTable()
    with pytest.raises(StateError, match="sent: layer 4 is not in flight"):
        table.sent(4, ["d0"])
    table.claim(4, [MAIN])
    table.sent(4, ["d0"])
    with pytest.raises(StateError, match="layer 4: SEND is illegal in state SENT"):
        table.sent(4, ["d1"])


# -- stateful model check ----------------------------------------------------------------------

SLOTS = [("main", 0), ("main", 1), ("indexer", 0), ("indexer", 1)]
ENDPOINTS = ["d0", "d1", "d2"]
LAYERS = st.integers(0, 4)


class SlotTableMachine(RuleBasedStateMachine):
    """The table against a model: per in-flight layer its slots, phase, pending endpoints
    and held early replies."""

    def __init__(self) -> None:
        super().__init__()
        self.table = SlotTable()
        self.layers: dict[int, dict[str, Any]] = {}
        self.owner: dict[Any, int] = {}
        self.stray = 0

    def release(self, layer_idx: int) -> None:
        layer = self.layers.pop(layer_idx)
        for slot in layer["slots"]:
            del self.owner[slot]

    def model_reply(self, layer_idx: int, endpoint: str) -> bool:
        layer = self.layers.get(layer_idx)
        if layer is None:
            self.stray += 1
            return False
        if layer["phase"] == "claimed":
            if endpoint in layer["early"]:
                self.stray += 1
            else:
                layer["early"].add(endpoint)
            return False
        if endpoint not in layer["pending"]:
            self.stray += 1
            return False
        layer["pending"].discard(endpoint)
        if not layer["pending"]:
            self.release(layer_idx)
            return True
        return False

    @rule(layer_idx=LAYERS, slots=st.sets(st.sampled_from(SLOTS), min_size=1, max_size=2))
    def claim(self, layer_idx: int, slots: set[Any]) -> None:
        if layer_idx in self.layers or slots & self.owner.keys():
            with pytest.raises(StateError):
                self.table.claim(layer_idx, sorted(slots))
            return
        self.table.claim(layer_idx, sorted(slots))
        self.layers[layer_idx] = {
            "slots": frozenset(slots),
            "phase": "claimed",
            "pending": set(),
            "early": set(),
        }
        for slot in slots:
            self.owner[slot] = layer_idx

    @rule(layer_idx=LAYERS, endpoints=st.sets(st.sampled_from(ENDPOINTS)))
    def sent(self, layer_idx: int, endpoints: set[str]) -> None:
        layer = self.layers.get(layer_idx)
        if layer is None or layer["phase"] != "claimed":
            with pytest.raises(StateError):
                self.table.sent(layer_idx, endpoints)
            return
        released = self.table.sent(layer_idx, endpoints)
        pending = set(endpoints)
        for endpoint in layer["early"]:
            if endpoint in pending:
                pending.discard(endpoint)
            else:
                self.stray += 1
        layer["early"] = set()
        layer["pending"], layer["phase"] = pending, "sent"
        if not pending:
            self.release(layer_idx)
        assert released == (not pending)

    @rule(layer_idx=LAYERS, endpoint=st.sampled_from(ENDPOINTS))
    def replied(self, layer_idx: int, endpoint: str) -> None:
        assert self.table.replied(layer_idx, endpoint) == self.model_reply(layer_idx, endpoint)

    @precondition(lambda self: self.layers)
    @rule(data=st.data())
    def reply_to_a_pending_endpoint(self, data: st.DataObject) -> None:
        """Drive towards releases: most random replies would be stray."""
        sent = [i for i, layer in self.layers.items() if layer["pending"]]
        if not sent:
            return
        layer_idx = data.draw(st.sampled_from(sorted(sent)))
        endpoint = data.draw(st.sampled_from(sorted(self.layers[layer_idx]["pending"])))
        self.replied(layer_idx, endpoint)

    @rule(slots=st.sets(st.sampled_from(SLOTS), min_size=1))
    def wait(self, slots: set[Any]) -> None:
        keys = sorted(slots)
        if slots & self.owner.keys():
            assert self.table.check(keys) is False
            timeout = self.table.timeout_error(keys, 0)
            for slot in slots & self.owner.keys():
                assert f"held by layer {self.owner[slot]} " in str(timeout)
        else:
            assert self.table.check(keys) is True

    @invariant()
    def slot_free_iff_owner_has_nothing_pending(self) -> None:
        for slot in SLOTS:
            owner = self.table.owner(slot)
            assert owner == self.owner.get(slot)
            if owner is None:
                assert self.table.state(slot) is SlotState.FREE
            else:
                assert self.table.state(slot) is SlotState.BUSY
                state = self.table.layer_state(owner)
                assert state is LayerState.CLAIMED or (
                    state is LayerState.SENT and self.table.pending(owner)
                )

    @invariant()
    def no_reply_lost(self) -> None:
        assert self.table.stray_replies == self.stray
        for layer_idx in range(5):
            layer = self.layers.get(layer_idx)
            assert self.table.pending(layer_idx) == (set() if layer is None else layer["pending"])


SlotTableMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestSlotTableMachine = SlotTableMachine.TestCase
