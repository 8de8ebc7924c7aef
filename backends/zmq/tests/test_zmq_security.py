"""Issue 9 on real loopback sockets: a slow reader cannot stall the listener (D2), no
listener off loopback without CURVE unless asked, CURVE keys per role, a peer's identity
bound to its CURVE key, and per-peer inbound memory bounded (D7).

Each test fails on 87b7601 (checked with ``git worktree add /tmp/old 87b7601`` and the
old packages first on PYTHONPATH): there a reply to a peer that does not read blocked the
loop for ``send_timeout`` (5 s), any address was bound without CURVE, one key could serve
both roles, another key took over a routing id and was the same peer, and the options
below did not exist.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
import zmq
import zmq.auth
from rd2h_zmq import ZmqChannel

from rd2h.errors import ChannelError, ConfigError

T = TypeVar("T")
ARRIVAL = 5.0
MiB = 1 << 20


@pytest.fixture
def raw_context() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("curve")
    made: dict[str, Path] = {}
    for name in ("server", "alice", "mallory"):
        public, secret = zmq.auth.create_certificates(root, name)
        made[name], made[name + "_secret"] = Path(public), Path(secret)
    authorized = root / "authorized"
    authorized.mkdir()
    for name in ("alice", "mallory"):  # both are authorized Prefills
        (authorized / f"{name}.key").write_bytes(made[name].read_bytes())
    made["authorized"] = authorized
    return made


def _public(keys: dict[str, Path], who: str) -> bytes:
    return zmq.auth.load_certificate(keys[who])[0]


# -- D2: a slow reader -------------------------------------------------------------------------


def test_a_peer_that_never_reads_cannot_stall_replies_to_others(
    closer: Callable[[T], T], raw_context: zmq.Context[zmq.Socket[bytes]]
) -> None:
    """D2: replies were sent with a blocking send (5 s) on Decode's only loop thread; a peer
    that never reads made every reply to every peer wait. Now a full per-peer queue drops
    that peer's reply at once (counted) and the other peer is answered."""
    channel = ZmqChannel(high_water_mark=2, max_frame_bytes=2 * MiB)
    listener = closer(channel.listen("tcp://127.0.0.1:0"))
    stuck = raw_context.socket(zmq.DEALER)  # a real zmq peer that never calls recv
    stuck.linger = 0
    stuck.rcvhwm = 1
    stuck.rcvbuf = 4096
    stuck.connect(listener.address)
    stuck.send(b"hello")
    stuck_id, _ = listener.recv(ARRIVAL)
    slowest, dropped = 0.0, False
    for _ in range(500):  # the kernel's buffers and both queues fill within a few MiB
        start = time.monotonic()
        try:
            listener.send(stuck_id, b"r" * MiB)
        except ChannelError as exc:
            assert "dropped" in str(exc)
            dropped = True
        slowest = max(slowest, time.monotonic() - start)
        if dropped:
            break
    assert dropped and listener.dropped >= 1
    assert slowest < 1.0, f"a send to the stuck peer blocked the loop for {slowest:.1f} s"
    friend = closer(channel.dialer())
    friend.send(listener.address, b"ping")
    friend_id, payload = listener.recv(ARRIVAL)
    start = time.monotonic()
    listener.send(friend_id, b"pong")
    assert time.monotonic() - start < 1.0
    assert payload == b"ping" and friend.recv(ARRIVAL) == (listener.address, b"pong")


# -- D7: inbound memory per peer ---------------------------------------------------------------


def test_inbound_queue_per_peer_is_bounded_in_bytes() -> None:
    """D7: a listener queued 1,000 frames of up to 64 MiB per peer (64 GB). The frames one
    peer may park here now fit ``max_queued_bytes``; the rest waits in the peer's own queue."""
    default = ZmqChannel().settings
    assert default.receive_high_water_mark * default.max_frame_bytes <= 256 * MiB
    small = ZmqChannel(max_frame_bytes=MiB, max_queued_bytes=8 * MiB, high_water_mark=1000)
    assert small.settings.receive_high_water_mark == 8
    assert ZmqChannel(max_frame_bytes=MiB, max_queued_bytes=1).settings.receive_high_water_mark == 1
    with pytest.raises(ConfigError):
        ZmqChannel(max_queued_bytes=0)


def test_a_flood_of_frames_is_held_back_not_queued_here(closer: Callable[[T], T]) -> None:
    """The listener keeps at most ``receive_high_water_mark`` frames of a peer that sends
    faster than Decode reads; everything still arrives, in order, as Decode reads on."""
    channel = ZmqChannel(max_frame_bytes=64 << 10, max_queued_bytes=4 * (64 << 10))
    assert channel.settings.receive_high_water_mark == 4
    listener = closer(channel.listen("tcp://127.0.0.1:0"))
    dialer = closer(channel.dialer())
    for i in range(200):
        dialer.send(listener.address, i.to_bytes(4, "big") * (16 << 10))
    got = [int.from_bytes(listener.recv(ARRIVAL)[1][:4], "big") for _ in range(200)]
    assert got == list(range(200))


# -- listening off loopback --------------------------------------------------------------------


@pytest.mark.parametrize("address", ["tcp://0.0.0.0:0", "tcp://*:0", "tcp://eth0:0", "tcp://10.1.2.3:5600"])
def test_no_listener_off_loopback_without_curve(address: str) -> None:
    with pytest.raises(ConfigError, match="without CURVE.*allow_insecure"):
        ZmqChannel().listen(address).close()


@pytest.mark.parametrize("address", ["tcp://127.0.0.1:0", "tcp://127.3.4.5:0", "tcp://localhost:0", "ipc:///tmp/rd2h-sec-{}", "inproc://rd2h-sec"])
def test_loopback_and_local_transports_need_no_curve(address: str) -> None:
    ZmqChannel().listen(address.format(time.monotonic_ns())).close()


def test_off_loopback_when_asked_or_with_curve(keys: dict[str, Path]) -> None:
    ZmqChannel(allow_insecure=True).listen("tcp://0.0.0.0:0").close()
    secure = ZmqChannel(curve_secret_key=keys["server_secret"], curve_authorized_keys=keys["authorized"])
    secure.listen("tcp://0.0.0.0:0").close()
    with pytest.raises(ConfigError, match="allow_insecure"):
        ZmqChannel(allow_insecure="yes")


# -- CURVE keys per role and identities bound to keys -----------------------------------------


def test_one_certificate_cannot_serve_both_roles(keys: dict[str, Path], tmp_path: Path) -> None:
    mixed = tmp_path / "authorized"
    mixed.mkdir()
    (mixed / "server.key").write_bytes(keys["server"].read_bytes())  # Decode's key as a client
    with pytest.raises(ConfigError, match="own certificates"):
        ZmqChannel(curve_secret_key=keys["server_secret"], curve_authorized_keys=mixed)
    with pytest.raises(ConfigError, match="client certificate"):
        ZmqChannel(curve_secret_key=keys["server_secret"], curve_server_key=keys["server"])


def test_another_key_taking_a_routing_id_is_another_peer(
    keys: dict[str, Path], closer: Callable[[T], T], raw_context: zmq.Context[zmq.Socket[bytes]]
) -> None:
    """Identity hijack: an authorized key that connects with Alice's routing id (handover
    gives it the id) must not speak as Alice. The listener names peers by key + routing id."""
    server = ZmqChannel(curve_secret_key=keys["server_secret"], curve_authorized_keys=keys["authorized"])
    listener = closer(server.listen("tcp://127.0.0.1:0"))
    alice = closer(ZmqChannel(curve_secret_key=keys["alice_secret"], curve_server_key=keys["server"]).dialer())
    alice.send(listener.address, b"mf_meta from alice")
    alice_peer, _ = listener.recv(ARRIVAL)
    public, secret = zmq.auth.load_certificate(keys["mallory_secret"])
    mallory = raw_context.socket(zmq.DEALER)
    mallory.linger = 0
    mallory.routing_id = alice.routing_id
    mallory.curve_publickey, mallory.curve_secretkey = public, secret
    mallory.curve_serverkey = _public(keys, "server")
    mallory.connect(listener.address)
    mallory.send(b"readiness as alice")
    mallory_peer, payload = listener.recv(ARRIVAL)
    assert payload == b"readiness as alice"
    assert mallory_peer != alice_peer
    assert listener.peer_key(alice_peer) == _public(keys, "alice").decode()
    assert listener.peer_key(mallory_peer) == public.decode()
    plain = closer(ZmqChannel().listen("tcp://127.0.0.1:0"))
    assert plain.peer_key(alice.routing_id) is None  # without CURVE nothing is proven
