"""What the tcp channel itself promises, on real sockets: peers that misbehave cost Decode's loop
nothing it does not bound, and rd2h runs over it end to end."""

from __future__ import annotations

import logging
import os
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import pytest
import zmq
from rd2h_tcp import TcpChannel, TcpListener
from rd2h_tcp.framing import IDENTITY_BYTES, MAGIC, encode

from rd2h import plugins
from rd2h.errors import ChannelError, ConfigError
from rd2h.testing.channel_suite import free_tcp_address, wait_for

T = TypeVar("T")
ARRIVAL = 5.0


def raw_peer(listener: TcpListener, identity: bytes = b"r" * IDENTITY_BYTES) -> socket.socket:
    """A hand-made rd2h tcp peer: connected and greeted, nothing sent yet."""
    host, port = listener.address.removeprefix("tcp://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=ARRIVAL)
    sock.sendall(MAGIC + identity)
    return sock


def hears(listener: TcpListener, within: float = ARRIVAL) -> tuple[bytes, bytes] | None:
    return listener.recv(within)


def closed_by_peer(sock: socket.socket, within: float = ARRIVAL) -> bool:
    """Whether the other end closes ``sock`` within ``within`` seconds (what it sent is skipped)."""
    sock.settimeout(within)
    while True:
        try:
            if not sock.recv(65536):
                return True
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False


def test_a_listener_off_loopback_needs_allow_insecure(closer: Callable[[T], T]) -> None:
    with pytest.raises(ConfigError, match="allow_insecure"):
        TcpChannel().listen("tcp://0.0.0.0:0")
    listener = closer(TcpChannel(allow_insecure=True).listen("tcp://0.0.0.0:0"))
    assert listener.address.startswith("tcp://0.0.0.0:")
    closer(TcpChannel().listen("tcp://localhost:0"))  # loopback by name
    closer(TcpChannel().listen(f"ipc://{tempfile.gettempdir()}/rd2h-tcp-insecure-{os.getpid()}.sock"))


@pytest.mark.parametrize("bad", ["udp://127.0.0.1:1", "tcp://127.0.0.1", "tcp://127.0.0.1:x", "tcp://127.0.0.1:70000", "ipc://"])
def test_a_malformed_address_is_a_channel_error_naming_it(bad: str) -> None:
    with pytest.raises(ChannelError, match="address"):
        TcpChannel().listen(bad)
    with TcpChannel().dialer() as dialer, pytest.raises(ChannelError):
        dialer.send(bad, b"x")


def test_options_are_checked() -> None:
    for bad in ({"max_frame_bytes": 0}, {"max_frame_bytes": 1 << 32}, {"send_timeout": 0}, {"high_water_mark": True},
                {"allow_insecure": "yes"}, {"max_unadmitted_connections": -1},
                {"busy_poll_us": -1}, {"busy_poll_us": 100_001}, {"busy_poll_us": True}, {"busy_poll_us": 0.5}):
        with pytest.raises(ConfigError):
            plugins.load_channel("tcp", **bad)


def test_a_frame_over_the_limit_closes_that_connection_only(closer: Callable[[T], T]) -> None:
    channel = TcpChannel(max_frame_bytes=1024)
    listener = closer(channel.listen(free_tcp_address()))
    dialer = closer(channel.dialer())
    bad = raw_peer(listener)
    bad.sendall(encode(b"fine", 1024) + (1025).to_bytes(4, "big") + b"y" * 1025)
    assert hears(listener) == (b"r" * IDENTITY_BYTES, b"fine")  # what came before still counts
    dialer.send(listener.address, b"other peer")
    got = hears(listener)
    assert got is not None and got[1] == b"other peer"
    assert closed_by_peer(bad)
    assert listener.refused == 1
    listener.send(got[0], b"still served")
    assert dialer.recv(ARRIVAL) == (listener.address, b"still served")


def test_a_zmq_peer_is_told_apart_both_ways(closer: Callable[[T], T], caplog: pytest.LogCaptureFixture) -> None:
    listener = closer(TcpChannel().listen(free_tcp_address()))
    context = zmq.Context()
    try:
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(listener.address)
        dealer.send(b"reference-shaped mf_meta")
        assert wait_for(lambda: listener.recv(0.05) or (True if listener.refused else None), ARRIVAL) is True
        dealer.close()
        router = context.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        address = free_tcp_address()
        router.bind(address)
        dialer = closer(TcpChannel().dialer())
        with caplog.at_level(logging.WARNING, logger="rd2h_tcp"):
            dialer.send(address, b"hello")
            assert dialer.recv(1.0) is None
        assert any("not an rd2h tcp peer" in r.getMessage() for r in caplog.records)
        router.close()
    finally:
        context.destroy(linger=0)


def test_the_listener_never_blocks_on_a_peer_that_does_not_read(closer: Callable[[T], T]) -> None:
    """Replies to a peer that reads none wait, bounded, then are dropped and counted; each
    send returns at once, and another peer is answered meanwhile."""
    channel = TcpChannel(high_water_mark=4, max_queued_bytes=1 << 20)
    listener = closer(channel.listen(free_tcp_address()))
    dialer = closer(channel.dialer())
    stuck = raw_peer(listener)
    stuck.sendall(encode(b"ask", 1 << 20))
    peer, _ = hears(listener) or (b"", b"")
    dialer.send(listener.address, b"ask too")
    other, _ = hears(listener) or (b"", b"")
    reply = b"z" * (256 << 10)
    slowest = 0.0
    errors = 0
    for _ in range(200):  # 50 MiB: far more than the socket buffers and the bound hold
        started = time.monotonic()
        try:
            listener.send(peer, reply)
        except ChannelError as exc:
            assert "dropped" in str(exc)
            errors += 1
        slowest = max(slowest, time.monotonic() - started)
        if errors >= 3:
            break
    assert errors >= 3 and listener.dropped == errors
    assert slowest < 0.5, f"a send took {slowest:.3f} s"
    listener.send(other, b"answer")
    assert dialer.recv(ARRIVAL) == (listener.address, b"answer")
    stuck.close()


def test_a_dialer_send_to_a_decode_that_does_not_read_is_bounded(closer: Callable[[T], T]) -> None:
    server = closer(socket.create_server(("127.0.0.1", 0)))  # accepts (in the kernel), never reads
    address = f"tcp://127.0.0.1:{server.getsockname()[1]}"
    dialer = closer(TcpChannel(send_timeout=0.3).dialer())
    started = time.monotonic()
    with pytest.raises(ChannelError, match="took no bytes"):
        for _ in range(1000):  # 1 GiB: far more than the kernel buffers
            dialer.send(address, b"x" * (1 << 20))
    assert time.monotonic() - started < 5.0


def test_a_reconnect_is_the_same_peer_and_replaces_the_old_connection(closer: Callable[[T], T]) -> None:
    channel = TcpChannel()
    listener = closer(channel.listen(free_tcp_address()))
    dialer = closer(channel.dialer())
    dialer.send(listener.address, b"first")
    first = hears(listener)
    dialer.disconnect(listener.address)
    dialer.send(listener.address, b"second")
    second = hears(listener)
    assert first is not None and second is not None and first[0] == second[0]
    listener.send(second[0], b"to the new connection")
    assert dialer.recv(ARRIVAL) == (listener.address, b"to the new connection")
    # a stale connection with the same identity that speaks later takes it over (zmq's handover)
    impostor = raw_peer(listener, identity=second[0])
    impostor.sendall(encode(b"third", 1 << 20))
    assert hears(listener) == (second[0], b"third")
    listener.send(second[0], b"to the newest")
    impostor.settimeout(ARRIVAL)
    assert impostor.recv(64).endswith(encode(b"to the newest", 1 << 20))
    impostor.close()


def test_the_connection_bound_closes_strangers_never_an_admitted_peer(closer: Callable[[T], T]) -> None:
    channel = TcpChannel(max_unadmitted_connections=4)
    listener = closer(channel.listen(free_tcp_address()))
    admitted = closer(channel.dialer())
    admitted.send(listener.address, b"mf_meta")
    got = hears(listener)
    assert got is not None
    listener.vouch(got[0])
    strangers = [closer(raw_peer(listener, identity=b"%016d" % i)) for i in range(12)]
    assert wait_for(lambda: listener.recv(0.05) or (True if listener.connections_closed >= 8 else None), ARRIVAL)
    counts = listener.connections()
    assert counts["vouched"] == 1
    assert counts["silent"] + counts["undecided"] + counts["disowned"] <= 4
    assert sum(closed_by_peer(s, within=0.2) for s in strangers) >= 8  # the closes are done: EOF waits
    listener.send(got[0], b"admitted, still served")
    assert admitted.recv(ARRIVAL) == (listener.address, b"admitted, still served")
    # a refused peer's connection goes first
    refused = closer(channel.dialer())
    refused.send(listener.address, b"mf_meta")
    peer = hears(listener)
    assert peer is not None
    listener.disown(peer[0])
    assert refused.recv(0.5) is None
    with pytest.raises(ChannelError, match="not connected"):
        listener.send(peer[0], b"gone")


def test_a_flooding_peer_is_paused_not_dropped_and_others_are_heard_in_turn(closer: Callable[[T], T]) -> None:
    channel = TcpChannel(max_queued_bytes=64 << 10)
    listener = closer(channel.listen(free_tcp_address()))
    flooder, quiet_one = closer(channel.dialer()), closer(channel.dialer())
    sent = [b"%05d" % i + b"f" * 4096 for i in range(400)]  # 1.6 MiB, 25x the bound
    done = threading.Event()

    def flood() -> None:
        for payload in sent:
            flooder.send(listener.address, payload)
        done.set()

    thread = threading.Thread(target=flood, daemon=True)
    thread.start()
    first = hears(listener)
    assert first is not None
    quiet_one.send(listener.address, b"me too")
    got = [first]
    while len(got) < len(sent) + 1:
        item = hears(listener)
        assert item is not None, f"heard {len(got)} of {len(sent) + 1}"
        got.append(item)
    assert done.wait(ARRIVAL)
    from_flooder = [p for _, p in got if p != b"me too"]
    assert from_flooder == sent  # paused, never dropped: every frame, in order
    assert listener.paused > 0
    assert [p for _, p in got].index(b"me too") < 200  # heard in turn, not after the whole flood


def test_a_stale_unix_socket_file_is_replaced(closer: Callable[[T], T]) -> None:
    path = f"{tempfile.gettempdir()}/rd2h-tcp-stale-{os.getpid()}.sock"
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(path)
    dead.close()  # the file stays: a listener that died without cleaning up
    listener = closer(TcpChannel().listen(f"ipc://{path}"))
    with TcpChannel().dialer() as dialer:
        dialer.send(listener.address, b"over the new socket")
        assert hears(listener) is not None
    listener.close()
    assert not os.path.exists(path)


def _free_pair() -> int:
    for _ in range(100):
        base = int(free_tcp_address().rsplit(":", 1)[1])
        try:
            with socket.create_server(("127.0.0.1", base + 1)):
                return base
        except OSError:
            continue
    raise RuntimeError("no two free ports in a row")


def test_the_demo_verifies_every_byte_over_tcp() -> None:
    """rd2h end to end over this channel: Prefill and Decode TP ranks as processes."""
    from rd2h.cli.demo.runner import run_demo
    from rd2h.cli.demo.workload import DemoConfig

    kv_port = _free_pair()
    config = DemoConfig(prefill_tp=2, decode_tp=2, layers=4, requests=3, max_tokens=512, block_size=32,
                        chunk_tokens=256, slots=1, timeout=60.0, kv_port=kv_port, channel="tcp")
    result = run_demo(config)
    assert result.verified, result.problems
