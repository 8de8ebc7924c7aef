"""Decode's receive tracker (pure): regression tests for the defects found over sockets, and a
stateful machine over arbitrary interleavings of local calls, readiness, read results,
timeouts and peer deaths."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from rd2h.decode.rank_reads import Destinations, MainSplit, plan_reads
from rd2h.decode.receive_tracker import ReceiveState, ReceiveTracker
from rd2h.errors import (
    BlockRangeError,
    ConfigError,
    DeadlineExceeded,
    DestinationError,
    DuplicateRequestError,
    IncompatiblePeerError,
    PeerGoneError,
    ProtocolError,
    RD2HError,
    StateError,
    TransferError,
    UnknownRequestError,
)
from rd2h.layout.layers import LayerLayout, TensorLayout
from rd2h.outcome import TerminalState
from rd2h.wire.protocol import ReadReadyBatch, ReadRequest, Settled

LAYERS = ("l0", "l1")
BLOCKS = 16
PEER = b"prefill-0"
MALLORY = b"another-prefill"  # admitted, proves another identity
REFUSED = b"refused-prefill"  # its mf_meta was refused


def layouts(blocks: int = BLOCKS) -> dict[str, LayerLayout]:
    return {
        name: LayerLayout((TensorLayout(1 << 20 * (i + 1), 64, blocks),), TensorLayout(1 << 30 + i, 8, blocks))
        for i, name in enumerate(LAYERS)
    }


def tracker(**kwargs: object) -> ReceiveTracker:
    t = ReceiveTracker(layouts(), **kwargs)  # type: ignore[arg-type]
    t.peer_admitted(PEER, "prefill:0")
    return t


def readiness(layer: str, reqs: list[tuple[str, int, int]], done: tuple[str, ...] = (), member: int = 0, ratio: int = 1) -> ReadReadyBatch:
    """``reqs``: (id, start, count) chunks; Prefill block ids are the positions themselves."""
    return ReadReadyBatch(
        LAYERS.index(layer), layer,
        tuple(ReadRequest(e, tuple(range(s, s + n)), tuple(range(s, s + n)), s, s) for e, s, n in reqs),
        done, member, ratio,
    )


def deliver(
    t: ReceiveTracker, batch: ReadReadyBatch, now: float = 0.0, failed: dict[str, RD2HError] | None = None,
    identity: bytes = PEER, confirm: bool = True,
) -> dict[str, RD2HError]:
    """What the Sink does with one readiness, minus the bytes: admit, plan, read, apply; then,
    with ``confirm``, what a Prefill does once the reply says its final layer was read: it
    confirms those requests (``settled``)."""
    admission = t.on_readiness(identity, batch, now)
    _, refused = plan_reads(batch, admission.readable, decode_rank=0, decode_tp=1)
    failures = t.on_read(identity, batch, admission, {**refused, **(failed or {})}, {}, now)
    read = tuple(e for e in batch.done_ext_ids if e in admission.readable and e not in failures)
    if confirm and read:
        t.on_settled(identity, Settled(read), now)
    return failures


def send_all(t: ReceiveTracker, ext_id: str, n: int, start: int = 0, now: float = 0.0) -> dict[str, RD2HError]:
    failures: dict[str, RD2HError] = {}
    for layer in LAYERS:
        done = (ext_id,) if layer == LAYERS[-1] else ()
        failures |= deliver(t, readiness(layer, [(ext_id, start, n - start)], done), now)
    return failures


# -- outcomes and the consume rule -----------------------------------------------------------


def test_a_complete_request_settles_done_once_and_is_consumed() -> None:
    t = tracker()
    t.expect("r", Destinations.of([3, 5, 7]), now=1.0)
    assert send_all(t, "r", 3, now=2.0) == {}
    [outcome] = t.take().values()
    assert (outcome.ext_id, outcome.state, outcome.error) == ("r", TerminalState.DONE, None)
    assert (outcome.started, outcome.finished) == (1.0, 2.0)
    assert t.take() == {} and "r" not in t and len(t) == 0
    t.expect("r", Destinations.of([3, 5, 7]), now=3.0)  # the id may be used again


def test_collect_consumes_only_when_all_are_settled() -> None:
    t = tracker()
    t.expect("a", Destinations.of([0]), 0.0)
    t.expect("b", Destinations.of([1]), 0.0)
    send_all(t, "a", 1)
    assert t.collect(["a", "b"]) is None and t.pending(["a", "b"]) == ["b"]
    t.abort("b", 0.0)
    assert {e: o.state for e, o in t.collect(["a", "b"]).items()} == {"a": TerminalState.DONE, "b": TerminalState.ABORTED}
    with pytest.raises(UnknownRequestError):
        t.collect(["a"])  # consumed


def test_expect_refuses_a_live_or_uncollected_id() -> None:
    """Defect 7: expecting a reused id failed with 'EXPECT is illegal in state DONE' because
    wait did not consume; now collected ids are free and live ones raise a clear error."""
    t = tracker()
    t.expect("r", Destinations.of([0]), 0.0)
    with pytest.raises(DuplicateRequestError):
        t.expect("r", Destinations.of([1]), 0.0)
    t.abort("r", 0.0)
    with pytest.raises(DuplicateRequestError):
        t.expect("r", Destinations.of([1]), 0.0)  # settled, not yet collected
    t.take()
    t.expect("r", Destinations.of([1]), 0.0)


def test_abort_of_an_unknown_or_collected_id_reports_nothing() -> None:
    """Defect 7: Sink.abort of an unknown or already-taken id created an ABORTED record that
    was reported again (vLLM asserts on that)."""
    t = tracker()
    assert t.abort("never", 0.0) is False
    t.expect("r", Destinations.of([0]), 0.0)
    send_all(t, "r", 1)
    assert t.take().keys() == {"r"}
    assert t.abort("r", 0.0) is False and t.fail("r", RD2HError("x"), 0.0) is False
    assert t.take() == {}


# -- defect 1: remote input never raises -------------------------------------------------------


def test_readiness_naming_a_done_untaken_request_fails_only_that_request() -> None:
    """Defect 1: a readiness naming a DONE-but-untaken request raised StateError inside
    Sink._finish; the other requests of the batch were never completed and Prefill was
    told the wrong reason."""
    t = tracker()
    t.expect("done", Destinations.of([0]), 0.0)
    send_all(t, "done", 1)
    t.expect("other", Destinations.of([1]), 0.0)
    failures: dict[str, RD2HError] = {}
    for layer in LAYERS:
        done = ("done", "other") if layer == LAYERS[-1] else ()
        failures |= deliver(t, readiness(layer, [("done", 0, 1), ("other", 0, 1)], done))
    assert set(failures) == {"done"}
    assert isinstance(failures["done"], StateError) and "already finished" in str(failures["done"])
    outcomes = t.take()
    assert outcomes["done"].state is TerminalState.DONE  # its first outcome stands
    assert outcomes["other"].state is TerminalState.DONE


def test_unknown_and_repeated_ids_are_refused_per_request() -> None:
    t = tracker()
    t.expect("r", Destinations.of([0, 1]), 0.0)
    failures = deliver(t, readiness("l0", [("ghost", 0, 1), ("r", 0, 1), ("r", 1, 1)]))
    assert isinstance(failures["ghost"], UnknownRequestError)
    assert "named twice" in str(failures["r"])


# -- D5/D9: DONE only with every expected byte ------------------------------------------------


def test_a_final_signal_that_covers_nothing_fails_the_request() -> None:
    """D5: a readiness whose final signal covers no blocks made the request DONE with its
    destinations still zero."""
    t = tracker()
    t.expect("r", Destinations.of([0, 1]), 0.0)
    failures: dict[str, RD2HError] = {}
    for layer in LAYERS:
        failures |= deliver(t, readiness(layer, [("r", 0, 0)], ("r",) if layer == "l1" else ()))
    assert "r" in failures  # D9: Prefill is told, so both sides agree
    [outcome] = t.take().values()
    assert outcome.state is TerminalState.FAILED and "never announced" in str(outcome.error)


def test_announcing_one_of_two_expected_blocks_fails() -> None:
    """D5: announcing 1 of 2 expected blocks gave DONE."""
    t = tracker()
    t.expect("r", Destinations.of([4, 5]), 0.0)
    failures = send_all(t, "r", 1)
    assert "r" in failures and isinstance(failures["r"], BlockRangeError)
    assert t.take()["r"].state is TerminalState.FAILED


def test_a_final_signal_before_every_layer_fails_and_is_named_in_the_reply() -> None:
    """D9: a Prefill that knows fewer layers than Decode got "ok" while Decode failed."""
    t = tracker()
    t.expect("r", Destinations.of([0]), 0.0)
    failures = deliver(t, readiness("l0", [("r", 0, 1)], ("r",)))
    assert "r" in failures and "l1" in str(failures["r"])
    assert t.take()["r"].state is TerminalState.FAILED


def test_first_block_skips_a_cached_prefix() -> None:
    t = tracker()
    t.expect("r", Destinations.of([0, 1, 2, 3]), 0.0, first_block=2)
    assert send_all(t, "r", 4, start=2) == {}
    assert t.take()["r"].state is TerminalState.DONE
    t.expect("s", Destinations.of([0, 1, 2, 3]), 0.0, first_block=1)
    assert "s" in send_all(t, "s", 4, start=2)  # block 1 is not cached and was not sent


def test_every_contributor_must_send_its_final_signal() -> None:
    t = tracker()
    t.expect("r", Destinations.of([0, 1]), 0.0)
    for member in (0, 1):
        for layer in LAYERS:
            done = ("r",) if layer == "l1" else ()
            assert deliver(t, readiness(layer, [("r", 0, 2)], done, member, 2)) == {}
        assert t.state("r") is (ReceiveState.RECEIVING if member == 0 else ReceiveState.DONE)
    assert t.take()["r"].ok


# -- agreement: DONE only once Prefill said so (protocol 4) -----------------------------------------


def test_a_wholly_read_request_waits_for_prefill_to_confirm_it() -> None:
    """Issue 9 D9 after a stall: Decode read every byte and replied, but the reply came after
    Prefill gave up and reported ReplyTimeout; Decode reported DONE. Now DONE waits for the
    Prefill's word, which a Prefill that gave up never sends."""
    t = tracker()
    t.expect("r", Destinations.of([3, 5]), now=0.0)
    for layer in LAYERS:
        deliver(t, readiness(layer, [("r", 0, 2)], ("r",) if layer == LAYERS[-1] else ()), confirm=False)
    assert t.state("r") is ReceiveState.CONFIRMING and t.take() == {}
    assert t.on_settled(PEER, Settled(("r",)), now=2.0) == ["r"]
    [outcome] = t.take().values()
    assert outcome.state is TerminalState.DONE and outcome.finished == 2.0


def test_an_unconfirmed_request_fails_at_its_deadline_and_holds_its_blocks_till_then() -> None:
    t = tracker(request_timeout=10.0)
    t.expect("r", Destinations.of([3]), now=0.0)
    for layer in LAYERS:
        deliver(t, readiness(layer, [("r", 0, 1)], ("r",) if layer == LAYERS[-1] else ()), confirm=False)
    with pytest.raises(DestinationError, match="held by live request 'r'"):
        t.expect("s", Destinations.of([3]), now=1.0)
    assert t.expire(10.0) == ["r"]
    [outcome] = t.take().values()
    assert isinstance(outcome.error, DeadlineExceeded) and "confirming" in str(outcome.error)


def test_a_readiness_for_a_request_awaiting_confirmation_is_refused_untouched() -> None:
    t = tracker()
    t.expect("r", Destinations.of([3]), now=0.0)
    for layer in LAYERS:
        deliver(t, readiness(layer, [("r", 0, 1)], ("r",) if layer == LAYERS[-1] else ()), confirm=False)
    failures = deliver(t, readiness("l0", [("r", 0, 1)]), confirm=False)
    assert isinstance(failures["r"], StateError) and t.state("r") is ReceiveState.CONFIRMING


def test_every_contributor_that_announced_the_final_must_confirm() -> None:
    t = ReceiveTracker(layouts())
    t.peer_admitted(PEER, "prefill:0")
    t.peer_admitted(MALLORY, "prefill:1")
    t.expect("r", Destinations.of([3, 5]), now=0.0)
    for member, identity in enumerate((PEER, MALLORY)):
        for layer in LAYERS:
            batch = readiness(layer, [("r", 0, 2)], ("r",) if layer == LAYERS[-1] else (), member, 2)
            deliver(t, batch, identity=identity, confirm=False)
    assert t.on_settled(PEER, Settled(("r",)), 1.0) == [] and t.state("r") is ReceiveState.CONFIRMING
    assert t.on_settled(MALLORY, Settled(("r",)), 2.0) == ["r"]
    assert t.take()["r"].state is TerminalState.DONE


def test_a_reference_peer_that_never_confirms_completes_on_its_final_signal() -> None:
    t = tracker()
    t.peer_admitted(PEER, "legacy", confirms=False)
    t.expect("r", Destinations.of([3]), now=0.0)
    send_all(t, "r", 1)
    assert t.take()["r"].state is TerminalState.DONE


def test_prefill_failing_a_request_fails_it_here_at_once_with_its_class() -> None:
    """The vLLM Prefill aborted the request, or gave up on this Decode: no waiting for the
    deadline."""
    t = tracker()
    t.expect("r", Destinations.of([3]), now=0.0)  # not announced yet: the expected peer may fail it
    t.expect("s", Destinations.of([4]), now=0.0)
    deliver(t, readiness("l0", [("s", 0, 1)]))
    assert sorted(t.on_settled(PEER, Settled.failure(["r", "s"], BlockRangeError("no blocks")), 1.0)) == ["r", "s"]
    outcomes = t.take()
    for ext_id in "rs":
        error = outcomes[ext_id].error
        assert isinstance(error, BlockRangeError) and "prefill:0" in str(error) and "no blocks" in str(error)


def test_settled_from_a_peer_that_may_not_settle_changes_nothing() -> None:
    t = ReceiveTracker(layouts())
    t.peer_admitted(PEER, "p", {"alice"})
    t.peer_admitted(MALLORY, "m", {"mallory"})
    t.expect("bound", Destinations.of([1]), now=0.0, expected_peer="alice")
    t.expect("theirs", Destinations.of([2]), now=0.0)
    deliver(t, readiness("l0", [("theirs", 0, 1)]), identity=PEER)
    for sender in (MALLORY, REFUSED, b"stranger"):
        t.on_settled(sender, Settled.failure(["bound", "theirs", "unknown"], StateError("x")), 1.0)
        t.on_settled(sender, Settled(("bound", "theirs")), 1.0)
    assert t.state("bound") is ReceiveState.WAITING and t.state("theirs") is ReceiveState.RECEIVING
    assert t.stray_settles == 15 and t.take() == {}


def test_a_done_for_a_request_whose_final_was_not_read_fails_it() -> None:
    t = tracker()
    t.expect("r", Destinations.of([3]), now=0.0)
    deliver(t, readiness("l0", [("r", 0, 1)]))
    assert t.on_settled(PEER, Settled(("r",)), 1.0) == ["r"]
    error = t.take()["r"].error
    assert isinstance(error, ProtocolError) and "final layer was not read" in str(error)


# -- D10: destinations are validated when expected ---------------------------------------------


@pytest.mark.parametrize(
    ("blocks", "match"),
    [([0, 16], "outside 0..15"), ([-1], "outside"), ([2, 2], "given twice")],
)
def test_expect_refuses_bad_destinations(blocks: list[int], match: str) -> None:
    with pytest.raises(DestinationError, match=match):
        tracker().expect("r", Destinations.of(blocks), 0.0)


def test_expect_refuses_blocks_held_by_a_live_request_until_it_settles() -> None:
    """D10: two overlapping requests were both DONE, one holding the other's bytes."""
    t = tracker()
    t.expect("a", Destinations.of([1, 2]), 0.0)
    with pytest.raises(DestinationError, match="held by live request 'a'"):
        t.expect("b", Destinations.of([2, 3]), 0.0)
    assert "b" not in t
    t.abort("a", 0.0)
    t.expect("b", Destinations.of([2, 3]), 0.0)


def test_a_cached_prefix_shared_by_live_requests_is_not_a_clash() -> None:
    """vLLM's prefix cache gives two requests with the same prompt the same prefix blocks;
    each pulls only its tail (``first_block``). Those shared blocks are never written, so
    the second is expected (it was refused, and its client got a 500, when two clients sent
    one prompt at once); a clash in the written part is still refused."""
    t = tracker()
    t.expect("a", Destinations.of([7, 8, 1]), 0.0, first_block=2)
    t.expect("b", Destinations.of([7, 8, 2]), 0.0, first_block=2)
    with pytest.raises(DestinationError, match="block 2 is held by live request 'b'"):
        t.expect("c", Destinations.of([7, 2]), 0.0, first_block=1)
    t.abort("b", 0.0)
    t.expect("c", Destinations.of([7, 2]), 0.0, first_block=1)  # released: only what b wrote was held


# -- defect 6: Decode gives up --------------------------------------------------------------------


def test_a_request_past_its_deadline_fails() -> None:
    t = tracker(request_timeout=30.0)
    t.expect("default", Destinations.of([0]), 100.0)
    t.expect("own", Destinations.of([1]), 100.0, deadline=5.0)
    assert t.expire(104.0) == []
    assert t.expire(105.0) == ["own"]
    assert t.expire(130.0) == ["default"]
    outcomes = t.take()
    assert all(isinstance(o.error, DeadlineExceeded) for o in outcomes.values())
    assert outcomes["own"].seconds == 5.0


def test_deadlines_expire_in_order_whatever_ended_before_them() -> None:
    """expire skips its scan until the earliest deadline may have passed: a request that
    ended early, or one expected later with an earlier deadline, changes nothing of when
    each expires."""
    t = tracker(request_timeout=None)
    t.expect("gone", Destinations.of([0]), 0.0, deadline=3.0)
    t.expect("b", Destinations.of([1]), 0.0, deadline=10.0)
    assert t.abort("gone", 1.0)  # the earliest deadline belongs to an ended request now
    assert t.expire(4.0) == []
    t.expect("a", Destinations.of([2]), 4.0, deadline=2.0)  # expected later, due sooner: 6.0
    assert t.expire(5.9) == []
    assert t.expire(6.0) == ["a"]
    assert t.expire(9.9) == []
    assert t.expire(10.0) == ["b"]
    assert t.expire(1e9) == []


def test_a_dead_peer_fails_what_it_announced() -> None:
    t = tracker()
    t.expect("a", Destinations.of([0, 1]), 0.0)
    t.expect("b", Destinations.of([2]), 0.0)
    deliver(t, readiness("l0", [("a", 0, 1)]))
    assert t.peer_gone(PEER, PeerGoneError("gone"), 1.0) == ["a"]
    assert isinstance(t.take()["a"].error, PeerGoneError)
    assert t.state("b") is ReceiveState.WAITING  # not announced by that peer
    assert deliver(t, readiness("l0", [("b", 0, 1)])) == {} and t.state("b") is ReceiveState.WAITING  # forgotten: meta required


def test_readiness_before_expect_fails_the_late_expect_at_once() -> None:
    """Defect 6: a readiness that arrived before expect (a rendezvous race) was refused and
    the request then waited for ever."""
    t = tracker()
    assert isinstance(deliver(t, readiness("l0", [("r", 0, 1)]))["r"], UnknownRequestError)
    t.expect("r", Destinations.of([0]), 1.0)
    outcome = t.take()["r"]
    assert outcome.state is TerminalState.FAILED and "rendezvous race" in str(outcome.error)


# -- peers ----------------------------------------------------------------------------------------


def test_an_unknown_peer_is_asked_for_its_meta_and_nothing_fails() -> None:
    t = tracker()
    t.expect("r", Destinations.of([0]), 0.0)
    admission = t.on_readiness(b"stranger", readiness("l0", [("r", 0, 1)]), 0.0)
    assert admission.meta_required and not admission.readable
    assert t.state("r") is ReceiveState.WAITING


def test_a_refused_peer_gets_its_reason_and_its_requests_fail_on_both_sides() -> None:
    """Defect 3: Prefill only ever saw META_REQUIRED and Decode's request waited for ever."""
    t = tracker()
    t.peer_refused(b"old", "old:1", IncompatiblePeerError("speaks protocol 2"))
    t.expect("r", Destinations.of([0]), 0.0)
    failures = deliver(t, readiness("l0", [("r", 0, 1)]), identity=b"old")
    assert isinstance(failures["r"], IncompatiblePeerError)
    assert isinstance(t.take()["r"].error, IncompatiblePeerError)


# -- reads in flight ------------------------------------------------------------------------------


def test_an_abort_during_a_read_settles_after_the_read() -> None:
    t = tracker()
    t.expect("r", Destinations.of([0]), 0.0)
    batch = readiness("l0", [("r", 0, 1)])
    admission = t.on_readiness(PEER, batch, 0.0)
    assert t.reading("r")
    assert t.abort("r", 0.0) is True
    assert t.take() == {}  # the read may still be writing its blocks
    with pytest.raises(DestinationError):
        t.expect("s", Destinations.of([0]), 0.0)  # still held
    t.on_read(PEER, batch, admission, {}, {"r": 64}, 1.0)
    outcome = t.take()["r"]
    assert outcome.state is TerminalState.ABORTED and outcome.nbytes == 64


def test_a_failed_read_fails_only_its_requests() -> None:
    t = tracker()
    t.expect("a", Destinations.of([0]), 0.0)
    t.expect("b", Destinations.of([1]), 0.0)
    failures = deliver(t, readiness("l0", [("a", 0, 1), ("b", 0, 1)]), failed={"a": TransferError("eio")})
    assert set(failures) == {"a"}
    assert t.take().keys() == {"a"} and t.state("b") is ReceiveState.RECEIVING


# -- issue 19: one guarded entry per message; aborts never wait and never contradict Prefill ----------


def test_a_request_named_twice_in_one_readiness_fails_here_as_in_the_reply() -> None:
    """One entry in range, one beyond: the reply refused the request, but Decode kept it
    live and marked as being read for ever (the first entry's mark was never cleared), so
    Sink.abort blocked, the sides disagreed and its blocks stayed held."""
    t = tracker()
    t.expect("r", Destinations.of([0, 1]), 0.0)
    t.expect("n", Destinations.of([2]), 0.0)
    batch = readiness("l0", [("r", 0, 1), ("n", 0, 1), ("r", 1, 40)])
    admission = t.on_readiness(PEER, batch, 0.0)
    assert set(admission.readable) == {"n"} and [e for e, _ in admission.requests] == ["n"]
    assert not t.reading("r")
    failures = t.on_read(PEER, batch, admission, {}, {}, 0.0)
    assert set(failures) == {"r"} and "named twice" in str(failures["r"])
    outcome = t.take()["r"]
    assert outcome.state is TerminalState.FAILED and isinstance(outcome.error, ProtocolError)
    t.expect("s", Destinations.of([0, 1]), 1.0)  # its blocks are free
    assert t.state("n") is ReceiveState.RECEIVING  # its neighbour was read


def test_a_final_signal_named_twice_fails_the_request_and_an_abort_during_that_read_settles() -> None:
    """``done_ext_ids`` naming a request twice raised StateError out of the tracker: no reply,
    and a request aborted during that read never settled (its blocks stayed held; expiry
    skips terminal requests)."""
    t = tracker(request_timeout=5.0)
    for ext_id, block in (("r", 0), ("a", 1)):
        t.expect(ext_id, Destinations.of([block]), 0.0)
        deliver(t, readiness("l0", [(ext_id, 0, 1)]))
    batch = readiness("l1", [("r", 0, 1), ("a", 0, 1)], ("r", "a", "r", "a"))
    admission = t.on_readiness(PEER, batch, 1.0)
    assert t.abort("a", 1.0) is True and t.take() == {}  # the read may be writing its block
    failures = t.on_read(PEER, batch, admission, {}, {}, 1.0)
    assert set(failures) == {"r", "a"}
    assert "named 2 times" in str(failures["r"]) and "aborted on Decode" in str(failures["a"])
    outcomes = t.take()
    assert outcomes["r"].state is TerminalState.FAILED and outcomes["a"].state is TerminalState.ABORTED
    assert len(t) == 0 and not t._held.main.any()


def test_an_abort_during_the_final_read_is_named_failed_in_its_reply() -> None:
    """The abort landed while the final layer was read: the reply said READ_DONE, Prefill
    reported DONE and Decode ABORTED."""
    t = tracker()
    t.expect("r", Destinations.of([0]), 0.0)
    deliver(t, readiness("l0", [("r", 0, 1)]))
    batch = readiness("l1", [("r", 0, 1)], ("r",))
    admission = t.on_readiness(PEER, batch, 1.0)
    t.abort("r", 1.0)
    failures = t.on_read(PEER, batch, admission, {}, {"r": 80}, 1.0)
    assert isinstance(failures["r"], StateError)
    outcome = t.take()["r"]
    assert outcome.state is TerminalState.ABORTED and outcome.nbytes == 80


@pytest.mark.parametrize("prefill_says", ["done", "failed"])
def test_an_abort_after_the_final_layer_was_answered_ends_as_prefill_confirms(prefill_says: str) -> None:
    """Issue 19, item 5: once READ_DONE answered the final layer, Prefill reports the request
    DONE on the strength of that reply; an abort then left Decode ABORTED (13 of 114 soak
    iterations). Now it changes nothing: the request ends as Prefill confirms it, and holds
    its blocks till then."""
    t = tracker()
    t.expect("r", Destinations.of([3]), 0.0)
    for layer in LAYERS:
        deliver(t, readiness(layer, [("r", 0, 1)], ("r",) if layer == LAYERS[-1] else ()), confirm=False)
    assert t.abort("r", 1.0) is True
    assert t.state("r") is ReceiveState.CONFIRMING and t.take() == {}
    with pytest.raises(DestinationError):
        t.expect("s", Destinations.of([3]), 1.0)
    notice = Settled(("r",)) if prefill_says == "done" else Settled.failure(["r"], StateError("aborted on Prefill"))
    assert t.on_settled(PEER, notice, 2.0) == ["r"]
    assert t.take()["r"].state is (TerminalState.DONE if prefill_says == "done" else TerminalState.FAILED)


def _broken(*_: object, **__: object) -> None:
    raise RuntimeError("a defect nobody foresaw")


def test_an_exception_while_applying_a_read_fails_what_it_named_and_the_tracker_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    t = tracker()
    t.expect("a", Destinations.of([0]), 0.0)
    t.expect("b", Destinations.of([1]), 0.0)
    t.expect("other", Destinations.of([2]), 0.0)
    batch = readiness("l0", [("a", 0, 1), ("b", 0, 1), ("ghost", 0, 1)], ("a",))
    admission = t.on_readiness(PEER, batch, 0.0)
    with monkeypatch.context() as patch:
        patch.setattr(t, "_final", _broken)
        failures = t.on_read(PEER, batch, admission, {}, {}, 0.0)
    assert set(failures) == {"a", "b", "ghost"} and "RuntimeError" in str(failures["a"])
    assert {e: o.state for e, o in t.take().items()} == {"a": TerminalState.FAILED, "b": TerminalState.FAILED}
    assert t.live() == ["other"] and not t.reading("other")
    assert send_all(t, "other", 1) == {} and t.take()["other"].ok  # the tracker serves on


def test_an_exception_while_admitting_a_readiness_fails_only_what_that_peer_may_announce(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    t = ReceiveTracker(layouts())
    t.peer_admitted(PEER, "p", {"alice"})
    t.peer_admitted(MALLORY, "m", {"mallory"})
    t.expect("bound", Destinations.of([1]), 0.0, expected_peer="alice")
    t.expect("free", Destinations.of([2]), 0.0)
    batch = readiness("l0", [("bound", 0, 1), ("free", 0, 1)])
    with monkeypatch.context() as patch:
        patch.setattr(t, "_why_unreadable", _broken)
        admission = t.on_readiness(MALLORY, batch, 0.0)
    assert not admission.readable and set(admission.refused) == {"bound", "free"}
    assert t.state("bound") is ReceiveState.WAITING  # not Mallory's to fail
    assert t.take()["free"].state is TerminalState.FAILED
    assert t.on_read(MALLORY, batch, admission, {}, {}, 0.0).keys() == {"bound", "free"}  # all named in the reply


def test_an_exception_while_applying_a_settled_notice_fails_what_it_named(monkeypatch: pytest.MonkeyPatch) -> None:
    t = tracker()
    t.expect("r", Destinations.of([1]), 0.0)
    deliver(t, readiness("l0", [("r", 0, 1)]))
    with monkeypatch.context() as patch:
        patch.setattr(t, "_may_settle", _broken)
        assert t.on_settled(PEER, Settled.failure(["r", "unknown"], StateError("x")), 1.0) == ["r"]
    assert isinstance(t.take()["r"].error, ProtocolError)


# -- configuration and the main split -------------------------------------------------------------


def test_bad_configuration_is_refused() -> None:
    with pytest.raises(ConfigError, match="main_split 'mirror'"):
        ReceiveTracker(layouts(), main_split="mirror")
    with pytest.raises(ConfigError):
        ReceiveTracker({})
    with pytest.raises(ConfigError):
        ReceiveTracker(layouts(), decode_rank=2, decode_tp=2)


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (2, 1), (4, 2), (1, 2), (2, 4)])
def test_replicated_main_gives_every_rank_every_block_once(p_tp: int, d_tp: int) -> None:
    """In replicated mode each Decode rank owns a full copy: its contributors split the main
    blocks between them (as they split the indexer), so each rank reads each block once."""
    from rd2h.layout.topology import Topology

    topo = Topology(p_tp, d_tp)
    n = 11
    dest = {"r": Destinations.of(np.arange(n) + 100)}
    for d_rank in range(d_tp):
        got: list[int] = []
        for p_rank in topo.contributors_of(d_rank):
            batch = ReadReadyBatch(0, "l0", (ReadRequest("r", tuple(range(n)), tuple(range(n)), 0, 0),), (), topo.member_of(p_rank), topo.ratio)
            reads, _ = plan_reads(batch, dest, decode_rank=d_rank, decode_tp=d_tp, main_split=MainSplit.REPLICATED)
            got += reads[0].dst_main.tolist()
        assert sorted(got) == list(range(100, 100 + n))


# -- the stateful machine ---------------------------------------------------------------------------


class ReceiveMachine(RuleBasedStateMachine):
    """Random local calls, readiness (good, bad, repeated, early, partial) from the expected
    Prefill, another admitted one and a refused one, read failures, time and peer deaths; a
    model of what was really read checks every DONE, and a request bound to its Prefill is
    never touched by another peer (issue 9)."""

    @initialize(ratio=st.sampled_from([1, 2]))
    def setup(self, ratio: int) -> None:
        self.t = ReceiveTracker(layouts(8), request_timeout=50.0)
        self.t.peer_admitted(PEER, "p", {"alice"})
        self.t.peer_admitted(MALLORY, "m", {"mallory"})
        self.t.peer_refused(REFUSED, "r", IncompatiblePeerError("no"))
        self.bound: set[str] = set()  # live requests expected from "alice" only
        self.ratio = ratio
        self.now = 0.0
        self.live: dict[str, tuple[Destinations, int]] = {}  # id -> (destinations, first block)
        self.read: dict[str, set[tuple[int, str, int]]] = {}  # id -> (member, layer, position) read
        self.given: set[str] = set()
        self.settled: set[str] = set()  # settled, not collected
        self.reported: list[str] = []
        self.confirmed: set[str] = set()  # a Prefill said done while they were live

    ids = st.sampled_from(["a", "b", "c", "d"])

    @rule(ext_id=ids, blocks=st.lists(st.integers(0, 8), min_size=0, max_size=4), first=st.integers(0, 2), deadline=st.none() | st.floats(1, 60), bound=st.booleans())
    def expect(self, ext_id: str, blocks: list[int], first: int, deadline: float | None, bound: bool) -> None:
        try:
            self.t.expect(
                ext_id, Destinations.of(blocks), self.now, first_block=first, deadline=deadline,
                expected_peer="alice" if bound else None,
            )
        except (DuplicateRequestError, DestinationError, ConfigError):
            assert ext_id in self.live or ext_id in self.settled or len(set(blocks)) < len(blocks) or 8 in blocks or first > len(blocks) or self._overlaps(blocks[first:])
            return
        assert ext_id not in self.live and ext_id not in self.settled
        self.given.add(ext_id)
        self.confirmed.discard(ext_id)
        if bound:
            self.bound.add(ext_id)
        self.live[ext_id] = (Destinations.of(blocks), first)
        self.read[ext_id] = set()
        self._sync()

    def _overlaps(self, written: list[int]) -> bool:
        """Whether blocks a request would write are written by a live one (a shared prefix is not)."""
        return any(set(written) & set(d.main[first:].tolist()) for d, first in self.live.values())

    @rule(data=st.data(), layer=st.sampled_from(LAYERS), member=st.integers(0, 1), final=st.booleans(), fail=st.booleans(),
          sender=st.sampled_from([PEER, PEER, MALLORY, REFUSED]), twice=st.sampled_from(["no", "no", "reqs", "finals"]),
          meanwhile=st.sampled_from(["nothing", "nothing", "abort", "fail"]))
    def readiness(
        self, data: st.DataObject, layer: str, member: int, final: bool, fail: bool, sender: bytes, twice: str,
        meanwhile: str,
    ) -> None:
        """A readiness, hostile at times: a request named twice (in the reads or in the final
        signals, issue 19), a local abort or failure while its read runs."""
        self._readiness(data, data.draw(st.lists(self.ids, max_size=3, unique=True)), layer, member, final, fail,
                        sender, twice, meanwhile)  # fmt: skip

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data(), layer=st.sampled_from(LAYERS), final=st.booleans(), twice=st.sampled_from(["reqs", "finals"]),
          meanwhile=st.sampled_from(["nothing", "abort", "fail"]))
    def live_request_named_twice(self, data: st.DataObject, layer: str, final: bool, twice: str, meanwhile: str) -> None:
        """The holes of issue 19, often: a live request first, named twice by its own Prefill."""
        first = data.draw(st.sampled_from(sorted(self.live)))
        others = data.draw(st.lists(self.ids.filter(lambda e: e != first), max_size=2, unique=True))
        self._readiness(data, [first, *others], layer, 0, final, False, PEER, twice, meanwhile)

    def _readiness(
        self, data: st.DataObject, chosen: list[str], layer: str, member: int, final: bool, fail: bool,
        sender: bytes, twice: str, meanwhile: str,
    ) -> None:
        member %= self.ratio
        reqs = [(e, data.draw(st.integers(0, 3)), data.draw(st.integers(0, 4))) for e in chosen]
        done = tuple(chosen) if final else ()
        if twice == "reqs" and reqs:
            reqs.append((reqs[0][0], data.draw(st.integers(0, 3)), data.draw(st.integers(0, 6))))
        if twice == "finals" and chosen:
            done = (*done, chosen[0], chosen[0])
        batch = readiness(layer, reqs, done, member, self.ratio)
        failed = {e: TransferError("boom") for e in chosen[:1]} if fail else {}
        foreign = {e for e in chosen if e in self.bound and e in self.live and sender != PEER}
        before = {e: self.t.state(e) for e in foreign}
        readable_first = bool(chosen) and chosen[0] in self.live and chosen[0] not in foreign and sender != REFUSED and (
            self.t.state(chosen[0]) in (ReceiveState.WAITING, ReceiveState.RECEIVING)
        )
        admission = self.t.on_readiness(sender, batch, self.now)
        assert not foreign & set(admission.readable)  # never read for another peer
        ended_during = set()
        for e in list(admission.readable)[:1] if meanwhile != "nothing" else ():  # a user thread, mid-read
            if meanwhile == "abort":
                assert self.t.abort(e, self.now)
            else:
                assert self.t.fail(e, RD2HError("local"), self.now)
            ended_during.add(e)
            assert e in self.t.live() and self.t.reading(e)  # settles only once the read ended
        _, refused = plan_reads(batch, admission.readable, decode_rank=0, decode_tp=1)
        replied = self.t.on_read(sender, batch, admission, {**refused, **failed}, {}, self.now)
        for e in foreign:  # refused in the reply, and neither poisoned nor advanced
            assert e in replied and self.t.state(e) is before[e], (e, sender)
        for e, start, count in reqs:
            if e in admission.readable and e not in replied and e not in refused and e not in failed:
                self.read[e] |= {(member, layer, p) for p in range(start, start + count)}
        for e in chosen:  # a request not live is always refused, never silently dropped
            if e not in self.live:
                assert e in replied
        for e in ended_during:  # Prefill is told, so it cannot report DONE what Decode ended
            assert e in replied and e not in self.t.live()
        if twice != "no" and readable_first:  # named twice: failed in the reply and here alike
            assert chosen[0] in replied and chosen[0] not in self.t.live(), chosen[0]
        self._sync()

    @rule(ext_id=ids, members=st.sampled_from(["one", "all"]), confirm=st.booleans())
    def send_wholly(self, ext_id: str, members: str, confirm: bool) -> None:
        """What honest Prefill ranks send for one request: every layer of it, final on the
        last, and (``confirm``) that it is done once the reply came; from one contributor
        of the group or from all."""
        if ext_id not in self.live:
            return
        dest, first = self.live[ext_id]
        count = len(dest.main) - first
        for member, layer in [(m, layer) for m in range(self.ratio if members == "all" else 1) for layer in LAYERS]:
            done = (ext_id,) if layer == LAYERS[-1] else ()
            batch = readiness(layer, [(ext_id, first, count)], done, member, self.ratio)
            admission = self.t.on_readiness(PEER, batch, self.now)
            _, refused = plan_reads(batch, admission.readable, decode_rank=0, decode_tp=1)
            replied = self.t.on_read(PEER, batch, admission, refused, {}, self.now)
            if ext_id in admission.readable and ext_id not in replied:
                self.read[ext_id] |= {(member, layer, p) for p in range(first, first + count)}
        if confirm and ext_id in self.live:
            self.t.on_settled(PEER, Settled((ext_id,)), self.now)
            self.confirmed.add(ext_id)
        self._sync()

    @rule(data=st.data(), sender=st.sampled_from([PEER, PEER, MALLORY, REFUSED, b"stranger"]), fail=st.booleans())
    def settled(self, data: st.DataObject, sender: bytes, fail: bool) -> None:
        """Prefill says how requests ended: in any state, from any peer, even unasked."""
        chosen = tuple(data.draw(st.lists(self.ids, max_size=3, unique=True)))
        foreign = {e for e in chosen if e in self.bound and e in self.live and sender != PEER}
        before = {e: self.t.state(e) for e in foreign}
        message = Settled.failure(chosen, StateError("gave up")) if fail else Settled(chosen)
        self.t.on_settled(sender, message, self.now)
        for e in foreign:  # a request bound to its Prefill is settled by that Prefill only
            assert self.t.state(e) is before[e], (e, sender)
        if not fail and sender in (PEER, MALLORY):
            self.confirmed |= {e for e in chosen if e in self.live}
        self._sync()

    @rule(ext_id=ids)
    def abort(self, ext_id: str) -> None:
        assert self.t.abort(ext_id, self.now) == (ext_id in self.live)
        self._sync()

    @rule(ext_id=ids)
    def fail(self, ext_id: str) -> None:
        assert self.t.fail(ext_id, RD2HError("local"), self.now) == (ext_id in self.live)
        self._sync()

    @rule(seconds=st.floats(0, 40))
    def advance(self, seconds: float) -> None:
        self.now += seconds
        self.t.expire(self.now)
        self._sync()

    @rule()
    def peer_dies_and_returns(self) -> None:
        self.t.peer_gone(PEER, PeerGoneError("gone"), self.now)
        self.t.peer_admitted(PEER, "p", {"alice"})
        self._sync()

    @rule()
    def take(self) -> None:
        outcomes = self.t.take()
        assert set(outcomes) == self.settled
        for ext_id, outcome in outcomes.items():
            assert ext_id in self.given
            if outcome.state is TerminalState.DONE:
                assert ext_id in self.confirmed, ext_id  # never DONE before its Prefill said so
                dest, first = self._done_info.pop(ext_id)
                for member in range(self.ratio):
                    for layer in LAYERS:
                        for p in range(first, len(dest.main)):
                            assert (member, layer, p) in self._done_read[ext_id], (ext_id, member, layer, p)
            assert (outcome.error is None) == (outcome.state is not TerminalState.FAILED)
        self.reported += list(outcomes)
        self.settled.clear()

    def _sync(self) -> None:
        """Move what the tracker settled from live to settled, keeping what DONE must prove."""
        if not hasattr(self, "_done_info"):
            self._done_info: dict[str, tuple[Destinations, int]] = {}
            self._done_read: dict[str, set[tuple[int, str, int]]] = {}
        for ext_id in list(self.live):
            if ext_id not in self.t.live():
                self.bound.discard(ext_id)
                if self.t.state(ext_id) is not ReceiveState.DONE:
                    self.confirmed.discard(ext_id)
                self._done_info[ext_id] = self.live.pop(ext_id)
                self._done_read[ext_id] = self.read.pop(ext_id)
                self.settled.add(ext_id)

    @invariant()
    def no_request_is_left_reading(self) -> None:
        """Between messages no read is in flight: a flag left set would hold the request (and
        its blocks) for ever (issue 19: a request named twice in one readiness)."""
        if hasattr(self, "t"):
            assert not [e for e in self.t.live() if self.t.reading(e)]

    @invariant()
    def only_live_requests_hold_blocks(self) -> None:
        if hasattr(self, "t"):
            held = sorted(b for d, first in self.live.values() for b in d.main[first:].tolist())  # the written part
            assert sorted(np.flatnonzero(self.t._held.main).tolist()) == held
            assert set(self.t.live()) == set(self.live)

    def teardown(self) -> None:
        if hasattr(self, "t"):  # every request ends: abort what is live, then all are reported
            for ext_id in list(self.live):
                self.t.abort(ext_id, self.now)
            for ext_id in self.t.live():  # answered READ_DONE: an abort changes nothing, Prefill decides
                assert self.t.state(ext_id) is ReceiveState.CONFIRMING
                self.t.fail(ext_id, RD2HError("Prefill failed it"), self.now)
            self._sync()
            self.take()
            assert len(self.t) == 0


ReceiveMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
TestReceiveMachine = ReceiveMachine.TestCase


@pytest.mark.parametrize("confirms", [True, False])
def test_a_lost_reply_fails_on_decode_what_prefill_will_fail(confirms: bool) -> None:
    """Issue 9 D9 after a stall: a Decode that resumes after Prefill gave up on it completed
    the request DONE while Prefill reported ReplyTimeout, and neither side knew. The reply
    that would have said DONE cannot be sent: Decode fails the request too."""
    from rd2h.errors import ChannelError

    t = tracker()
    t.peer_admitted(PEER, "prefill:0", confirms=confirms)
    t.expect("r", Destinations.of([0]), 0.0)
    t.expect("s", Destinations.of([1, 2]), 0.0)
    deliver(t, readiness("l0", [("r", 0, 1), ("s", 0, 1)]))
    batch = readiness("l1", [("r", 0, 1), ("s", 0, 1)], ("r",))
    admission = t.on_readiness(PEER, batch, 1.0)
    assert t.on_read(PEER, batch, admission, {}, {}, 1.0) == {}
    # a reference peer never confirms: DONE, settled and not collected; ours: waits for its word
    assert t.state("r") is (ReceiveState.CONFIRMING if confirms else ReceiveState.DONE)
    assert sorted(t.reply_lost(admission, ChannelError("peer gone"), 2.0)) == ["r", "s"]
    outcomes = t.take()
    assert {e: o.state for e, o in outcomes.items()} == {"r": TerminalState.FAILED, "s": TerminalState.FAILED}
    assert isinstance(outcomes["r"].error, ChannelError) and outcomes["r"].finished == 2.0
