"""rd2h's in-process ``memory`` channel: the shared channel suite, then what is its own."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any, TypeVar

import pytest

from rd2h import plugins
from rd2h.errors import ChannelError, FrameTooLargeError
from rd2h.memory_channel import MemoryChannel
from rd2h.testing.channel_suite import ChannelConformance

T = TypeVar("T")


def fresh_address() -> str:
    return f"memory://test-{uuid.uuid4().hex}"


class TestMemoryConformance(ChannelConformance):
    channel_name = "memory"

    def make_address(self) -> str:
        return fresh_address()


@pytest.fixture
def channel() -> MemoryChannel:
    loaded = plugins.load_channel("memory")
    assert isinstance(loaded, MemoryChannel)
    return loaded


def test_frames_sent_before_the_listener_binds_arrive_when_it_does(channel: MemoryChannel, closer: Any) -> None:
    address = fresh_address()
    dialer = closer(channel.dialer())
    dialer.send(address, b"early 1")
    dialer.send(address, b"early 2")
    listener = closer(channel.listen(address))
    first, second = listener.recv(0), listener.recv(0)
    assert first is not None and second is not None
    assert (first[1], second[1]) == (b"early 1", b"early 2") and first[0] == second[0]


def test_channels_of_one_process_share_the_registry(closer: Any) -> None:
    listener = closer(MemoryChannel().listen("memory://"))  # memory:// picks a fresh name
    assert listener.address.startswith("memory://") and len(listener.address) > len("memory://")
    dialer = closer(MemoryChannel().dialer())
    dialer.send(listener.address, b"hi")
    got = listener.recv(0)
    assert got is not None and got[1] == b"hi"
    with pytest.raises(ChannelError, match="in use"):
        MemoryChannel().listen(listener.address)


def test_frames_are_private_immutable_copies(channel: MemoryChannel, closer: Any) -> None:
    listener = closer(channel.listen(fresh_address()))
    dialer = closer(channel.dialer())
    buffer = bytearray(b"abc")
    dialer.send(listener.address, buffer)  # type: ignore[arg-type]
    buffer[:] = b"xyz"
    got = listener.recv(0)
    assert got is not None and got[1] == b"abc" and type(got[1]) is bytes


def test_a_blocked_recv_wakes_for_a_frame_and_for_wakeup(channel: MemoryChannel, closer: Any) -> None:
    listener = closer(channel.listen(fresh_address()))
    dialer = closer(channel.dialer())
    results: list[object] = []
    receiver = threading.Thread(target=lambda: results.append(dialer.recv(30)))
    start = time.monotonic()
    receiver.start()
    dialer.wakeup()  # before or during the recv: either way it returns None at once
    receiver.join(10)
    assert results == [None] and time.monotonic() - start < 10
    dialer.send(listener.address, b"ask")
    got = listener.recv(0)
    assert got is not None
    peer = got[0]
    receiver = threading.Thread(target=lambda: results.append(dialer.recv(30)))
    receiver.start()
    listener.send(peer, b"answer")
    receiver.join(10)
    assert results[1] == (listener.address, b"answer")


def test_disconnect_drops_replies_not_yet_received(channel: MemoryChannel, closer: Any) -> None:
    listener = closer(channel.listen(fresh_address()))
    dialer = closer(channel.dialer())
    dialer.send(listener.address, b"ask")
    got = listener.recv(0)
    assert got is not None
    listener.send(got[0], b"stale reply")
    dialer.disconnect(listener.address)
    assert dialer.recv(0) is None
    with pytest.raises(ChannelError, match="not connected"):
        listener.send(got[0], b"nobody hears this")


def test_an_oversized_frame_arriving_is_dropped_and_its_sender_cut_off(closer: Any) -> None:
    listener = closer(MemoryChannel(max_frame_bytes=8).listen(fresh_address()))
    dialer = closer(MemoryChannel().dialer())
    dialer.send(listener.address, b"small")
    got = listener.recv(0)
    assert got is not None
    dialer.send(listener.address, b"x" * 9)
    assert listener.recv(0) is None
    with pytest.raises(ChannelError, match="not connected"):
        listener.send(got[0], b"reply")
    with pytest.raises(FrameTooLargeError):
        listener.send(got[0], b"y" * 9)


def test_misuse_raises_channel_errors(channel: MemoryChannel) -> None:
    with pytest.raises(ChannelError, match="memory://name"):
        channel.listen("tcp://127.0.0.1:5600")
    dialer = channel.dialer()
    with pytest.raises(ChannelError, match="memory://name"):
        dialer.send("tcp://127.0.0.1:5600", b"x")
    address = fresh_address()
    for _ in range(1000):
        dialer.send(address, b"x")
    with pytest.raises(ChannelError, match="nobody listens"):
        dialer.send(address, b"one too many")
    dialer.close()
    with pytest.raises(ChannelError, match="closed"):
        dialer.send(address, b"x")
    with pytest.raises(ChannelError, match="closed"):
        dialer.recv(0)
    with channel.listen(address) as listener:
        assert listener.recv(0) is None  # the closed dialer's waiting frames went with it
