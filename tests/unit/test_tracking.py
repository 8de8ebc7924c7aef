"""Gathering per-rank outcomes over Decode TP ranks, and the request id map.

(Per-rank request state is rd2h.receiving's, tested in test_receiving.py.)
"""

from __future__ import annotations


import pytest
from hypothesis import given
from hypothesis import strategies as st

from rd2h.errors import (
    ConfigError,
    StateError,
    UnknownRequestError,
)
from rd2h.outcome import TerminalState
from rd2h.tracking import (
    CompletionGatherer,
    GatherResult,
    RequestIdMap,
    gather_terminal,
)

# -- gathering over TP ranks -------------------------------------------------------------------

D, F, A = TerminalState.DONE, TerminalState.FAILED, TerminalState.ABORTED


def test_gather_terminal_one_shot() -> None:
    result = gather_terminal([{"a": D, "b": D, "c": F, "d": A}, {"a": D, "b": F, "c": D}])
    assert result == GatherResult(frozenset("abc"), frozenset("bc"))
    assert result.succeeded == {"a"}
    assert gather_terminal([{"a": A}]).finished == {"a"}
    with pytest.raises(ConfigError):
        gather_terminal([])


def test_gatherer_accepts_ranks_in_different_steps() -> None:
    gatherer = CompletionGatherer(3)
    assert gatherer.update([{"a": D}, {}, {"a": D}]) == GatherResult()
    assert gatherer.waiting_on("a") == {1}
    gatherer.add(1, {"a": F, "b": D})
    assert gatherer.take() == GatherResult(frozenset("a"), frozenset("a"))
    assert gatherer.take() == GatherResult()  # emitted once
    assert len(gatherer) == 1 and gatherer.waiting_on("b") == {0, 2}


def test_gatherer_rejects_bad_input() -> None:
    with pytest.raises(ConfigError):
        CompletionGatherer(0)
    gatherer = CompletionGatherer(2)
    with pytest.raises(ConfigError, match="rank 2 is out of range"):
        gatherer.add(2, {})
    with pytest.raises(ConfigError, match="expected 2 rank reports, got 1"):
        gatherer.update([{}])
    gatherer.add(0, {"a": D})
    gatherer.add(0, {"a": D})  # an identical repeat is harmless
    with pytest.raises(StateError, match="rank 0 reported FAILED after DONE"):
        gatherer.add(0, {"b": D, "a": F})
    assert gatherer.waiting_on("b") == frozenset()  # a rejected report changes nothing


@given(
    st.integers(1, 4),
    st.lists(st.tuples(st.sampled_from("abcde"), st.sampled_from([D, F, A])), max_size=10),
    st.data(),
)
def test_gatherer_emits_when_the_last_rank_reports(
    tp: int, outcomes: list[tuple[str, TerminalState]], data: st.DataObject
) -> None:
    """Each rank reports each request in a step of its own choosing; emission happens in
    the step of the last report, once."""
    final = dict(outcomes)
    schedule = {
        (rank, ext): data.draw(st.integers(0, 3), label=f"step of {ext} on rank {rank}")
        for ext in final
        for rank in range(tp)
    }
    gatherer = CompletionGatherer(tp)
    seen: set[str] = set()
    for step in range(4):
        reports = [
            {ext: final[ext] for ext in final if schedule[(rank, ext)] == step}
            for rank in range(tp)
        ]
        result = gatherer.update(reports)
        due = {ext for ext in final if max(schedule[(r, ext)] for r in range(tp)) == step}
        assert result.finished == due
        assert not due & seen
        seen |= due
    assert seen == set(final) and len(gatherer) == 0


# -- request ids ----------------------------------------------------------------------------


def test_request_id_map() -> None:
    ids = RequestIdMap()
    ids.add("ext-1", "cmpl-1")
    assert ids.internal("ext-1") == "cmpl-1" and ids.external("cmpl-1") == "ext-1"
    assert "ext-1" in ids and len(ids) == 1
    with pytest.raises(StateError, match="external id 'ext-1' already maps to 'cmpl-1'"):
        ids.add("ext-1", "cmpl-2")
    with pytest.raises(StateError, match="internal id 'cmpl-1' already maps to 'ext-1'"):
        ids.add("ext-2", "cmpl-1")
    assert ids.pop("ext-1") == "cmpl-1"
    assert len(ids) == 0
    with pytest.raises(UnknownRequestError, match="no internal id for external id 'ext-1'"):
        ids.internal("ext-1")
    with pytest.raises(UnknownRequestError):
        ids.external("cmpl-1")
    with pytest.raises(KeyError):
        ids.pop("ext-1")
    ids.add("ext-1", "cmpl-1")  # free again after pop


def test_unknown_request_error_message_is_not_quoted() -> None:
    assert str(UnknownRequestError("no such request")) == "no such request"
