"""Decode's rendezvous poster: a queue and thread per URL, a deadline per post, bounded memory.

Real HTTP on loopback where the transport matters (a metaserver that answers, a black hole that
never does); a fake post, clock and wait where only the schedule of tries matters. Tests wait
on events and conditions, never on sleeps.
"""

from __future__ import annotations

import json
import logging
import select
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rd2h.vllm.rendezvous import RendezvousPoster, _next_pause


class Metaserver:
    """A proxy's metaserver on loopback: records every body, answers 404 on /refuse, else 200."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.arrived = threading.Condition()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer.arrived:
                    outer.bodies.append(body)
                    outer.arrived.notify_all()
                self.send_response(404 if self.path == "/refuse" else 200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def url(self, path: str = "/rendezvous") -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}{path}"

    def wait_for(self, count: int, timeout: float) -> bool:
        with self.arrived:
            return self.arrived.wait_for(lambda: len(self.bodies) >= count, timeout)


class FakeTime:
    """A clock that only moves when the poster waits (or a test moves it)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.waits: list[float] = []

    def clock(self) -> float:
        return self.now

    def wait(self, seconds: float) -> bool:
        self.waits.append(seconds)
        self.now += seconds
        return False  # never woken by close


class Gate:
    """A post that records ext ids and holds the first one until released."""

    def __init__(self) -> None:
        self.posted: list[str] = []
        self.entered, self.release = threading.Event(), threading.Event()

    def __call__(self, url: str, body: Any) -> int:
        self.posted.append(body["ext_id"])
        self.entered.set()
        assert self.release.wait(30)
        return 200


def refuse_connection(url: str, body: Any) -> int:
    raise ConnectionError("refused")


@pytest.fixture
def metaserver(monkeypatch: pytest.MonkeyPatch) -> Iterator[Metaserver]:
    for var in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):  # loopback, never a proxy
        monkeypatch.delenv(var, raising=False)
    server = Metaserver()
    yield server
    server.server.shutdown()
    server.server.server_close()


@pytest.fixture
def black_hole() -> Iterator[socket.socket]:
    """A listening socket: connections complete in the kernel and are never answered."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=8)
    yield listener
    listener.close()


def hole_url(listener: socket.socket) -> str:
    return f"http://127.0.0.1:{listener.getsockname()[1]}/rendezvous"


def test_a_dead_url_does_not_delay_the_posts_to_another(metaserver: Metaserver, black_hole: socket.socket) -> None:
    poster = RendezvousPoster(timeout=30.0, backoff=60.0, deadline=300.0)
    poster.submit("dead", hole_url(black_hole), {"ext_id": "dead"})
    assert select.select([black_hole], [], [], 10)[0], "the dead URL's post never connected"
    held, _ = black_hole.accept()  # its post is in flight and stays there: nothing answers
    for i in range(3):
        poster.submit(f"ok{i}", metaserver.url(), {"ext_id": f"ok{i}"})
    assert metaserver.wait_for(3, timeout=10)  # one thread for every URL would wait out the 30 s
    assert [b["ext_id"] for b in metaserver.bodies] == ["ok0", "ok1", "ok2"]
    held.close()  # the dead post fails and pauses 60 s, which close must cut short
    assert poster.close()
    assert poster.stats["delivered"] == 3 and poster.stats["expired"] + poster.stats["failed"] == 0


def test_an_http_error_answer_is_heard_and_counted_as_refused(metaserver: Metaserver) -> None:
    with RendezvousPoster() as poster:
        poster.submit("a", metaserver.url("/refuse"), {"ext_id": "a"})
        poster.submit("b", metaserver.url(), {"ext_id": "b"})
        assert poster.flush(10)
    assert (poster.stats["refused"], poster.stats["delivered"], sorted(poster.recent)) == (1, 1, ["a", "b"])


def test_the_http_timeout_never_outlasts_the_deadline(black_hole: socket.socket) -> None:
    with RendezvousPoster(timeout=30.0, deadline=0.5) as poster:
        poster.submit("a", hole_url(black_hole), {"ext_id": "a"})
        assert poster.flush(15)  # a 30 s read would still be waiting
        assert poster.stats["expired"] == 1 and poster.stats["queued"] == 0


def test_no_pause_after_the_last_try() -> None:
    fake = FakeTime()
    tries: list[float] = []

    def post(url: str, body: Any) -> int:
        tries.append(fake.now)
        raise ConnectionError("refused")

    with RendezvousPoster(post=post, retries=2, backoff=1.0, clock=fake.clock, wait=fake.wait) as poster:
        poster.submit("a", "u", {"ext_id": "a"})
        assert poster.flush(10)
    assert tries == [0.0, 1.0, 3.0] and fake.waits == [1.0, 2.0]
    assert poster.stats["failed"] == 1 and poster.stats["expired"] == 0


def test_retries_end_at_the_deadline_without_waiting_for_it() -> None:
    fake = FakeTime()
    with RendezvousPoster(post=refuse_connection, retries=5, backoff=10.0, deadline=25.0, clock=fake.clock,
                          wait=fake.wait) as poster:
        poster.submit("a", "u", {"ext_id": "a"})
        assert poster.flush(10)
    assert fake.waits == [10.0]  # the next pause (20 s) would end past the deadline (15 s away)
    assert poster.stats["expired"] == 1 and poster.stats["failed"] == 0


def test_a_rendezvous_queued_past_its_deadline_is_dropped_unposted(caplog: pytest.LogCaptureFixture) -> None:
    fake, gate = FakeTime(), Gate()
    with RendezvousPoster(post=gate, deadline=30.0, clock=fake.clock, wait=fake.wait) as poster:
        poster.submit("a", "u", {"ext_id": "a"})
        assert gate.entered.wait(10)
        poster.submit("b", "u", {"ext_id": "b"})
        fake.now = 31.0  # b waited behind a for longer than its deadline
        gate.release.set()
        assert poster.flush(10)
    assert gate.posted == ["a"] and poster.stats["delivered"] == 1 and poster.stats["expired"] == 1
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR] == [
        "rendezvous of b to u dropped (expired after 0 tries): it waited in the queue"
    ]


def test_a_full_queue_drops_and_counts() -> None:
    gate = Gate()
    with RendezvousPoster(post=gate, max_queued=2) as poster:
        poster.submit("a", "u", {"ext_id": "a"})
        assert gate.entered.wait(10)  # a is taken off the queue: two more fit
        for ext_id in "bcd":
            poster.submit(ext_id, "u", {"ext_id": ext_id})
        gate.release.set()
        assert poster.flush(10)
    assert gate.posted == ["a", "b", "c"]
    assert poster.stats["dropped"] == 1 and poster.stats["delivered"] == 3


def test_urls_past_the_limit_are_refused_with_an_error(caplog: pytest.LogCaptureFixture) -> None:
    posted: list[str] = []
    with RendezvousPoster(post=lambda url, body: posted.append(url) or 200, max_urls=2) as poster:
        for url in ("u1", "u2", "u3", "u1"):
            poster.submit("a", url, {"ext_id": "a"})
        assert poster.flush(10)
    assert sorted(posted) == ["u1", "u1", "u2"] and poster.stats["dropped"] == 1
    assert "already posting to 2 URLs" in caplog.text


def test_cancel_drops_only_what_is_not_posted() -> None:
    gate = Gate()
    with RendezvousPoster(post=gate) as poster:
        for ext_id in "abc":
            poster.submit(ext_id, "u", {"ext_id": ext_id})
        assert gate.entered.wait(10)
        poster.cancel("a")  # already being posted: goes on
        poster.cancel("b")
        gate.release.set()
        assert poster.flush(10)
    assert gate.posted == ["a", "c"] and poster.stats["cancelled"] == 1 and poster.stats["delivered"] == 2


def test_close_wakes_a_thread_in_backoff_at_once() -> None:
    failed = threading.Event()

    def post(url: str, body: Any) -> int:
        failed.set()
        raise ConnectionError("refused")

    poster = RendezvousPoster(post=post, backoff=600.0, deadline=3600.0)
    poster.submit("a", "u", {"ext_id": "a"})
    poster.submit("b", "u", {"ext_id": "b"})
    assert failed.wait(10)
    assert poster.close(timeout=30.0)  # not joined in 30 s if the 600 s pause ran on
    assert poster.stats["queued"] == 0 and poster.stats["failed"] + poster.stats["expired"] == 0


def test_a_post_that_raises_otherwise_does_not_stop_its_url() -> None:
    def post(url: str, body: Any) -> int:
        if body["ext_id"] == "a":
            raise RuntimeError("a bug")
        return 200

    with RendezvousPoster(post=post) as poster:
        poster.submit("a", "u", {"ext_id": "a"})
        poster.submit("b", "u", {"ext_id": "b"})
        assert poster.flush(10)
    assert poster.stats["failed"] == 1 and list(poster.recent) == ["b"]


def test_memory_stays_bounded_however_many_are_delivered() -> None:
    with RendezvousPoster(post=lambda url, body: 200) as poster:
        for i in range(250):
            poster.submit(str(i), "u", {"ext_id": str(i)})
        assert poster.flush(10)
    assert poster.stats["delivered"] == 250 and list(poster.recent) == [str(i) for i in range(150, 250)]


@given(
    attempt=st.integers(0, 10), retries=st.integers(0, 10), backoff=st.floats(0, 100), left=st.floats(-10, 1000)
)
def test_a_pause_is_backoff_doubled_and_never_reaches_the_deadline(
    attempt: int, retries: int, backoff: float, left: float
) -> None:
    pause = _next_pause(attempt, retries, backoff, left)
    if attempt >= retries or backoff * 2**attempt >= left:
        assert pause is None
    else:
        assert pause == backoff * 2**attempt and pause < left
