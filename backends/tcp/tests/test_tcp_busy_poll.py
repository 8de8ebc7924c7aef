"""``busy_poll_us``: an end polls awake for that long after its last frame, and sleeps when idle.

Whether a thread polled or slept shows in its own CPU time (``time.thread_time``): a ``recv``
that waits 0.2 s for nothing spends almost no CPU asleep in ``epoll``, and a clear share of
its window when it polls. The bounds are far apart (under 20 ms asleep, over 2 ms awake for a
0.1 s window) so that a loaded machine, which gives a polling thread fewer slices, cannot
blur them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

import pytest
from rd2h_tcp.busy_poll import poll_briefly

from rd2h import plugins

T = TypeVar("T")

WINDOW_US = 100_000
WAIT = 0.2


def _cpu_of(call: Callable[[], T]) -> tuple[T, float]:
    started = time.thread_time()
    result = call()
    return result, time.thread_time() - started


def _pair(closer: Callable[[T], T], busy_poll_us: int) -> tuple[object, object]:
    channel = plugins.load_channel("tcp", busy_poll_us=busy_poll_us)
    listener = closer(channel.listen("tcp://127.0.0.1:0"))
    dialer = closer(channel.dialer())
    return listener, dialer


@pytest.mark.parametrize("busy_poll_us", [0, WINDOW_US])
def test_an_idle_listener_sleeps_whatever_the_window(closer: Callable[[T], T], busy_poll_us: int) -> None:
    listener, _ = _pair(closer, busy_poll_us)
    got, cpu = _cpu_of(lambda: listener.recv(WAIT))  # type: ignore[attr-defined]
    assert got is None
    assert cpu < 0.02, f"an idle recv spent {cpu * 1e3:.1f} ms of CPU: it polled with no frame seen"


@pytest.mark.parametrize("busy_poll_us", [0, WINDOW_US])
def test_a_listener_polls_awake_only_with_the_option_after_a_frame(closer: Callable[[T], T], busy_poll_us: int) -> None:
    listener, dialer = _pair(closer, busy_poll_us)
    dialer.send(listener.address, b"readiness")  # type: ignore[attr-defined]
    peer, payload = listener.recv(5.0)  # type: ignore[attr-defined]
    assert payload == b"readiness"
    listener.send(peer, b"read_done")  # type: ignore[attr-defined]
    got, cpu = _cpu_of(lambda: listener.recv(WAIT))  # type: ignore[attr-defined]
    assert got is None
    if busy_poll_us:
        assert cpu > 0.002, f"recv after a frame spent {cpu * 1e3:.2f} ms of CPU: it slept instead of polling"
    else:
        assert cpu < 0.02, f"recv with busy_poll_us=0 spent {cpu * 1e3:.1f} ms of CPU: it polled"


@pytest.mark.parametrize("busy_poll_us", [0, WINDOW_US])
def test_a_dialer_waiting_for_a_reply_polls_awake_only_with_the_option(closer: Callable[[T], T], busy_poll_us: int) -> None:
    listener, dialer = _pair(closer, busy_poll_us)
    dialer.send(listener.address, b"readiness")  # type: ignore[attr-defined]
    assert listener.recv(5.0) is not None  # type: ignore[attr-defined]
    got, cpu = _cpu_of(lambda: dialer.recv(WAIT))  # type: ignore[attr-defined]  # no reply comes
    assert got is None
    if busy_poll_us:
        assert cpu > 0.002, f"a dialer waiting after its send spent {cpu * 1e3:.2f} ms of CPU: it slept"
    else:
        assert cpu < 0.02, f"a dialer with busy_poll_us=0 spent {cpu * 1e3:.1f} ms of CPU waiting: it polled"


def test_a_frame_that_lands_while_polling_is_returned_and_a_wakeup_ends_the_poll(closer: Callable[[T], T]) -> None:
    listener, dialer = _pair(closer, WINDOW_US)
    dialer.send(listener.address, b"first")  # type: ignore[attr-defined]
    peer, _ = listener.recv(5.0)  # type: ignore[attr-defined]
    # the reply is sent from another thread while this one is in recv, polling awake after its send
    threading.Thread(target=lambda: listener.send(peer, b"reply"), daemon=True).start()  # type: ignore[attr-defined]
    assert dialer.recv(5.0) == (listener.address, b"reply")  # type: ignore[attr-defined]
    dialer.send(listener.address, b"second")  # type: ignore[attr-defined]  # the dialer polls awake now
    woke: list[object] = []
    waiter = threading.Thread(target=lambda: woke.append(dialer.recv(30.0)), daemon=True)  # type: ignore[attr-defined]
    waiter.start()
    dialer.wakeup()  # type: ignore[attr-defined]
    waiter.join(10.0)
    assert woke == [None], "wakeup() did not end a recv that was polling awake"


def test_poll_briefly_stops_at_the_first_report_or_at_its_deadline() -> None:
    calls: list[int] = []

    def ready_on_third() -> list[int]:
        calls.append(1)
        return [7] if len(calls) == 3 else []

    assert poll_briefly(ready_on_third, time.monotonic() + 60.0) == [7]
    assert len(calls) == 3
    assert poll_briefly(ready_on_third, time.monotonic() - 1.0) == []  # a past deadline: no poll at all
    assert len(calls) == 3
