"""rd2h-zmq on real loopback sockets: the shared channel suite, then what is zmq's own."""

from __future__ import annotations

import errno
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import zmq
import zmq.auth
from rd2h_zmq import ZmqChannel

from rd2h.errors import ChannelError, ConfigError, FrameTooLargeError, PortInUseError
from rd2h.testing.channel_suite import ChannelConformance, free_tcp_address

T = TypeVar("T")
ARRIVAL = 5.0


class TestZmqConformance(ChannelConformance):
    channel_name = "zmq"


@pytest.fixture
def raw_context() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def raw_dealer(context: zmq.Context[zmq.Socket[bytes]], address: str, **curve: bytes) -> zmq.Socket[bytes]:
    """A reference-style Prefill peer: a bare DEALER that sends one frame per message."""
    sock = context.socket(zmq.DEALER)
    sock.linger = 0
    for option, value in curve.items():
        setattr(sock, option, value)
    sock.connect(address)
    return sock


# -- framing -------------------------------------------------------------------------------


def test_reply_framing_seen_by_a_reference_peer(closer: Callable[[T], T], raw_context: Any) -> None:
    listener = closer(ZmqChannel().listen("tcp://127.0.0.1:0"))
    dealer = raw_dealer(raw_context, listener.address)
    dealer.send(b"read_ready")
    peer, payload = listener.recv(ARRIVAL)
    assert payload == b"read_ready"
    listener.send(peer, b"ACK")
    assert dealer.poll(int(ARRIVAL * 1000))
    assert dealer.recv_multipart() == [b"", b"ACK"]


def test_empty_delimiter_frames_are_skipped(closer: Callable[[T], T], raw_context: Any) -> None:
    channel = ZmqChannel()
    listener = closer(channel.listen("tcp://127.0.0.1:0"))
    dealer = raw_dealer(raw_context, listener.address)
    dealer.send_multipart([b"", b"req-style"])  # what a REQ socket puts on the wire
    dealer.send(b"")  # a lone delimiter is no message at all
    dealer.send(b"plain")
    assert listener.recv(ARRIVAL)[1] == b"req-style"
    peer, payload = listener.recv(ARRIVAL)
    assert payload == b"plain"
    # and the dialer skips the delimiter of a reply, as from a reference Decode
    router = raw_context.socket(zmq.ROUTER)
    router.linger = 0
    port = router.bind_to_random_port("tcp://127.0.0.1")
    address = f"tcp://127.0.0.1:{port}"
    dialer = closer(channel.dialer())
    dialer.send(address, b"hello")
    assert router.poll(int(ARRIVAL * 1000))
    identity, hello = router.recv_multipart()
    assert hello == b"hello" and identity == dialer.routing_id
    router.send_multipart([identity, b"", b"ACK"])
    router.send_multipart([identity, b""])
    router.send_multipart([identity, b"", b"second"])
    assert dialer.recv(ARRIVAL) == (address, b"ACK")
    assert dialer.recv(ARRIVAL) == (address, b"second")


def test_multi_part_messages_are_dropped(closer: Callable[[T], T], raw_context: Any) -> None:
    listener = closer(ZmqChannel().listen("tcp://127.0.0.1:0"))
    dealer = raw_dealer(raw_context, listener.address)
    dealer.send_multipart([b"two", b"parts"])
    dealer.send(b"after")
    assert listener.recv(ARRIVAL)[1] == b"after"


def test_routing_id_is_stable_across_reconnect(closer: Callable[[T], T]) -> None:
    channel = ZmqChannel()
    listener = closer(channel.listen("tcp://127.0.0.1:0"))
    dialer = closer(channel.dialer())
    dialer.send(listener.address, b"one")
    first, _ = listener.recv(ARRIVAL)
    dialer.disconnect(listener.address)
    dialer.send(listener.address, b"two")
    second, _ = listener.recv(ARRIVAL)
    assert first == second == dialer.routing_id
    listener.send(second, b"still reachable")
    assert dialer.recv(ARRIVAL) == (listener.address, b"still reachable")


# -- errors and bounds -----------------------------------------------------------------------


def test_port_in_use_names_the_address_and_is_quick() -> None:
    channel = ZmqChannel()
    with channel.listen("tcp://127.0.0.1:0") as listener:
        start = time.monotonic()
        with pytest.raises(PortInUseError, match=listener.address.replace(".", r"\.")) as caught:
            channel.listen(listener.address)
        assert time.monotonic() - start < 1.0
        assert caught.value.errno == errno.EADDRINUSE
        assert isinstance(caught.value, OSError)


def test_other_bind_errors_are_channel_errors() -> None:
    channel = ZmqChannel(allow_insecure=True)  # past the loopback check, to libzmq's own
    for address in ("bogus://nowhere", "tcp://999.1.1.1:5600"):
        with pytest.raises(ChannelError) as caught:
            channel.listen(address)
        assert not isinstance(caught.value, PortInUseError)
        assert address in str(caught.value)
    with channel.listen("tcp://127.0.0.1:0"):  # the failures left the context usable
        pass


@pytest.mark.skipif(not socket.has_ipv6, reason="no IPv6 in this Python")
def test_ipv6_literal_addresses(closer: Callable[[T], T]) -> None:
    channel = ZmqChannel()
    try:
        listener = closer(channel.listen("tcp://[::1]:0"))
    except ChannelError as exc:
        pytest.skip(f"no IPv6 loopback here: {exc}")
    assert listener.address.startswith("tcp://[::1]:")
    dialer = closer(channel.dialer())
    dialer.send(listener.address, b"six")
    peer, payload = listener.recv(ARRIVAL)
    listener.send(peer, b"back")
    assert payload == b"six" and dialer.recv(ARRIVAL) == (listener.address, b"back")


def test_bad_dial_address_is_channel_error(closer: Callable[[T], T]) -> None:
    dialer = closer(ZmqChannel().dialer())
    with pytest.raises(ChannelError, match="bogus"):
        dialer.send("bogus://x", b"hi")


def test_oversized_inbound_frame_is_never_delivered(closer: Callable[[T], T]) -> None:
    small = ZmqChannel(max_frame_bytes=4096)
    listener = closer(small.listen("tcp://127.0.0.1:0"))
    big_sender = closer(ZmqChannel(max_frame_bytes=1 << 20).dialer())  # its own limit is larger
    honest = closer(small.dialer())
    big_sender.send(listener.address, b"z" * 100_000)
    honest.send(listener.address, b"fine")
    assert listener.recv(ARRIVAL)[1] == b"fine"
    assert listener.recv(0.5) is None
    # the listener keeps serving, and the disconnected sender comes back for small frames
    honest.send(listener.address, b"still fine")
    assert listener.recv(ARRIVAL)[1] == b"still fine"
    deadline = time.monotonic() + ARRIVAL
    got = None
    while got is None and time.monotonic() < deadline:
        big_sender.send(listener.address, b"small now")
        got = listener.recv(0.2)
    assert got is not None and got[1] == b"small now"


def test_send_checks_size_and_emptiness(closer: Callable[[T], T]) -> None:
    channel = ZmqChannel(max_frame_bytes=10)
    dialer = closer(channel.dialer())
    with pytest.raises(FrameTooLargeError, match="11 bytes"):
        dialer.send("tcp://127.0.0.1:1", b"x" * 11)
    with pytest.raises(FrameTooLargeError):
        dialer.send("tcp://127.0.0.1:1", memoryview(bytearray(11)))
    with pytest.raises(ValueError):
        dialer.send("tcp://127.0.0.1:1", b"")


def test_full_queue_to_a_dead_peer_raises_in_bounded_time(closer: Callable[[T], T]) -> None:
    dialer = closer(ZmqChannel(high_water_mark=5, send_timeout=0.2).dialer())
    address = free_tcp_address()  # nothing listens here
    start = time.monotonic()
    with pytest.raises(ChannelError, match="within send_timeout"):
        while time.monotonic() - start < 3.0:  # a send never waits; one after send_timeout raises
            dialer.send(address, b"x")
    assert time.monotonic() - start < 3.0


def test_reply_to_a_vanished_peer_is_channel_error(closer: Callable[[T], T]) -> None:
    channel = ZmqChannel()
    listener = closer(channel.listen("tcp://127.0.0.1:0"))
    dialer = channel.dialer()
    dialer.send(listener.address, b"hi")
    peer, _ = listener.recv(ARRIVAL)
    dialer.close()
    deadline = time.monotonic() + ARRIVAL
    with pytest.raises(ChannelError, match="not connected"):
        while time.monotonic() < deadline:
            listener.send(peer, b"are you there")
            time.sleep(0.05)


def test_use_after_close_is_channel_error() -> None:
    channel = ZmqChannel()
    listener = channel.listen("tcp://127.0.0.1:0")
    dialer = channel.dialer()
    listener.close()
    dialer.close()
    with pytest.raises(ChannelError):
        listener.recv(0)
    with pytest.raises(ChannelError):
        dialer.send(listener.address, b"x")


def test_context_lives_exactly_as_long_as_its_sockets() -> None:
    channel = ZmqChannel()
    shared = channel._context
    assert not shared.active
    listener = channel.listen("tcp://127.0.0.1:0")
    dialer = channel.dialer()
    listener.close()
    assert shared.active
    dialer.close()
    assert not shared.active
    with channel.listen("tcp://127.0.0.1:0"):  # made again on demand
        assert shared.active


def test_inproc_works_within_one_channel(closer: Callable[[T], T]) -> None:
    channel = ZmqChannel()
    listener = closer(channel.listen("inproc://rd2h-test"))
    dialer = closer(channel.dialer())
    dialer.send("inproc://rd2h-test", b"in process")
    peer, payload = listener.recv(ARRIVAL)
    listener.send(peer, b"back")
    assert payload == b"in process" and dialer.recv(ARRIVAL) == ("inproc://rd2h-test", b"back")


@pytest.mark.parametrize(
    "options",
    [
        {"bogus": 1},
        {"max_frame_bytes": 0},
        {"max_frame_bytes": 1.5},
        {"send_timeout": 0},
        {"high_water_mark": 0},
        {"curve_server_key": "x.key"},
        {"curve_secret_key": "/nonexistent/rd2h.key_secret"},
    ],
)
def test_bad_options_are_config_errors(options: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        ZmqChannel(**options)


# -- CURVE ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("curve")
    made: dict[str, Path] = {}
    for name in ("server", "client", "intruder"):
        public, secret = zmq.auth.create_certificates(root, name)
        made[name], made[name + "_secret"] = Path(public), Path(secret)
    authorized = root / "authorized"
    authorized.mkdir()
    (authorized / "client.key").write_bytes(made["client"].read_bytes())
    made["authorized"] = authorized
    return made


def curve_server(keys: dict[str, Path], **extra: Any) -> ZmqChannel:
    return ZmqChannel(curve_secret_key=keys["server_secret"], curve_authorized_keys=keys["authorized"], **extra)


def curve_client(keys: dict[str, Path], who: str, **extra: Any) -> ZmqChannel:
    return ZmqChannel(curve_secret_key=keys[who + "_secret"], curve_server_key=keys["server"], **extra)


def client_key(keys: dict[str, Path], who: str) -> bytes:
    return zmq.auth.load_certificate(keys[who])[0]


def test_curve_authorized_client_is_heard_and_answered(keys: dict[str, Path], closer: Callable[[T], T]) -> None:
    listener = closer(curve_server(keys).listen("tcp://127.0.0.1:0"))
    dialer = closer(curve_client(keys, "client").dialer())
    dialer.send(listener.address, b"announce")
    peer, payload = listener.recv(ARRIVAL)
    assert payload == b"announce"
    listener.send(peer, b"ACK")
    assert dialer.recv(ARRIVAL) == (listener.address, b"ACK")


def test_curve_frame_of_exactly_the_limit_passes(keys: dict[str, Path], closer: Callable[[T], T]) -> None:
    listener = closer(curve_server(keys, max_frame_bytes=1000).listen("tcp://127.0.0.1:0"))
    dialer = closer(curve_client(keys, "client", max_frame_bytes=1000).dialer())
    dialer.send(listener.address, b"q" * 1000)
    assert listener.recv(ARRIVAL) == (client_key(keys, "client") + dialer.routing_id, b"q" * 1000)


def test_curve_refuses_strangers_and_keeps_serving(
    keys: dict[str, Path], closer: Callable[[T], T], raw_context: Any
) -> None:
    listener = closer(curve_server(keys).listen("tcp://127.0.0.1:0"))
    intruder = closer(curve_client(keys, "intruder").dialer())  # valid keys, not authorized
    plain = closer(ZmqChannel().dialer())  # no CURVE at all
    public, secret = zmq.auth.load_certificate(keys["intruder_secret"])
    forged = raw_dealer(  # claims the authorized client's public key without its secret
        raw_context,
        listener.address,
        curve_publickey=zmq.auth.load_certificate(keys["client"])[0],
        curve_secretkey=secret,
        curve_serverkey=zmq.auth.load_certificate(keys["server"])[0],
    )
    intruder.send(listener.address, b"let me in")
    plain.send(listener.address, b"let me in too")
    forged.send(b"and me")
    assert public != zmq.auth.load_certificate(keys["client"])[0]
    assert listener.recv(1.0) is None
    friend = closer(curve_client(keys, "client").dialer())
    friend.send(listener.address, b"friend")
    assert listener.recv(ARRIVAL) == (client_key(keys, "client") + friend.routing_id, b"friend")
    assert listener.recv(0.5) is None


def test_curve_needs_its_pieces(keys: dict[str, Path]) -> None:
    with pytest.raises(ConfigError, match="authorized"):
        curve_client(keys, "client").listen("tcp://127.0.0.1:0")
    with pytest.raises(ConfigError, match="server_key"):
        curve_server(keys).dialer()
    with pytest.raises(ConfigError, match="no secret"):
        ZmqChannel(curve_secret_key=keys["client"], curve_server_key=keys["server"])
    with pytest.raises(ConfigError, match="not a directory"):
        ZmqChannel(curve_secret_key=keys["server_secret"], curve_authorized_keys=keys["server"])
    empty = keys["authorized"].parent / "empty"
    empty.mkdir(exist_ok=True)
    with pytest.raises(ConfigError, match="no \\*.key"):
        ZmqChannel(curve_secret_key=keys["server_secret"], curve_authorized_keys=empty)


def test_wakeup_returns_a_blocked_recv_at_once(closer: Callable[[T], T]) -> None:
    import threading

    dialer = closer(ZmqChannel().dialer())
    returned: list[float] = []

    def blocked() -> None:
        started = time.monotonic()
        assert dialer.recv(10.0) is None
        returned.append(time.monotonic() - started)

    thread = threading.Thread(target=blocked)
    thread.start()
    time.sleep(0.2)
    dialer.wakeup()
    thread.join(5.0)
    assert returned and returned[0] < 2.0  # without wakeup it would block for 10 s
    dialer.wakeup()  # a pending wakeup makes the next recv return at once too
    started = time.monotonic()
    assert dialer.recv(10.0) is None
    assert time.monotonic() - started < 2.0
