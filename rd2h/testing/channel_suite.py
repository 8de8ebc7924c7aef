"""Conformance tests every control channel must pass.

A channel backend subclasses ``ChannelConformance`` in its own tests and names itself::

    from rd2h.testing.channel_suite import ChannelConformance

    class TestMyChannel(ChannelConformance):
        channel_name = "mychannel"          # the entry-point name, loaded through rd2h.plugins
        channel_options = {"some": "option"}

and, where its addresses are not ``tcp://127.0.0.1:<port>``, overrides ``make_address``.
The tests use real listeners and dialers of the installed backend (no fakes) and close
everything they open. Timing bounds are generous; a pass means the contract holds, not
that the channel is fast (``bench/`` measures that).

A channel whose dialer never waits on a Decode and says what waits for it (``waiting``) also
subclasses ``StuckDecodeConformance`` and ``LostFramesConformance``
(``rd2h.testing.stuck_decode_suite``): a Decode that does not read delays nothing to another,
and only its own connection fails, reported once.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import pytest

from rd2h import plugins
from rd2h.errors import ChannelError, ConfigError, FrameTooLargeError, PortInUseError
from rd2h.interfaces import Availability, ControlChannel, Dialer, Listener

__all__ = ["ChannelConformance", "free_tcp_address", "wait_for"]

T = TypeVar("T")


def free_tcp_address(host: str = "127.0.0.1") -> str:
    """``tcp://host:port`` with a port the kernel just handed out (free unless raced)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return f"tcp://{host}:{probe.getsockname()[1]}"


def wait_for(poll: Callable[[], T | None], within: float, step: float = 0.05) -> T | None:
    """Call ``poll`` until it returns something other than None, or ``within`` seconds pass."""
    deadline = time.monotonic() + within
    while True:
        value = poll()
        if value is not None or time.monotonic() >= deadline:
            return value
        time.sleep(step)


def until(condition: Callable[[], bool], within: float = 30.0, step: float = 0.01) -> bool:
    """:func:`wait_for` for a condition another thread brings about (a counter, a count of
    fds): whether it held within ``within`` seconds."""
    return wait_for(lambda: True if condition() else None, within, step) is not None


class ChannelConformance:
    """The ControlChannel contract, as pytest tests (collected through a ``Test*`` subclass)."""

    pytestmark = [pytest.mark.rd2h_conformance]
    channel_name: ClassVar[str] = ""
    channel_options: ClassVar[dict[str, Any]] = {}
    #: the option that sets the frame size limit, or None if the channel has no limit
    frame_limit_option: ClassVar[str | None] = "max_frame_bytes"
    #: seconds a frame may take to arrive on a fresh connection
    arrival: ClassVar[float] = 5.0

    def make_address(self) -> str:
        """A fresh address a listener can bind."""
        return free_tcp_address()

    # -- fixtures ---------------------------------------------------------------------------

    @pytest.fixture
    def channel(self) -> ControlChannel:
        return self.make_channel()

    def make_channel(self, **overrides: Any) -> ControlChannel:
        if not self.channel_name:
            raise TypeError(f"{type(self).__name__} must set channel_name")
        return plugins.load_channel(self.channel_name, **{**self.channel_options, **overrides})

    def exchange(self, listener: Listener, dialer: Dialer, payload: bytes) -> bytes:
        """Send ``payload`` from dialer to listener; return the peer identity it arrived with."""
        dialer.send(listener.address, payload)
        got = listener.recv(self.arrival)
        assert got is not None, "the listener heard nothing"
        peer, received = got
        assert received == payload
        return peer

    # -- loading ----------------------------------------------------------------------------

    def test_loads_by_name(self, channel: ControlChannel) -> None:
        assert isinstance(channel, ControlChannel)
        assert type(channel).name == self.channel_name
        assert plugins.channel_class(self.channel_name) is type(channel)

    def test_availability_is_an_answer(self) -> None:
        result = plugins.channel_class(self.channel_name).availability()
        assert isinstance(result, Availability) and result.ok, result.reason

    def test_listed_as_available(self) -> None:
        rows = [b for b in plugins.list_backends() if b.kind == "channel" and b.name == self.channel_name]
        assert len(rows) == 1 and rows[0].available, rows

    def test_unknown_option_is_config_error(self) -> None:
        with pytest.raises(ConfigError):
            self.make_channel(no_such_option_for_rd2h=1)

    # -- round trips ------------------------------------------------------------------------

    def test_round_trip_both_ways(self, channel: ControlChannel, closer: Callable[[T], T]) -> None:
        listener = closer(channel.listen(self.make_address()))
        dialer = closer(channel.dialer())
        assert isinstance(listener.address, str) and listener.address
        peer = self.exchange(listener, dialer, b"ping")
        assert isinstance(peer, bytes)
        listener.send(peer, b"pong")
        assert dialer.recv(self.arrival) == (listener.address, b"pong")

    def test_payload_bytes_are_exact(self, channel: ControlChannel, closer: Callable[[T], T]) -> None:
        listener = closer(channel.listen(self.make_address()))
        dialer = closer(channel.dialer())
        blob = os.urandom(1 << 20) + b"\x00" * 7
        peer = self.exchange(listener, dialer, blob)
        listener.send(peer, blob[::-1])
        assert dialer.recv(self.arrival) == (listener.address, blob[::-1])

    def test_order_is_kept_per_connection(self, channel: ControlChannel, closer: Callable[[T], T]) -> None:
        listener = closer(channel.listen(self.make_address()))
        dialer = closer(channel.dialer())
        sent = [f"m{i}".encode() for i in range(200)]
        for payload in sent:
            dialer.send(listener.address, payload)
        got = [listener.recv(self.arrival) for _ in sent]
        assert [g[1] for g in got if g] == sent
        peer = got[0][0] if got[0] else b""
        for payload in sent:
            listener.send(peer, payload)
        assert [dialer.recv(self.arrival) for _ in sent] == [(listener.address, p) for p in sent]

    def test_many_dialers_one_listener(self, channel: ControlChannel, closer: Callable[[T], T]) -> None:
        listener = closer(channel.listen(self.make_address()))
        dialers = [closer(channel.dialer()) for _ in range(5)]
        for i, dialer in enumerate(dialers):
            dialer.send(listener.address, f"from {i}".encode())
        peers: dict[bytes, bytes] = {}
        for _ in dialers:
            got = listener.recv(self.arrival)
            assert got is not None
            peers[got[1]] = got[0]
        assert len(set(peers.values())) == len(dialers), "peers must have distinct identities"
        for i in range(len(dialers)):
            listener.send(peers[f"from {i}".encode()], f"to {i}".encode())
        for i, dialer in enumerate(dialers):
            assert dialer.recv(self.arrival) == (listener.address, f"to {i}".encode())
            assert dialer.recv(0.05) is None

    def test_one_dialer_many_listeners(self, channel: ControlChannel, closer: Callable[[T], T]) -> None:
        listeners = [closer(channel.listen(self.make_address())) for _ in range(3)]
        dialer = closer(channel.dialer())
        for listener in listeners:
            peer = self.exchange(listener, dialer, listener.address.encode())
            listener.send(peer, b"reply " + listener.address.encode())
        replies = {dialer.recv(self.arrival) for _ in listeners}
        assert replies == {(ls.address, b"reply " + ls.address.encode()) for ls in listeners}

    # -- time bounds ------------------------------------------------------------------------

    def test_recv_timeout_returns_none(self, channel: ControlChannel, closer: Callable[[T], T]) -> None:
        listener = closer(channel.listen(self.make_address()))
        dialer = closer(channel.dialer())
        for receive in (listener.recv, dialer.recv):
            start = time.monotonic()
            assert receive(0.2) is None
            assert 0.15 <= time.monotonic() - start < 2.0
            start = time.monotonic()
            assert receive(0) is None
            assert time.monotonic() - start < 0.5

    def test_send_to_nobody_does_not_hang(self, channel: ControlChannel, closer: Callable[[T], T]) -> None:
        dialer = closer(channel.dialer())
        address = self.make_address()
        start = time.monotonic()
        try:
            for _ in range(3):
                dialer.send(address, b"anyone?")
        except ChannelError:
            pass  # refusing is allowed; hanging is not
        assert dialer.recv(0.1) is None
        dialer.disconnect(address)
        assert time.monotonic() - start < 10.0

    # -- errors -----------------------------------------------------------------------------

    def test_port_in_use(self, channel: ControlChannel, closer: Callable[[T], T]) -> None:
        listener = closer(channel.listen(self.make_address()))
        start = time.monotonic()
        with pytest.raises(PortInUseError) as caught:
            closer(channel.listen(listener.address))
        assert time.monotonic() - start < 2.0
        assert listener.address in str(caught.value)

    def test_address_free_again_after_close(self, channel: ControlChannel) -> None:
        listener = channel.listen(self.make_address())
        address = listener.address
        listener.close()
        with channel.listen(address) as again:
            assert again.address == address

    def test_reply_to_unknown_peer_is_channel_error(
        self, channel: ControlChannel, closer: Callable[[T], T]
    ) -> None:
        listener = closer(channel.listen(self.make_address()))
        with pytest.raises(ChannelError):
            listener.send(b"no-such-peer", b"hello")

    def test_frame_too_large_on_send(self, closer: Callable[[T], T]) -> None:
        if self.frame_limit_option is None:
            pytest.skip("this channel has no frame size limit")
        channel = self.make_channel(**{self.frame_limit_option: 1024})
        listener = closer(channel.listen(self.make_address()))
        dialer = closer(channel.dialer())
        with pytest.raises(FrameTooLargeError):
            dialer.send(listener.address, b"x" * 1025)
        peer = self.exchange(listener, dialer, b"x" * 1024)  # the limit itself is allowed
        with pytest.raises(FrameTooLargeError):
            listener.send(peer, b"y" * 1025)
        listener.send(peer, b"y" * 1024)
        assert dialer.recv(self.arrival) == (listener.address, b"y" * 1024)

    # -- lifecycle --------------------------------------------------------------------------

    def test_disconnect_then_send_again(self, channel: ControlChannel, closer: Callable[[T], T]) -> None:
        listener = closer(channel.listen(self.make_address()))
        dialer = closer(channel.dialer())
        self.exchange(listener, dialer, b"first")
        dialer.disconnect(listener.address)
        dialer.disconnect(listener.address)  # twice is fine
        dialer.disconnect(self.make_address())  # never connected: fine
        peer = self.exchange(listener, dialer, b"second")
        listener.send(peer, b"answer")
        assert dialer.recv(self.arrival) == (listener.address, b"answer")

    def test_listener_restart_is_reached_again(self, channel: ControlChannel, closer: Callable[[T], T]) -> None:
        listener = channel.listen(self.make_address())
        address = listener.address
        dialer = closer(channel.dialer())
        self.exchange(listener, dialer, b"before")
        listener.close()
        restarted = closer(channel.listen(address))

        def resend() -> tuple[bytes, bytes] | None:
            dialer.send(address, b"after")
            return restarted.recv(0.2)

        got = wait_for(resend, self.arrival)
        assert got is not None and got[1] == b"after"

    def test_close_is_idempotent(self, channel: ControlChannel) -> None:
        listener = channel.listen(self.make_address())
        dialer = channel.dialer()
        dialer.send(listener.address, b"x")
        dialer.close()
        dialer.close()
        listener.close()
        listener.close()
        with channel.listen(self.make_address()) as listener2, channel.dialer() as dialer2:
            self.exchange(listener2, dialer2, b"context managers work")

    # -- threads ----------------------------------------------------------------------------

    def test_wakeup_ends_a_blocked_recv(self, channel: ControlChannel, closer: Callable[[T], T]) -> None:
        dialer = closer(channel.dialer())
        results: list[object] = []
        waiting = threading.Event()

        def receive() -> None:
            waiting.set()
            results.append(dialer.recv(60.0))

        thread = threading.Thread(target=receive, daemon=True)
        thread.start()
        assert waiting.wait(10.0)
        dialer.wakeup()
        thread.join(10.0)
        assert not thread.is_alive(), "wakeup() did not end a recv blocked in another thread"
        assert results == [None]

    def test_concurrent_send_while_another_thread_receives(
        self, channel: ControlChannel, closer: Callable[[T], T]
    ) -> None:
        """A dialer that declares ``concurrent_send``: one thread sends (and so connects) while
        another blocks in ``recv``; every reply reaches the receiving thread, in order, and no
        ``recv`` waits out its timeout with a reply waiting."""
        dialer = closer(channel.dialer())
        if not dialer.concurrent_send:
            pytest.skip(f"{self.channel_name} dialers do not declare concurrent_send")
        listener = closer(channel.listen(self.make_address()))
        count = 300
        replies: list[tuple[str, bytes] | None] = []

        def receive() -> None:
            while len(replies) < count:
                got = dialer.recv(self.arrival)
                replies.append(got)
                if got is None:
                    return

        thread = threading.Thread(target=receive, daemon=True)
        thread.start()
        for i in range(count):
            peer = self.exchange(listener, dialer, b"ask %d" % i)
            listener.send(peer, b"answer %d" % i)
        # the listener's owner keeps calling recv, as Decode's loop does: a channel without I/O
        # threads may write the replies its socket had no room for from there
        deadline = time.monotonic() + self.arrival * 2
        while thread.is_alive() and time.monotonic() < deadline:
            listener.recv(0.05)
        assert not thread.is_alive(), f"{len(replies)} of {count} replies received"
        assert None not in replies, f"recv timed out after {replies.index(None)} replies with one waiting"
        assert replies == [(listener.address, b"answer %d" % i) for i in range(count)]
