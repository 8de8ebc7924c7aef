"""Issue 19, items 3 and 4, on the Decode runtime: admission is fair and memory has one budget.

Real zmq on loopback, the real local engine, and hostile Prefills in processes of their own
(``hostile_prefill.py``: a real registration naming its own pid, a proof socket that accepts
and never answers, frames sent before the handshake ends). Measured on the code before
(f3a369e): a Prefill waited 49 s for its admission behind 20 silent proofs (4 helper threads,
10 s each), 1,100 refused identities evicted an admitted Prefill, and 8 hanging peers left
Decode 66 MB above its start (317 MB during) after they were gone.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
from test_sink_limits import World

from rd2h.clock import ManualClock
from rd2h.decode import admission
from rd2h.decode.peer_limits import PeerLimits
from rd2h.outcome import TerminalState
from rd2h.testing.channel_suite import until
from rd2h.wire import protocol

HERE = os.path.dirname(os.path.abspath(__file__))


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


class Hostile:
    """A hostile Prefill process (see hostile_prefill.py); ``lines`` waits for what it says."""

    def __init__(self, mode: str, address: str, count: int, held: int = 0) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "hostile_prefill.py"), mode, address, "--count", str(count),
             "--held", str(held)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        self.accepted = 0
        self.ready = threading.Event()
        self.changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self.changed:
                if line.startswith("accepted"):
                    self.accepted = int(line.split()[1])
                elif line.startswith("ready"):
                    self.ready.set()
                self.changed.notify_all()

    def wait_accepted(self, count: int, timeout: float = 60) -> None:
        with self.changed:
            assert self.changed.wait_for(lambda: self.accepted >= count, timeout), self.accepted

    def tell(self, word: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(word + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.tell("release")
            self.tell("exit")
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


class Ended:
    """Counts handshakes that ended (the sink's ``on_handshake``)."""

    def __init__(self) -> None:
        self.count = 0
        self.changed = threading.Condition()

    def __call__(self, seconds: float) -> None:
        with self.changed:
            self.count += 1
            self.changed.notify_all()

    def wait(self, count: int, timeout: float = 60) -> None:
        with self.changed:
            assert self.changed.wait_for(lambda: self.count >= count, timeout), self.count


@pytest.fixture
def ended() -> Ended:
    return Ended()


@pytest.fixture
def world(request: pytest.FixtureRequest, ended: Ended) -> Iterator[World]:
    w = World(PeerLimits(**getattr(request, "param", {})), ManualClock(), on_handshake=ended)
    w.sink.start()
    yield w
    w.close()


def one_request(world: World, sock: object, ext_id: str, block: int) -> None:
    world.sink.expect(ext_id, [block])
    reqs = (protocol.ReadRequest(ext_id, (1,), (1,), 0, 0),)
    assert isinstance(world.ready(sock, protocol.encode(protocol.ReadReadyBatch(0, "l0", reqs, ()))), protocol.ReadDone)
    reply = world.ready(sock, protocol.encode(protocol.ReadReadyBatch(1, "l1", reqs, (ext_id,))))
    assert isinstance(reply, protocol.ReadDone), reply
    assert world.sink.wait([ext_id], 10)[ext_id].state is TerminalState.DONE


def test_a_prefill_is_admitted_in_its_own_proof_time_while_20_strangers_hang(world: World, ended: Ended) -> None:
    """Item 3: a local process sends 20 handshakes whose proof sockets accept and never
    answer. Before, they took Decode's 4 handshake threads for 10 s each and a Prefill
    arriving after them was admitted 49 s later, past its 30 s reply timeout. Now that
    process gets 4 proofs waiting (the rest are refused at once) and no handshake waits for
    another: the Prefill is admitted in its own proof time."""
    hostile = Hostile("hang", world.sink.address, 20)
    try:
        assert hostile.ready.wait(60)
        ended.wait(16)  # all but its share of proofs were refused, at once
        good = world.dealer()
        started = time.monotonic()
        world.handshake(good)
        took = time.monotonic() - started
        assert took < 9.0, f"admitted after {took:.1f} s"  # under one stranger's 10 s proof: it waited for none
        ended.wait(17)  # counted just after the ACK is sent
        assert len(world.sink._engine.proofs) == 4  # the 4 still hang
        one_request(world, good, "r", 3)
    finally:
        hostile.close()


@pytest.mark.parametrize("world", [dict(max_peers=4, max_refused=8)], indirect=True, ids=["limits"])
def test_refused_identities_never_evict_an_admitted_prefill(world: World, ended: Ended) -> None:
    """Item 3: refused identities counted toward max_peers, so 1,100 of them sent in 4 s
    evicted an admitted Prefill between two requests, and its next request failed (mf_meta
    required). Here 200 refused identities against max_peers=4: the Prefill keeps working."""
    good = world.dealer()
    world.handshake(good)
    one_request(world, good, "first", 3)
    hostile = Hostile("cheap", world.sink.address, 200)
    try:
        assert hostile.ready.wait(60)
        ended.wait(201)
        assert world.sink.counters.peers_dropped == 200 - 8  # refused ones only, past their own cap
        one_request(world, good, "second", 4)
    finally:
        hostile.close()


def test_frames_held_during_handshakes_have_one_budget_and_memory_returns(world: World, ended: Ended) -> None:
    """Item 4: 8 peers whose proofs hang send 32 MiB of frames each. Before, Decode held all
    of them (317 MB, from 54) and kept 66 MB after they left: the refusal's traceback kept
    each handshake's frames alive, and glibc kept the freed pages. Now every peer together
    holds at most MAX_HELD_TOTAL, and RSS returns once they are gone."""
    good = world.dealer()
    world.handshake(good)
    gc.collect()
    before = rss_mb()
    hostiles = [Hostile("hang", world.sink.address, 4, 32 << 20) for _ in range(2)]
    try:
        for hostile in hostiles:
            assert hostile.ready.wait(120)
            hostile.wait_accepted(4)
        held = world.sink._admissions  # frames still arriving over loopback: a state polled, bounded
        until(lambda: held.dropped >= 8 * 32 - (admission.MAX_HELD_TOTAL >> 20), 120, 0.05)
        assert held.dropped >= 8 * 32 - (admission.MAX_HELD_TOTAL >> 20), held.dropped
        assert held.held_bytes <= admission.MAX_HELD_TOTAL
        during = rss_mb()
        for hostile in hostiles:
            hostile.tell("release")  # every proof fails; the held frames are handled (malformed)
        ended.wait(1 + 8)
        one_request(world, good, "after", 3)  # the loop has moved past the held frames
    finally:
        for hostile in hostiles:
            hostile.close()
    gc.collect()
    after = rss_mb()
    print(f"RSS before {before:.0f} MB, during {during:.0f} MB, after {after:.0f} MB")
    assert held.held_bytes == 0
    assert after - before < 32, f"RSS before {before:.0f} MB, during {during:.0f} MB, after {after:.0f} MB"
