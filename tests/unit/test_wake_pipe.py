"""The self-pipe both socket channels' dialers wait on (``rd2h.wake_pipe``): a kick makes a
blocked poll return, a wake makes it return and says so once, a kick never blocks (a full
pipe drops it) and nothing is written after close."""

from __future__ import annotations

import os
import select
import threading

from rd2h.wake_pipe import WakePipe


def readable(pipe: WakePipe, timeout_ms: int) -> bool:
    poller = select.poll()
    poller.register(pipe.fd, select.POLLIN)
    return bool(poller.poll(timeout_ms))


def test_a_kick_makes_the_fd_readable_and_drain_empties_it_without_saying_woken() -> None:
    pipe = WakePipe()
    try:
        assert not readable(pipe, 0)
        pipe.kick()
        assert readable(pipe, 0)
        assert pipe.drain() is False  # looked again, not asked to return
        assert not readable(pipe, 0)
    finally:
        pipe.close()


def test_a_wake_is_reported_by_one_drain() -> None:
    pipe = WakePipe()
    try:
        pipe.wake()
        pipe.kick()
        assert readable(pipe, 0)
        assert pipe.drain() is True
        assert pipe.drain() is False
    finally:
        pipe.close()


def test_a_wake_from_another_thread_ends_a_blocked_poll() -> None:
    pipe = WakePipe()
    woke = threading.Event()
    try:
        thread = threading.Thread(target=lambda: readable(pipe, 30_000) and pipe.drain() and woke.set())
        thread.start()
        pipe.wake()
        thread.join(30)
        assert woke.is_set()
    finally:
        pipe.close()


def test_kicks_into_a_full_pipe_never_block() -> None:
    pipe = WakePipe()
    try:
        for _ in range(70_000):  # more bytes than a pipe buffer holds (64 KiB here)
            pipe.kick()
        assert pipe.drain() is False
        assert not readable(pipe, 0)
    finally:
        pipe.close()


def test_after_close_a_kick_writes_to_no_fd_and_close_is_idempotent() -> None:
    pipe = WakePipe()
    pipe.close()
    assert pipe.closed
    r, w = os.pipe()  # may reuse the closed numbers: a late kick must not write into them
    try:
        pipe.kick()
        pipe.wake()
        os.set_blocking(r, False)
        try:
            assert os.read(r, 1) == b""
        except BlockingIOError:
            pass
        else:
            raise AssertionError("a kick after close wrote into a reused fd")
    finally:
        os.close(r)
        os.close(w)
    pipe.close()
