"""Contributor and request completion, gathering over Decode TP ranks, the id map.

Stateful hypothesis machines check contributor completion and per-rank request trackers
gathered across Decode TP ranks.
"""

from __future__ import annotations


import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from rd2h.errors import (
    ConfigError,
    StateError,
    UnknownRequestError,
)
from rd2h.tracking import (
    CompletionGatherer,
    ContributorTracker,
    GatherResult,
    RequestIdMap,
    RequestState,
    RequestTracker,
    TerminalState,
    gather_terminal,
)

# -- contributor completion ------------------------------------------------------------------


def test_contributors_complete_once_all_members_reported() -> None:
    tracker = ContributorTracker()
    assert tracker.record_final("r1", 1, 3) is False
    assert tracker.record_final("r1", 1, 3) is False  # duplicate does not count
    assert tracker.record_final("r1", 0, 3) is False
    assert not tracker.is_complete("r1") and tracker.members("r1") == {0, 1}
    assert tracker.record_final("r1", 2, 3) is True
    assert tracker.is_complete("r1")
    assert tracker.record_final("r1", 2, 3) is False  # reported complete only once
    tracker.forget("r1")
    tracker.forget("r1")
    assert "r1" not in tracker and not tracker.is_complete("r1") and len(tracker) == 0


def test_single_contributor_completes_at_once() -> None:
    assert ContributorTracker().record_final("r", 0, 1) is True


@pytest.mark.parametrize(
    ("member", "ratio", "match"),
    [(2, 2, "member 2 is outside 0..1"), (-1, 2, "member"), (0, 0, "ratio"), (True, 2, "member")],
)
def test_bad_contributor_signals_raise(member: int, ratio: int, match: str) -> None:
    tracker = ContributorTracker()
    with pytest.raises(StateError, match=match):
        tracker.record_final("r", member, ratio)
    assert "r" not in tracker


def test_ratio_must_not_change() -> None:
    tracker = ContributorTracker()
    tracker.record_final("r", 0, 2)
    with pytest.raises(StateError, match="reports ratio 4, but .* reported ratio 2"):
        tracker.record_final("r", 1, 4)
    assert tracker.members("r") == {0}


class ContributorMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tracker = ContributorTracker()
        self.model: dict[str, tuple[int, set[int]]] = {}

    @rule(ext=st.sampled_from("abc"), member=st.integers(0, 4), ratio=st.integers(1, 4))
    def record(self, ext: str, member: int, ratio: int) -> None:
        known = self.model.get(ext)
        if member >= ratio or (known is not None and known[0] != ratio):
            with pytest.raises(StateError):
                self.tracker.record_final(ext, member, ratio)
            return
        members = self.model.setdefault(ext, (ratio, set()))[1]
        completes = member not in members and len(members) + 1 == ratio
        members.add(member)
        assert self.tracker.record_final(ext, member, ratio) is completes

    @rule(ext=st.sampled_from("abc"))
    def forget(self, ext: str) -> None:
        self.tracker.forget(ext)
        self.model.pop(ext, None)

    @invariant()
    def matches_model(self) -> None:
        for ext in "abc":
            ratio, members = self.model.get(ext, (0, set()))
            assert self.tracker.members(ext) == members
            assert self.tracker.is_complete(ext) == (ext in self.model and len(members) == ratio)


ContributorMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=30, deadline=None
)
TestContributorMachine = ContributorMachine.TestCase


# -- request states per rank -------------------------------------------------------------------


def test_request_lifecycle_done() -> None:
    tracker = RequestTracker()
    tracker.expect("r")
    assert tracker.state("r") is RequestState.WAITING
    tracker.on_layer_read("r")
    tracker.on_layer_read("r")
    assert tracker.state("r") is RequestState.RECEIVING and tracker.take_terminal() == {}
    tracker.on_contributors_complete("r")
    assert tracker.take_terminal() == {"r": TerminalState.DONE}
    assert tracker.take_terminal() == {}
    tracker.abort("r")  # too late: stays done, not reported again
    assert tracker.state("r") is RequestState.DONE and tracker.take_terminal() == {}
    with pytest.raises(StateError, match="LAYER_READ is illegal in state DONE"):
        tracker.on_layer_read("r")


def test_failure_keeps_first_reason_and_absorbs_later_events() -> None:
    tracker = RequestTracker()
    tracker.expect("r")
    tracker.on_failed("r", "read failed: -5")
    tracker.on_layer_read("r")  # another contributor still delivers
    tracker.on_failed("r", "second")
    tracker.on_contributors_complete("r")
    assert tracker.state("r") is RequestState.FAILED and tracker.reason("r") == "read failed: -5"
    assert tracker.take_terminal() == {"r": TerminalState.FAILED}


def test_abort_while_waiting_is_reported_finished() -> None:
    tracker = RequestTracker()
    tracker.expect("r")
    tracker.abort("r")
    tracker.on_layer_read("r")  # in-flight readiness for an aborted request is absorbed
    assert tracker.take_terminal() == {"r": TerminalState.ABORTED}


def test_abort_before_expect_is_reported_and_wins() -> None:
    tracker = RequestTracker()
    tracker.abort("r")
    tracker.expect("r")
    assert tracker.state("r") is RequestState.ABORTED
    assert tracker.take_terminal() == {"r": TerminalState.ABORTED}


def test_unknown_and_duplicate_requests() -> None:
    tracker = RequestTracker()
    for event in (tracker.on_layer_read, tracker.on_contributors_complete, tracker.state):
        with pytest.raises(UnknownRequestError, match="'x' is not expected"):
            event("x")
    with pytest.raises(KeyError):
        tracker.on_failed("x", "boom")
    tracker.expect("r")
    with pytest.raises(StateError, match="EXPECT is illegal in state WAITING"):
        tracker.expect("r")
    tracker.forget("r")
    tracker.forget("r")
    assert "r" not in tracker and len(tracker) == 0


def test_forget_drops_unreported() -> None:
    tracker = RequestTracker()
    tracker.expect("r")
    tracker.on_contributors_complete("r")
    tracker.forget("r")
    assert tracker.take_terminal() == {}


EVENTS = ["read", "fail", "complete", "abort", "expect"]


@given(st.lists(st.sampled_from(EVENTS), max_size=12), st.booleans())
def test_every_request_ends_terminal_at_most_once(events: list[str], expected_first: bool) -> None:
    """Random event sequences: terminal states never change and are reported exactly once."""
    tracker = RequestTracker()
    if expected_first:
        tracker.expect("r")
    reported: list[TerminalState] = []
    terminal: RequestState | None = None
    for name in events:
        call = {
            "read": lambda: tracker.on_layer_read("r"),
            "fail": lambda: tracker.on_failed("r", "x"),
            "complete": lambda: tracker.on_contributors_complete("r"),
            "abort": lambda: tracker.abort("r"),
            "expect": lambda: tracker.expect("r"),
        }[name]
        try:
            call()
        except StateError:
            pass
        reported.extend(tracker.take_terminal().values())
        if "r" in tracker and tracker.state("r").name in TerminalState.__members__:
            terminal = terminal or tracker.state("r")
            assert tracker.state("r") is terminal  # terminal states absorb
    assert len(reported) == (terminal is not None)
    if terminal is not None:
        assert reported[0].name == terminal.name
    if "abort" in events and "r" in tracker:
        assert terminal is not None  # an abort always ends the request


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


class GatherMachine(RuleBasedStateMachine):
    """Per-rank RequestTrackers driven at random, gathered step by step as the worker does."""

    @initialize(tp=st.integers(1, 4))
    def setup(self, tp: int) -> None:
        self.trackers = [RequestTracker() for _ in range(tp)]
        self.gatherer = CompletionGatherer(tp)
        self.live: list[str] = []
        self.emitted: set[str] = set()
        self.aborted: set[str] = set()
        self.serial = 0

    @rule()
    def expect(self) -> None:
        self.serial += 1
        ext = f"r{self.serial}"
        for tracker in self.trackers:
            tracker.expect(ext)
        self.live.append(ext)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), event=st.sampled_from(["read", "fail", "complete"]))
    def rank_event(self, data: st.DataObject, event: str) -> None:
        ext = data.draw(st.sampled_from(self.live))
        tracker = data.draw(st.sampled_from(self.trackers))
        try:
            if event == "read":
                tracker.on_layer_read(ext)
            elif event == "fail":
                tracker.on_failed(ext, "boom")
            else:
                tracker.on_contributors_complete(ext)
        except StateError:
            assert tracker.state(ext) is RequestState.DONE

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        ext = data.draw(st.sampled_from(self.live))
        for tracker in self.trackers:
            tracker.abort(ext)
        self.aborted.add(ext)

    @rule()
    def step(self) -> None:
        result = self.gatherer.update([t.take_terminal() for t in self.trackers])
        assert result.failed <= result.finished
        assert not result.finished & self.emitted  # each request once
        for ext in result.finished:
            states = [t.state(ext) for t in self.trackers]
            assert all(s.name in TerminalState.__members__ for s in states)
            assert (ext in result.failed) == (RequestState.FAILED in states)
            for tracker in self.trackers:
                tracker.forget(ext)
            self.live.remove(ext)
        self.emitted |= result.finished
        assert self.aborted <= self.emitted  # an abort is reported in the same step

    @invariant()
    def nothing_terminal_everywhere_is_left_behind(self) -> None:
        for ext in self.live:
            terminal = [t.state(ext).name in TerminalState.__members__ for t in self.trackers]
            if not all(terminal):
                assert ext not in self.emitted


GatherMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=30, deadline=None
)
TestGatherMachine = GatherMachine.TestCase


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
