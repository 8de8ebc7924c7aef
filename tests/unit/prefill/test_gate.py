"""The storage-slot gate (rd2h.prefill.gate): the table behind a Condition, waited on across threads
(a waiter is woken by the last reply; a dead Decode ends in GateTimeout)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from rd2h.errors import ConfigError, GateTimeout, RD2HError, StateError
from rd2h.prefill.gate import SlotGate
from rd2h.prefill.slots import LayerState, SlotState

MAIN, IDX = ("main", 0x1000), ("indexer", 0x2000)

# -- scenarios ---------------------------------------------------------------------------------


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


# -- real threads ------------------------------------------------------------------------------


class _TellingCondition(threading.Condition):
    """The gate's Condition, telling the test once a waiter blocks in it: the waiter found
    its slots busy and sleeps until notified (the test synchronises on this, not a sleep)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocked = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.blocked.set()
        return super().wait(timeout)


def _watched_gate() -> tuple[SlotGate, _TellingCondition]:
    gate = SlotGate()
    gate._cond = condition = _TellingCondition()
    return gate, condition


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
    gate, condition = _watched_gate()
    gate.claim(0, [MAIN])
    gate.sent(0, ["d0"])
    waiter = _wait_in_thread(gate, [MAIN], timeout=30)
    assert condition.blocked.wait(10)  # really blocked on the busy slot
    assert "error" not in waiter
    gate.replied(0, "d0")
    waiter["thread"].join(10)
    assert not waiter["thread"].is_alive() and waiter["error"] is None


def test_never_replied_slot_times_out_within_bound() -> None:
    """The bound is real time (it limits how long the compute path blocks): never early."""
    gate = SlotGate()
    gate.claim(2, [MAIN])
    gate.sent(2, ["d0"])
    waiter = _wait_in_thread(gate, [MAIN], timeout=0.2)
    waiter["thread"].join(30)
    assert isinstance(waiter["error"], GateTimeout)
    assert "layer 2" in str(waiter["error"]) and "'d0'" in str(waiter["error"])
    assert waiter["elapsed"] >= 0.2
