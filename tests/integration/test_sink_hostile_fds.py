"""Issue 19, item 3, on the Decode runtime: fds per unadmitted source are bounded.

Real zmq on loopback, the real local engine, hostile peers in a process of their own. Before
(cdf2a2f^) every connection cost Decode an fd for as long as its peer kept it open: 1,100
refused peers took Decode from 27 to 1,129 fds, 1,000 connections that never send anything
from 29 to 1,031. Now the listener keeps at most ``max_unadmitted_connections`` (256) that
carry no admitted peer; the admitted Prefill's connection is never shut and its requests are
read throughout.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import zmq
from test_sink_hostile_admission import Ended, Hostile, one_request
from test_sink_limits import World
from zmq.utils.monitor import recv_monitor_message

from rd2h.clock import ManualClock
from rd2h.decode.peer_limits import PeerLimits
from rd2h.testing.channel_suite import until
from rd2h.wire import protocol

BOUND = 256  # the zmq channel's default max_unadmitted_connections
# Connections accepted and not yet seen by the loop, or shut and not yet closed by libzmq:
# libzmq accepts on its own thread, the loop enforces the bound between messages, so a burst
# of reconnections on a loaded machine overshoots (seen: +129 over the bound with helpers
# running beside). Still far below the unbounded 1,000+.
SLACK = BOUND
WAIT = 120.0

# Connections that never send anything, kept open until stdin says so.
_SILENT = r"""
import resource, sys, zmq
resource.setrlimit(resource.RLIMIT_NOFILE, (8192, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
ctx = zmq.Context()
ctx.max_sockets = int(sys.argv[2]) + 16
socks = []
for _ in range(int(sys.argv[2])):
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(sys.argv[1])
    socks.append(sock)
print("ready", flush=True)
sys.stdin.readline()
"""


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def ended() -> Ended:
    return Ended()


@pytest.fixture
def world(ended: Ended) -> Iterator[World]:
    w = World(PeerLimits(), ManualClock(), on_handshake=ended)
    w.sink.start()
    yield w
    w.close()


class Admitted:
    """An admitted Prefill whose connection is watched from its own side."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.sock = world.dealer()
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        world.handshake(self.sock)
        self.requests = 0

    def request(self) -> None:
        self.requests += 1
        one_request(self.world, self.sock, f"r{self.requests}", 3 + self.requests % 4)

    def was_shut(self) -> bool:
        while self.monitor.poll(0):
            if recv_monitor_message(self.monitor)["event"] == zmq.EVENT_DISCONNECTED:
                return True
        return False

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(linger=0)


def bounded_while_attacked(world: World, good: Admitted, base: int, shut_at_least: int, attackers: int) -> int:
    """Requests go through while the listener shuts what is over its bound; the most fds seen.

    Judged on the median of 21 samples (at most ``BOUND + SLACK`` over the base: the bound
    with libzmq's accept backlog) and on the peak (below what the attackers would hold
    unbounded, less half the bound): a single sample on a loaded machine can catch a burst
    of reconnections libzmq accepted and the loop has not shut yet (seen: +396 at load 8)."""
    listener = world.sink._listener
    deadline = time.monotonic() + WAIT
    while listener.connections_closed < shut_at_least:
        assert time.monotonic() < deadline, (listener.connections_closed, listener.connections())
        good.request()
    samples = []
    for _ in range(21):  # the attackers reconnect by themselves: the bound holds throughout
        good.request()
        samples.append(fds() - base)
    samples.sort()
    assert samples[len(samples) // 2] <= BOUND + SLACK, f"{base} + {samples} fds"
    assert samples[-1] < attackers - BOUND // 2, f"{base} + {samples} fds: as many as unbounded"
    assert listener.connections()["vouched"] == 1
    assert not good.was_shut()
    return base + samples[-1]


def test_refused_peers_cost_a_bounded_number_of_fds(world: World, ended: Ended) -> None:
    good = Admitted(world)
    good.request()
    base = fds()
    hostile = Hostile("cheap", world.sink.address, 1100)
    try:
        assert hostile.ready.wait(WAIT)
        # A burst past the bound itself shuts connections whatever their age, so some of these
        # mf_metas may never arrive (a Prefill introducing itself then is read: see the docs)
        ended.wait(BOUND, WAIT)
        peak = bounded_while_attacked(world, good, base, 1100 - BOUND, 1100)
        print(f"1,100 refused peers: Decode fds {base} -> {peak} (at most); {ended.count - 1} refused")
    finally:
        hostile.close()
        good.close()


def test_connections_that_never_speak_cost_a_bounded_number_of_fds(world: World) -> None:
    good = Admitted(world)
    good.request()
    base = fds()
    silent = subprocess.Popen(
        [sys.executable, "-c", _SILENT, world.sink.address, "1000"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert silent.stdout is not None and silent.stdout.readline().startswith("ready")
        peak = bounded_while_attacked(world, good, base, 1000 - BOUND, 1000)
        print(f"1,000 silent connections: Decode fds {base} -> {peak} (at most)")
    finally:
        assert silent.stdin is not None
        silent.stdin.write("exit\n")
        silent.stdin.flush()
        silent.wait(30)
        good.close()


def test_a_peer_that_speaks_without_introducing_itself_is_among_the_first_shut(world: World) -> None:
    """A readiness before any mf_meta is answered 'mf_meta required' and its connection disowned;
    once the peer introduces itself and is admitted, it is vouched for again."""
    listener = world.sink._listener
    sock = world.dealer()
    req = protocol.ReadRequest("r", (0,), (0,), 0, 0)
    sock.send(protocol.encode(protocol.ReadReadyBatch(0, "l0", (req,), ())))
    assert sock.poll(int(WAIT * 1000)), "Decode did not reply"
    reply = protocol.decode_reply(sock.recv_multipart()[-1])
    assert isinstance(reply, protocol.ReadFailed)
    assert listener.connections()["disowned"] == 1  # before the fix: 'undecided', shut after strangers
    world.handshake(sock)
    assert listener.connections()["disowned"] == 0 and listener.connections()["vouched"] == 1
    sock.close(linger=0)


def test_a_stranger_sending_garbage_is_disowned_and_an_admitted_peer_is_not(world: World) -> None:
    listener = world.sink._listener
    good = world.dealer()
    world.handshake(good)
    stranger = world.dealer()
    for sock in (stranger, good):
        sock.send(b"\xc1")  # a byte msgpack never uses
    # the loop counts a malformed frame, then disowns its sender: wait for both (bounded)
    assert until(lambda: world.sink.counters.malformed == 2 and listener.connections().get("disowned") == 1, WAIT), (
        listener.connections()
    )
    assert listener.connections()["vouched"] == 1  # the admitted peer's garbage disowns nothing
    for sock in (stranger, good):
        sock.close(linger=0)
