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
