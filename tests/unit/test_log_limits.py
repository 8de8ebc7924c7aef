"""The log limiter (pure, time injected) and the QuietLog that writes its lines."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rd2h.clock import ManualClock
from rd2h.log_limits import OTHER_PEERS, LogLimiter
from rd2h.quiet_log import QuietLog, quiet


def test_first_occurrence_is_logged_then_one_line_per_interval_with_the_count() -> None:
    limiter = LogLimiter(interval=10.0)
    first = limiter.hit("malformed", b"p", 0.0, "a")
    assert first is not None and first.suppressed == 0 and first.detail == "a"
    assert all(limiter.hit("malformed", b"p", t, "x") is None for t in (1.0, 5.0, 9.99))
    assert limiter.suppressed == 3
    line = limiter.hit("malformed", b"p", 10.0, "b")
    assert line is not None and (line.suppressed, line.seconds, line.detail) == (3, 10.0, "b")
    assert limiter.suppressed == 0
    assert limiter.hit("malformed", b"p", 12.0) is None  # a new interval began at 10.0


def test_keys_are_per_reason_and_per_peer() -> None:
    limiter = LogLimiter(interval=10.0)
    assert limiter.hit("malformed", b"p", 0.0) is not None
    assert limiter.hit("malformed", b"q", 0.0) is not None  # another peer
    assert limiter.hit("reply lost", b"p", 0.0) is not None  # another reason
    assert limiter.hit("malformed", b"p", 0.0) is None


def test_a_count_left_at_the_end_of_its_interval_is_due_with_its_last_occurrence() -> None:
    limiter = LogLimiter(interval=10.0)
    limiter.hit("r", "p", 0.0, "first")
    for t, detail in ((1.0, "x"), (2.0, "y"), (3.0, "last")):
        limiter.hit("r", "p", t, detail)
    assert limiter.due(9.0) == []
    (line,) = limiter.due(10.0)
    # the line is the last occurrence; it carries the count of the two before it
    assert (line.reason, line.peer, line.suppressed, line.detail) == ("r", "p", 2, "last")
    assert limiter.suppressed == 0 and limiter.due(15.0) == []


def test_keys_quiet_for_an_interval_are_forgotten_and_log_again_at_once() -> None:
    limiter = LogLimiter(interval=10.0)
    limiter.hit("r", "p", 0.0)
    assert len(limiter) == 1
    assert limiter.due(10.0) == [] and len(limiter) == 0
    line = limiter.hit("r", "p", 11.0)
    assert line is not None and line.suppressed == 0


def test_past_max_keys_new_peers_share_one_key_per_reason() -> None:
    limiter = LogLimiter(interval=10.0, max_keys=3)
    logged = [limiter.hit("r", i, 0.0) for i in range(1000)]
    assert len(limiter) == 4  # three peers and the shared key of the rest
    lines = [line for line in logged if line is not None]
    assert [line.peer for line in lines] == [0, 1, 2, OTHER_PEERS]
    assert limiter.suppressed == 1000 - 4


def test_bad_arguments_are_refused_with_their_name() -> None:
    with pytest.raises(ValueError, match="interval"):
        LogLimiter(interval=0)
    with pytest.raises(ValueError, match="max_keys"):
        LogLimiter(max_keys=0)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["a", "b"]), st.integers(0, 5), st.floats(0, 3, allow_nan=False)), max_size=300
    ),
    st.integers(1, 4),
)
def test_every_occurrence_is_a_line_or_in_a_lines_count_and_lines_stay_bounded(events: list, max_keys: int) -> None:
    """Whatever the order and pace: lines + the counts they carry == occurrences, once every
    count is due; a key never writes two lines within one interval."""
    interval = 2.0
    limiter = LogLimiter(interval=interval, max_keys=max_keys)
    now, reported, last_line = 0.0, 0, {}
    for reason, peer, step in events:
        now += step
        for line in [*limiter.due(now), limiter.hit(reason, peer, now)]:
            if line is None:
                continue
            key = (line.reason, line.peer)
            assert key not in last_line or now - last_line[key] >= interval
            last_line[key] = now
            reported += 1 + line.suppressed
    reported += sum(1 + line.suppressed for line in limiter.due(now + interval))
    assert reported == len(events) and limiter.suppressed == 0


def test_quiet_log_writes_the_count_on_the_next_line_and_on_flush(caplog: pytest.LogCaptureFixture) -> None:
    clock = ManualClock()
    log = QuietLog(logging.getLogger("rd2h.test.quiet"), interval=10.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="rd2h.test.quiet"):
        for i in range(5000):
            log.warning("malformed", b"peer", "dropped message %d from %r", i, b"peer")
        assert [r.getMessage() for r in caplog.records] == ["dropped message 0 from b'peer'"]
        assert log.suppressed == 4999
        clock.advance(10.0)
        assert log.flush() == 1
        assert caplog.records[-1].getMessage() == (
            "dropped message 4999 from b'peer' (and 4998 more like this in the last 10.0 s)"
        )
        assert log.suppressed == 0 and log.flush() == 0
        log.error("refused", b"peer", "refused %s", "x")
        assert caplog.records[-1].levelno == logging.ERROR


def test_quiet_log_counts_nothing_for_a_level_that_is_off(caplog: pytest.LogCaptureFixture) -> None:
    log = QuietLog(logging.getLogger("rd2h.test.quiet.off"), clock=ManualClock())
    with caplog.at_level(logging.ERROR, logger="rd2h.test.quiet.off"):
        assert not log.warning("r", "p", "never written")
    assert log.suppressed == 0 and caplog.records == []


def test_quiet_is_one_log_per_logger() -> None:
    logger = logging.getLogger("rd2h.test.quiet.shared")
    assert quiet(logger) is quiet(logging.getLogger("rd2h.test.quiet.shared"))
    assert quiet(logger).logger is logger
