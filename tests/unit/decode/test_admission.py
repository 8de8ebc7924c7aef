"""The handshakes Decode runs off its loop (rd2h.decode.admission): what a peer may send meanwhile is
bounded in frames and bytes, frames come back in order, and a connect's failure is a result."""

from __future__ import annotations

import threading

import pytest

from rd2h.decode import admission
from rd2h.errors import TransferError
from rd2h.wire.layer_metadata import encode_layer_metadata
from rd2h.wire.mf_meta import MfMeta

META = MfMeta("p", encode_layer_metadata({}))


class FakeSession:
    closed = False

    def close(self) -> None:
        self.closed = True


def test_frames_wait_in_order_within_both_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(admission, "MAX_HELD_FRAMES", 3)
    monkeypatch.setattr(admission, "MAX_HELD_BYTES", 10)
    release, session = threading.Event(), FakeSession()
    admissions = admission.Admissions(rank=0)
    try:
        assert admissions.start(b"peer", META, {}, lambda: release.wait(10) and session)
        assert b"peer" in admissions and admissions.finished() == []
        for frame in (b"1234", b"5678", b"abc", b"d"):  # the third passes the 10-byte bound
            admissions.hold(b"peer", frame)
        release.set()
        assert admissions.wait_any(10)
        ((identity, handshake),) = admissions.finished()
        assert identity == b"peer" and handshake.result() is session
        assert handshake.held == [b"1234", b"5678", b"d"] and handshake.dropped == 1
        assert not admissions
    finally:
        admissions.close()


def test_a_failed_or_crashing_connect_is_a_result_and_the_pending_count_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(admission, "MAX_PENDING", 2)
    release = threading.Event()
    admissions = admission.Admissions(rank=0)

    def refused() -> FakeSession:
        release.wait(10)
        raise TransferError("no proof")

    def crashing() -> FakeSession:
        release.wait(10)
        raise KeyError("engine bug")

    try:
        assert admissions.start(b"a", META, {}, refused) and admissions.start(b"b", META, {}, crashing)
        assert not admissions.start(b"c", META, {}, refused)  # the third waits for nobody
        release.set()
        results: dict[bytes, object] = {}
        while len(results) < 2:
            assert admissions.wait_any(10), f"handshakes still running after 10 s: {results}"
            results.update((i, h.result()) for i, h in admissions.finished())
        assert isinstance(results[b"a"], TransferError) and "no proof" in str(results[b"a"])
        assert isinstance(results[b"b"], TransferError) and "KeyError" in str(results[b"b"])
    finally:
        admissions.close()


def test_wait_any_returns_when_a_handshake_ends_and_false_when_none_runs() -> None:
    release = threading.Event()
    admissions = admission.Admissions(rank=0)
    try:
        assert not admissions.wait_any(0.0)  # nothing in progress
        admissions.start(b"p", META, {}, lambda: release.wait(10) and FakeSession())
        assert not admissions.wait_any(0.01)  # still connecting
        release.set()
        assert admissions.wait_any(10) and [i for i, _ in admissions.finished()] == [b"p"]
    finally:
        admissions.close()


def test_close_closes_what_a_handshake_still_opened() -> None:
    release, session = threading.Event(), FakeSession()
    admissions = admission.Admissions(rank=0)
    admissions.start(b"late", META, {}, lambda: release.wait(10) and session)
    release.set()
    admissions.close()  # waits for the running connect, then closes the session nobody took
    assert session.closed and not admissions


def test_what_all_handshakes_hold_has_one_budget_and_the_biggest_holder_pays(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 19, item 4: 64 peers x 32 MiB was 2 GiB held. Now every peer together holds at
    most MAX_HELD_TOTAL; past it, the peer holding the most loses what it holds (and what it
    sends until its handshake ends), so a peer with a few small frames keeps them."""
    monkeypatch.setattr(admission, "MAX_HELD_BYTES", 10)
    monkeypatch.setattr(admission, "MAX_HELD_TOTAL", 16)
    release = threading.Event()
    admissions = admission.Admissions(rank=0)
    try:
        for peer in (b"hog", b"small", b"late"):
            assert admissions.start(peer, META, {}, lambda: release.wait(10) and FakeSession())
        admissions.hold(b"hog", b"x" * 10)
        admissions.hold(b"small", b"ab")
        admissions.hold(b"small", b"cd")
        assert admissions.held_bytes == 14
        admissions.hold(b"late", b"123")  # 17 > 16: the hog (10 bytes, more than late's 3) pays
        assert admissions.held_bytes == 7 and admissions.dropped == 1
        admissions.hold(b"hog", b"y")  # the hog's later frames are dropped too
        admissions.hold(b"late", b"456789")  # late: 9
        admissions.hold(b"small", b"ef")  # 15
        admissions.hold(b"late", b"12")  # 17: late is the biggest holder itself: this frame is dropped
        assert admissions.held_bytes == 15 and admissions.dropped == 3
        release.set()
        ended: dict[bytes, admission.Handshake] = {}
        while len(ended) < 3:
            assert admissions.wait_any(10)
            ended.update(admissions.finished())
        assert ended[b"hog"].held == [] and ended[b"hog"].dropped == 2
        assert ended[b"small"].held == [b"ab", b"cd", b"ef"] and ended[b"late"].held == [b"123", b"456789"]
        assert admissions.held_bytes == 0
    finally:
        release.set()
        admissions.close()


def test_no_handshake_waits_for_another_to_start() -> None:
    """Issue 19, item 3: with 4 helper threads, 20 hanging proofs delayed a Prefill's own by
    46.5 s. Every handshake in progress now has its thread: the last one of MAX_PENDING runs
    while all the others hang."""
    release, started = threading.Event(), threading.Event()
    admissions = admission.Admissions(rank=0)
    try:
        for i in range(admission.MAX_PENDING - 1):
            assert admissions.start(b"hang%d" % i, META, {}, lambda: release.wait(10) and FakeSession())
        assert admissions.start(b"last", META, {}, lambda: started.set() or FakeSession())
        assert started.wait(10) and admissions.wait_any(10)
        assert [i for i, _ in admissions.finished()] == [b"last"]
    finally:
        release.set()
        admissions.close()


def test_a_refusal_keeps_no_traceback() -> None:
    """A refusal is kept for the peer's life; its traceback kept the handshake, and every
    frame it held, alive (measured: 8 hanging peers left 66 MiB of frames after they left)."""
    admissions = admission.Admissions(rank=0)

    def refused() -> FakeSession:
        raise TransferError("no proof")

    try:
        admissions.start(b"p", META, {}, refused)
        assert admissions.wait_any(10)
        ((_, handshake),) = admissions.finished()
        error = handshake.result()
        assert isinstance(error, TransferError) and error.__traceback__ is None and error.__context__ is None
    finally:
        admissions.close()
