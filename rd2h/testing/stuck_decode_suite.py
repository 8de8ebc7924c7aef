"""Conformance tests for a dialer that never waits on a Decode (the ``Dialer`` contract in
``rd2h.interfaces``): what a socket has no room for waits, in order, behind its connection
alone; a writer thread writes it as the socket drains; only the connection whose frame waited
``send_timeout`` fails, and it is reported once (by ``take_failures`` or by the next send there).

A channel whose dialer also says what waits for an address (``waiting(address) -> int``)
subclasses ``StuckDecodeConformance`` (the channel alone) and ``LostFramesConformance`` (a real
Prefill ``Source`` over it) in its own tests, and says how to make a Decode that does not read::

    from rd2h.testing.stuck_decode_suite import LostFramesConformance, StuckDecodeConformance

    class TestMyStuckDecode(StuckDecodeConformance, LostFramesConformance):
        channel_name = "mychannel"
        stuck_options = {"queue_frames": 5}   # options that make a connection back up soon
        big_frame_bytes = 1 << 20             # what a Decode that does not read is filled with
        backed_up_at = 24 << 20               # dialer.waiting() once more waits than any buffer takes
        failure_match = "took no bytes"       # in the error of a connection failed past send_timeout

        def assert_connected_again(self, conn, payload): ...  # the raw socket got a new connection

A Decode that does not read is a listener whose loop never runs, or a plain socket that accepts
and never reads (nor answers a handshake). The tests synchronise on events and on what the
dialer says waits, never on sleeps.
"""

from __future__ import annotations

import os
import re
import select
import socket
import threading
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import numpy as np
import pytest

from rd2h import plugins
from rd2h.errors import ChannelError
from rd2h.interfaces import ControlChannel, Dialer, Listener
from rd2h.outcome import TerminalState
from rd2h.prefill.source import Source
from rd2h.tensors import LayerTensors, layer_layout
from rd2h.testing.channel_suite import free_tcp_address
from rd2h.wire import protocol
from rd2h.wire.endpoint import DecodeEndpoint

__all__ = ["LostFramesConformance", "StuckDecodeConformance", "StuckDecodeKit", "ThenLock", "hung_up"]

T = TypeVar("T")
PATIENT = 60.0  # a send_timeout no test waits out: were a send to wait for a Decode, it would
SEND_TIMEOUT = 2.0  # the failure comes about this long after the frame began to wait
REPLY_TIMEOUT = 120.0  # what a request to a Decode that stopped reading waited for, without take_failures
WITHIN = 40.0  # a bound for a Prefill's outcome: far above SEND_TIMEOUT, far below REPLY_TIMEOUT
MOST_FRAMES = 500  # a fill that sends more without backing up finds a Decode that reads after all


def hung_up(sock: socket.socket, within: float) -> bool:
    """Whether the other end closed or reset ``sock`` (what waits unread is not looked at)."""
    poller = select.poll()
    poller.register(sock, select.POLLRDHUP)
    return bool(poller.poll(within * 1000))


class ThenLock:
    """A stand-in for a dialer's table lock that runs ``then`` once, the first time the thread
    named ``thread`` releases it: it puts another thread's work right where a lock hold ends
    (no sleeps, no timing)."""

    def __init__(self, thread: str, then: Callable[[], object]) -> None:
        self._lock, self._thread, self._then = threading.Lock(), thread, then
        self.ran = threading.Event()

    def __enter__(self) -> None:
        self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()
        if not self.ran.is_set() and threading.current_thread().name == self._thread:
            self.ran.set()
            self._then()


class StuckDecodeKit:
    """What a channel says about a Decode that does not read; the hooks both suites use."""

    pytestmark = [pytest.mark.rd2h_conformance]
    channel_name: ClassVar[str] = ""
    channel_options: ClassVar[dict[str, Any]] = {}
    #: options that make a connection back up soon (a small queue), on top of channel_options
    stuck_options: ClassVar[dict[str, Any]] = {}
    #: bytes of each frame a Decode that does not read is filled with
    big_frame_bytes: ClassVar[int] = 1 << 20
    #: what ``dialer.waiting(address)`` says once more waits than every buffer on the way takes
    backed_up_at: ClassVar[int] = 1
    #: a pattern in the ChannelError of a connection failed because its frame waited send_timeout
    failure_match: ClassVar[str] = ""
    #: seconds what is sent to a Decode that reads may take to arrive
    arrival: ClassVar[float] = 10.0

    def make_address(self) -> str:
        """A fresh address a listener can bind."""
        return free_tcp_address()

    def make_channel(self, send_timeout: float, **overrides: Any) -> ControlChannel:
        if not self.channel_name or not self.failure_match:
            raise TypeError(f"{type(self).__name__} must set channel_name and failure_match")
        options = {**self.channel_options, **self.stuck_options, "send_timeout": send_timeout, **overrides}
        return plugins.load_channel(self.channel_name, **options)

    def stuck_server(self, closer: Callable[[T], T]) -> tuple[socket.socket, str]:
        """A Decode that does not read: a socket the kernel accepts on and nobody reads (nor
        answers a handshake), with a small receive buffer (it fills sooner); and its address."""
        server = closer(socket.socket())
        server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(self.arrival)
        return server, f"tcp://127.0.0.1:{server.getsockname()[1]}"

    def fill(
        self, dialer: Dialer, address: str, frame: Callable[[int], bytes] | None = None, until: int | None = None
    ) -> list[bytes]:
        """Send ``frame(i)`` (``big_frame_bytes`` by default) to ``address``, which reads nothing,
        until ``dialer.waiting(address)`` reaches ``until`` (``backed_up_at`` by default); the
        frames sent."""
        frame = frame or (lambda _: b"f" * self.big_frame_bytes)
        until = self.backed_up_at if until is None else until
        sent: list[bytes] = []
        while dialer.waiting(address) < until:  # type: ignore[attr-defined]
            assert len(sent) < MOST_FRAMES, f"{address} took {MOST_FRAMES} frames unread"
            sent.append(frame(len(sent)))
            dialer.send(address, sent[-1])
        return sent

    def assert_connected_again(self, conn: socket.socket, payload: bytes) -> None:
        """What the dialer sent on ``conn``, a new connection from it to a stuck_server, shows
        ``payload`` (or the start of its handshake) arrived."""
        raise NotImplementedError(f"{type(self).__name__} must say how a new connection starts")


class StuckDecodeConformance(StuckDecodeKit):
    """A Decode that does not read delays nothing to another, and fails only its own connection."""

    def test_a_decode_that_does_not_read_delays_no_frame_to_another(self, closer: Callable[[T], T]) -> None:
        channel = self.make_channel(send_timeout=PATIENT)
        stuck = closer(channel.listen(self.make_address()))  # its loop never runs: it reads nothing
        live = closer(channel.listen(self.make_address()))
        dialer = closer(channel.dialer())
        filled = threading.Event()
        # on its own thread: a dialer with one lock blocked here, holding it, for send_timeout
        threading.Thread(target=lambda: (self.fill(dialer, stuck.address), filled.set()), daemon=True).start()
        assert filled.wait(self.arrival), "a send to a Decode that does not read waited for it"
        for i in range(200):  # (how much waits for the stuck one meanwhile depends on buffers draining: not asserted)
            dialer.send(live.address, b"layer %d" % i)
        got = [live.recv(self.arrival) for _ in range(200)]
        assert [item and item[1] for item in got] == [b"layer %d" % i for i in range(200)]
        peer = got[0][0] if got[0] else b""
        live.send(peer, b"reply")
        assert dialer.recv(self.arrival) == (live.address, b"reply")  # replies are read meanwhile too
        dialer.disconnect(live.address)  # and another connection is closed without waiting

    def test_frames_queued_for_a_decode_that_is_behind_keep_their_order(self, closer: Callable[[T], T]) -> None:
        channel = self.make_channel(send_timeout=PATIENT)
        listener = closer(channel.listen(self.make_address()))
        dialer = closer(channel.dialer())
        sent = self.fill(  # big, small, big, ...: then small ones queued behind them
            dialer, listener.address, lambda i: b"%06d|" % i + os.urandom(64 if i % 2 else self.big_frame_bytes)
        )
        sent += [b"%06d|after" % i for i in range(len(sent), len(sent) + 5)]
        for frame in sent[-5:]:
            dialer.send(listener.address, frame)
        got = [listener.recv(self.arrival) for _ in sent]  # the listener reads now: the outbox drains
        assert [item and item[1] for item in got] == sent
        assert dialer.waiting(listener.address) == 0

    def test_only_the_decode_that_does_not_read_fails_after_send_timeout(self, closer: Callable[[T], T]) -> None:
        server, stuck = self.stuck_server(closer)
        channel = self.make_channel(send_timeout=SEND_TIMEOUT)
        live = closer(channel.listen(self.make_address()))
        dialer = closer(channel.dialer())
        dialer.send(live.address, b"before")
        first = live.recv(self.arrival)
        assert first is not None
        self.fill(dialer, stuck)
        conn = closer(server.accept()[0])
        assert hung_up(conn, 30.0), "the connection to a Decode that does not read was never failed"
        with pytest.raises(ChannelError, match=self.failure_match):
            dialer.send(stuck, b"after")  # the failure, reported once, to this endpoint's send
        dialer.send(live.address, b"after")  # the other endpoint: same connection, no error
        assert live.recv(self.arrival) == (first[0], b"after")
        dialer.send(stuck, b"again")  # the one after connects again
        again = closer(server.accept()[0])
        again.settimeout(self.arrival)
        self.assert_connected_again(again, b"again")


def _endpoint(address: str) -> DecodeEndpoint:
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    return DecodeEndpoint(host, int(port), 1)


def _layers() -> dict[str, LayerTensors]:
    rng = np.random.default_rng(0)
    return {
        f"l{i}": LayerTensors(main=[rng.integers(1, 255, (4, 64), dtype=np.uint8)], indexer=None) for i in range(2)
    }


def _answer(listener: Listener, stop: threading.Event) -> None:
    """A Decode that reads: it acknowledges mf_meta and answers every readiness ReadDone."""
    while not stop.is_set():
        item = listener.recv(0.1)
        if item is None:
            continue
        message = protocol.decode_request(item[1])
        if isinstance(message, protocol.ReadReadyBatch):
            listener.send(item[0], protocol.encode(protocol.ReadDone(message.layer_idx)))
        elif isinstance(message, protocol.MfMeta):
            listener.send(item[0], protocol.ACK_FRAME)


def _source(dialer: Dialer) -> Source:
    return Source(
        rank=0, tp_size=1, engine=plugins.load_engine("local", "prefill"), dialer=dialer, block_size=16,
        layers={name: layer_layout(t) for name, t in _layers().items()}, reply_timeout=REPLY_TIMEOUT,
    ).start()


class LostFramesConformance(StuckDecodeKit):
    """A Prefill Source over the channel, and a Decode that stops reading with the last layer's
    frame waiting for it: Prefill sends nothing more there, yet that Decode's request fails about
    ``send_timeout`` after (the writer fails the connection and wakes the Prefill, which asks the
    dialer's ``take_failures``), not at ``reply_timeout``; another Decode's request in the same
    step completes. The local engine and the real codec; TCP addresses (a Decode endpoint's)."""

    def test_a_decode_that_stops_reading_with_the_last_layer_queued_fails_its_request_at_send_timeout(
        self, closer: Callable[[T], T]
    ) -> None:
        _, stuck = self.stuck_server(closer)
        channel = self.make_channel(send_timeout=SEND_TIMEOUT)
        live = closer(channel.listen(free_tcp_address()))
        stop = threading.Event()
        answering = threading.Thread(target=_answer, args=(live, stop), daemon=True)
        answering.start()
        dialer = channel.dialer()
        try:
            with _source(dialer) as source:
                source.add_request("stuck", _endpoint(stuck), main_block_ids=[1], num_tokens=16)
                source.add_request("live", _endpoint(live.address), main_block_ids=[2], num_tokens=16)
                source.schedule({"stuck": 16, "live": 16})
                source.wait_for_layer_send("l0")
                source.layer_ready("l0")  # on this thread: both connections are made
                self.fill(dialer, stuck)  # what follows to the stuck Decode waits in its outbox
                source.wait_for_layer_send("l1")
                source.layer_ready("l1")  # the last layer: its frame waits; nothing more goes there
                outcomes = source.wait_finished(["stuck", "live"], WITHIN)  # WaitTimeout without take_failures
                assert outcomes["live"].state is TerminalState.DONE
                assert outcomes["stuck"].state is TerminalState.FAILED
                assert isinstance(outcomes["stuck"].error, ChannelError)
                assert re.search(self.failure_match, str(outcomes["stuck"].error))
                assert dialer.take_failures() == {}  # reported once: consumed by the Prefill
        finally:
            stop.set()
            answering.join(10)
