"""The storage-slot gate: scenarios, real threads, and a stateful check against a small model
(a waiter is woken by a reply; a dead Decode ends in GateTimeout; every error reaches one waiter)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from rd2h.errors import (
    ConfigError,
    GateTimeout,
    LayerFailedError,
    RD2HError,
    StateError,
)
from rd2h.slots import LayerState, SlotGate, SlotState, SlotTable

MAIN, IDX = ("main", 0x1000), ("indexer", 0x2000)

# -- slot gate: scenarios -------------------------------------------------------------------


def test_slot_is_busy_until_every_endpoint_replied() -> None:
    gate = SlotGate()
    gate.claim(3, [MAIN, IDX])
    assert gate.state(MAIN) is SlotState.BUSY and gate.owner(IDX) == 3
    assert gate.layer_state(3) is LayerState.CLAIMED
    assert gate.sent(3, ["d0", "d1"]) is False
    assert gate.replied(3, "d0") is False
    assert gate.pending(3) == {"d1"}
    with pytest.raises(GateTimeout):
        gate.wait([MAIN], 0)
    assert gate.replied(3, "d1") is True
    assert gate.state(MAIN) is SlotState.FREE and gate.layer_state(3) is LayerState.RELEASED
    gate.wait([MAIN, IDX], 0)


def test_zero_endpoints_release_at_once() -> None:
    gate = SlotGate()
    gate.claim(0, [MAIN])
    assert gate.sent(0, []) is True
    gate.wait([MAIN], 0)


def test_claiming_a_busy_slot_is_a_usage_error() -> None:
    gate = SlotGate()
    gate.claim(0, [MAIN, IDX])
    gate.sent(0, ["d0"])
    with pytest.raises(StateError, match=r"slot \('main', 4096\) is still busy with layer 0 "):
        gate.claim(1, [MAIN])
    assert gate.owner(MAIN) == 0  # nothing changed
    with pytest.raises(StateError, match="layer 0 claimed again while still in flight"):
        gate.claim(0, [("main", 1)])
    gate.claim(1, [("main", 1)])  # another slot is fine


def test_an_error_reaches_exactly_one_waiter() -> None:
    gate = SlotGate()
    gate.claim(5, [MAIN, IDX])
    gate.sent(5, ["d0", "d1"])
    gate.replied(5, "d0", "bad block range")
    with pytest.raises(GateTimeout):  # still waiting on d1: the slots must not be reused
        gate.wait([MAIN], 0)
    gate.replied(5, "d1")
    with pytest.raises(LayerFailedError, match="layer 5: Decode endpoint 'd0' .*bad block range"):
        gate.wait([IDX], 0)
    gate.wait([MAIN], 0)  # the error was taken by the indexer waiter
    gate.wait([IDX], 0)


def test_errors_of_several_layers_are_raised_together() -> None:
    table = SlotTable()
    table.claim(1, [MAIN])
    table.claim(2, [IDX])
    table.fail_layer(1, "encode failed")
    table.sent(2, ["d0"])
    table.replied(2, "d0", "read failed")
    with pytest.raises(LayerFailedError) as info:
        table.check([MAIN, IDX])
    message = str(info.value)
    assert "layer 1: the sender could not send readiness: encode failed" in message
    assert "layer 2: Decode endpoint 'd0' failed the read: read failed" in message
    assert table.check([MAIN, IDX]) is True


def test_replies_before_sent_are_held() -> None:
    table = SlotTable()
    table.claim(0, [MAIN])
    table.replied(0, "d0")
    table.replied(0, "d1", "oops")
    table.replied(0, "d9")  # never announced: stray once sent() says so
    assert table.state(MAIN) is SlotState.BUSY
    assert table.sent(0, ["d0", "d1", "d2"]) is False
    assert table.pending(0) == {"d2"}
    assert table.stray_replies == 1
    assert table.replied(0, "d2") is True
    with pytest.raises(LayerFailedError, match="'d1' failed the read: oops"):
        table.check([MAIN])


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


def test_abandon_releases_layers_waiting_on_a_dead_endpoint() -> None:
    gate = SlotGate()
    gate.claim(0, [("main", 0)])
    gate.claim(1, [("main", 1)])
    gate.claim(2, [("main", 2)])
    gate.sent(0, ["dead"])
    gate.sent(1, ["dead", "alive"])
    assert gate.abandon("dead", "peer gone") == (0,)
    assert gate.pending(1) == {"alive"}
    with pytest.raises(LayerFailedError, match="layer 0: Decode endpoint 'dead' .*peer gone"):
        gate.wait([("main", 0)], 0)
    # layer 2 was not sent yet: a later sent() naming the dead endpoint does not wait for it
    assert gate.sent(2, ["dead"]) is True
    with pytest.raises(LayerFailedError, match="layer 2"):
        gate.wait([("main", 2)], 0)
    assert gate.stray_replies == 0
    gate.replied(1, "alive")
    with pytest.raises(LayerFailedError, match="layer 1"):
        gate.wait([("main", 1)], 0)


def test_fail_layer_before_and_after_sent() -> None:
    table = SlotTable()
    table.claim(0, [MAIN])
    assert table.fail_layer(0, "encode failed") is True  # nobody reads: released at once
    with pytest.raises(LayerFailedError, match="encode failed"):
        table.check([MAIN])
    table.claim(1, [MAIN])
    table.sent(1, ["d0"])
    assert table.fail_layer(1, "d1 unreachable") is False  # d0 may still be reading
    assert table.state(MAIN) is SlotState.BUSY
    assert table.replied(1, "d0") is True
    with pytest.raises(LayerFailedError, match="d1 unreachable"):
        table.check([MAIN])


def test_illegal_layer_events() -> None:
    table = SlotTable()
    with pytest.raises(StateError, match="sent: layer 4 is not in flight"):
        table.sent(4, ["d0"])
    with pytest.raises(StateError, match="fail_layer: layer 4 is not in flight"):
        table.fail_layer(4, "x")
    table.claim(4, [MAIN])
    table.sent(4, ["d0"])
    with pytest.raises(StateError, match="layer 4: SEND is illegal in state SENT"):
        table.sent(4, ["d1"])


def test_gate_timeout_names_slot_layer_and_endpoints() -> None:
    gate = SlotGate()
    gate.claim(7, [MAIN])
    gate.claim(8, [IDX])
    gate.sent(7, ["tcp://d1:5001", "tcp://d0:5000"])
    gate.replied(7, "tcp://d1:5001")
    with pytest.raises(GateTimeout) as info:
        gate.wait([MAIN, IDX, ("main", 3)], 0)
    message = str(info.value)
    assert "slot ('main', 4096) held by layer 7 (no reply from 'tcp://d0:5000')" in message
    assert "slot ('indexer', 8192) held by layer 8 (readiness not sent yet)" in message
    assert "('main', 3)" not in message  # free slots are not blamed
    assert isinstance(info.value, TimeoutError)
    with pytest.raises(ConfigError):
        gate.wait([MAIN], -1)


def test_unclaimed_slots_are_free() -> None:
    SlotGate().wait([MAIN, "anything"], 0)


# -- slot gate: real threads ----------------------------------------------------------------


def _wait_in_thread(gate: SlotGate, slots: list[Any], timeout: float) -> dict[str, Any]:
    result: dict[str, Any] = {}

    def run() -> None:
        start = time.monotonic()
        try:
            gate.wait(slots, timeout)
            result["error"] = None
        except RD2HError as exc:
            result["error"] = exc
        result["elapsed"] = time.monotonic() - start

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    result["thread"] = thread
    return result


def test_waiter_is_woken_by_a_reply_from_another_thread() -> None:
    gate = SlotGate()
    gate.claim(0, [MAIN])
    gate.sent(0, ["d0"])
    waiter = _wait_in_thread(gate, [MAIN], timeout=10)
    time.sleep(0.1)
    assert waiter["thread"].is_alive()  # really blocked
    gate.replied(0, "d0")
    waiter["thread"].join(5)
    assert not waiter["thread"].is_alive()
    assert waiter["error"] is None and 0.09 <= waiter["elapsed"] < 2


def test_waiter_is_woken_by_an_error_and_by_abandon() -> None:
    gate = SlotGate()
    gate.claim(0, [MAIN])
    gate.claim(1, [IDX])
    gate.sent(0, ["d0"])
    gate.sent(1, ["d1"])
    failed = _wait_in_thread(gate, [MAIN], timeout=10)
    dead = _wait_in_thread(gate, [IDX], timeout=10)
    time.sleep(0.05)
    gate.replied(0, "d0", "layout mismatch")
    gate.abandon("d1", "peer gone")
    for waiter in (failed, dead):
        waiter["thread"].join(5)
        assert isinstance(waiter["error"], LayerFailedError) and waiter["elapsed"] < 2
    assert "layout mismatch" in str(failed["error"]) and "peer gone" in str(dead["error"])


def test_never_replied_slot_times_out_within_bound() -> None:
    gate = SlotGate()
    gate.claim(2, [MAIN])
    gate.sent(2, ["d0"])
    waiter = _wait_in_thread(gate, [MAIN], timeout=0.2)
    waiter["thread"].join(5)
    assert isinstance(waiter["error"], GateTimeout)
    assert "layer 2" in str(waiter["error"]) and "'d0'" in str(waiter["error"])
    assert 0.2 <= waiter["elapsed"] < 0.2 + 0.5


# -- slot gate: stateful model check ----------------------------------------------------------

SLOTS = [("main", 0), ("main", 1), ("indexer", 0), ("indexer", 1)]
ENDPOINTS = ["d0", "d1", "d2"]
LAYERS = st.integers(0, 4)


class SlotGateMachine(RuleBasedStateMachine):
    """The gate against a model: per in-flight layer its slots, phase, pending endpoints,
    held early replies and errors; per released failed layer the errors not yet raised."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = SlotGate()
        self.layers: dict[int, dict[str, Any]] = {}
        self.owner: dict[Any, int] = {}
        self.outstanding: list[dict[str, Any]] = []  # failures not yet raised
        self.stray = 0
        self.serial = 0
        self.raised_tokens: list[str] = []
        self.recorded_tokens: list[str] = []

    def token(self) -> str:
        self.serial += 1
        return f"<e{self.serial}>"

    def release(self, layer_idx: int) -> None:
        layer = self.layers.pop(layer_idx)
        for slot in layer["slots"]:
            del self.owner[slot]
        if layer["errors"]:
            self.outstanding.append({"slots": layer["slots"], "errors": list(layer["errors"])})
            self.recorded_tokens.extend(layer["errors"])

    def model_reply(self, layer_idx: int, endpoint: str, error: str | None) -> bool:
        layer = self.layers.get(layer_idx)
        if layer is None:
            self.stray += 1
            return False
        if layer["phase"] == "claimed":
            if endpoint in layer["early"]:
                self.stray += 1
            else:
                layer["early"][endpoint] = (error, False)
            return False
        if endpoint not in layer["pending"]:
            self.stray += 1
            return False
        layer["pending"].discard(endpoint)
        if error is not None:
            layer["errors"].append(error)
        if not layer["pending"]:
            self.release(layer_idx)
            return True
        return False

    @rule(layer_idx=LAYERS, slots=st.sets(st.sampled_from(SLOTS), min_size=1, max_size=2))
    def claim(self, layer_idx: int, slots: set[Any]) -> None:
        if layer_idx in self.layers or slots & self.owner.keys():
            with pytest.raises(StateError):
                self.gate.claim(layer_idx, sorted(slots))
            return
        self.gate.claim(layer_idx, sorted(slots))
        self.layers[layer_idx] = {
            "slots": frozenset(slots),
            "phase": "claimed",
            "pending": set(),
            "early": {},
            "errors": [],
        }
        for slot in slots:
            self.owner[slot] = layer_idx

    @rule(layer_idx=LAYERS, endpoints=st.sets(st.sampled_from(ENDPOINTS)))
    def sent(self, layer_idx: int, endpoints: set[str]) -> None:
        layer = self.layers.get(layer_idx)
        if layer is None or layer["phase"] != "claimed":
            with pytest.raises(StateError):
                self.gate.sent(layer_idx, endpoints)
            return
        released = self.gate.sent(layer_idx, endpoints)
        pending = set(endpoints)
        for endpoint, (error, from_abandon) in layer["early"].items():
            if endpoint in pending:
                pending.discard(endpoint)
                if error is not None:
                    layer["errors"].append(error)
            elif not from_abandon:
                self.stray += 1
        layer["early"] = {}
        layer["pending"], layer["phase"] = pending, "sent"
        if not pending:
            self.release(layer_idx)
        assert released == (not pending)

    @rule(layer_idx=LAYERS, endpoint=st.sampled_from(ENDPOINTS), fails=st.booleans())
    def replied(self, layer_idx: int, endpoint: str, fails: bool) -> None:
        error = self.token() if fails else None
        assert self.gate.replied(layer_idx, endpoint, error) == self.model_reply(
            layer_idx, endpoint, error
        )

    @precondition(lambda self: self.layers)
    @rule(data=st.data())
    def reply_to_a_pending_endpoint(self, data: st.DataObject) -> None:
        """Drive towards releases: most random replies would be stray."""
        sent = [i for i, layer in self.layers.items() if layer["pending"]]
        if not sent:
            return
        layer_idx = data.draw(st.sampled_from(sorted(sent)))
        endpoint = data.draw(st.sampled_from(sorted(self.layers[layer_idx]["pending"])))
        self.replied(layer_idx, endpoint, data.draw(st.booleans()))

    @rule(endpoint=st.sampled_from(ENDPOINTS))
    def abandon(self, endpoint: str) -> None:
        error = self.token()
        released = self.gate.abandon(endpoint, error)
        expected = []
        for layer_idx, layer in list(self.layers.items()):
            if layer["phase"] == "claimed":
                layer["early"].setdefault(endpoint, (error, True))
            elif endpoint in layer["pending"] and self.model_reply(layer_idx, endpoint, error):
                expected.append(layer_idx)
        assert sorted(released) == sorted(expected)

    @rule(layer_idx=LAYERS)
    def fail_layer(self, layer_idx: int) -> None:
        error = self.token()
        layer = self.layers.get(layer_idx)
        if layer is None:
            with pytest.raises(StateError):
                self.gate.fail_layer(layer_idx, error)
            return
        released = self.gate.fail_layer(layer_idx, error)
        layer["errors"].append(error)
        layer["early"] = {}
        assert released == (layer["phase"] == "claimed")
        if layer["phase"] == "claimed":
            self.release(layer_idx)

    @rule(slots=st.sets(st.sampled_from(SLOTS), min_size=1))
    def wait(self, slots: set[Any]) -> None:
        keys = sorted(slots)
        hit = [f for f in self.outstanding if f["slots"] & slots]
        if hit:
            with pytest.raises(LayerFailedError) as info:
                self.gate.wait(keys, 0)
            message = str(info.value)
            expected = [token for f in hit for token in f["errors"]]
            for token in set(expected):
                assert message.count(token) == expected.count(token)
            # one abandon() error can fail several layers: only tokens of unhit layers alone
            others = {t for f in self.outstanding if f not in hit for t in f["errors"]}
            assert not any(token in message for token in others - set(expected))
            self.raised_tokens.extend(expected)
            self.outstanding = [f for f in self.outstanding if f not in hit]
        elif slots & self.owner.keys():
            with pytest.raises(GateTimeout) as timeout:
                self.gate.wait(keys, 0)
            for slot in slots & self.owner.keys():
                assert f"held by layer {self.owner[slot]} " in str(timeout.value)
        else:
            self.gate.wait(keys, 0)

    @invariant()
    def slot_free_iff_owner_has_nothing_pending(self) -> None:
        for slot in SLOTS:
            owner = self.gate.owner(slot)
            assert owner == self.owner.get(slot)
            if owner is None:
                assert self.gate.state(slot) is SlotState.FREE
            else:
                assert self.gate.state(slot) is SlotState.BUSY
                state = self.gate.layer_state(owner)
                assert state is LayerState.CLAIMED or (
                    state is LayerState.SENT and self.gate.pending(owner)
                )

    @invariant()
    def no_reply_lost(self) -> None:
        assert self.gate.stray_replies == self.stray
        for layer_idx in range(5):
            layer = self.layers.get(layer_idx)
            assert self.gate.pending(layer_idx) == (set() if layer is None else layer["pending"])

    def teardown(self) -> None:
        # every recorded error reaches exactly one waiter: drain them, one slot at a time
        for slot in SLOTS:
            if any(slot in f["slots"] for f in self.outstanding):
                self.wait({slot})
        assert sorted(self.raised_tokens) == sorted(self.recorded_tokens)


SlotGateMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
TestSlotGateMachine = SlotGateMachine.TestCase


