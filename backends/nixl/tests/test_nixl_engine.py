"""What the conformance suite cannot know about the nixl engine: options, metadata, the progress
thread's cost, and UCX over TCP (what two hosts use) with a stopped and a killed peer."""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import pytest

from rd2h.errors import BackendUnavailableError, ConfigError, PeerGoneError, TransferError, TransferTimeout
from rd2h.interfaces import MemoryKinds, Region
from rd2h.layout.regions import KindIndex
from rd2h.plugins import engine_class, list_backends, load_engine
from rd2h.testing.peer import PeerProcess
from rd2h_nixl import NixlEngine, _metadata, _native
from rd2h_nixl.engine import NixlSession

TCP = {"UCX_TLS": "tcp,self"}  # keeps two processes of one host off cma, as on two hosts


def _stop(pid: int) -> None:
    """SIGSTOP, then wait until the kernel shows the process stopped (kill() returns earlier,
    and a read issued in between would still be served)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as stat:
            if stat.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                return
    raise AssertionError(f"process {pid} did not stop")


def test_published_under_its_entry_point() -> None:
    assert engine_class("nixl") is NixlEngine



def test_listed_as_available_by_rd2h_backends() -> None:
    row = next(b for b in list_backends() if (b.kind, b.name) == ("engine", "nixl"))
    assert row.available and row.distribution == "rd2h-nixl", row

@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"role": "both"}, "role"),
        ({"role": "decode", "timeout": -1}, "timeout"),
        ({"role": "decode", "progress_thread": "yes"}, "progress_thread"),
        ({"role": "decode", "progress_delay_us": -5}, "progress_delay_us"),
        ({"role": "decode", "poll_interval_us": 1.5}, "poll_interval_us"),
        ({"role": "decode", "agent_name": ""}, "agent_name"),
        ({"role": "decode", "backend": "NOPE"}, "NOPE"),
        ({"role": "decode", "threads": 2}, "threads"),
    ],
)
def test_bad_options_are_config_errors(options: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        NixlEngine(**options)


def test_missing_wheel_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_native.importlib.util, "find_spec", lambda name: None)
    assert "rd2h[nixl]" in NixlEngine.availability().reason
    with pytest.raises(BackendUnavailableError, match=r"rd2h\[nixl\]"):
        NixlEngine("decode")


def test_progress_thread_follows_the_role() -> None:
    with NixlEngine("prefill") as p, NixlEngine("decode") as d:
        assert p.progress_thread and not d.progress_thread


def _tasks() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def _cpu_seconds(tids: set[int]) -> float:
    total = 0
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
        except FileNotFoundError:  # the thread ended
            pass
    return total / os.sysconf("SC_CLK_TCK")


def _agent_cpu_while_idle(**options: Any) -> float:
    """CPU seconds the threads an idle prefill engine started burn in one second (only
    those threads: other tests' engines in this process do not count)."""
    before = _tasks()
    with NixlEngine("prefill", **options):
        threads = _tasks() - before
        start = _cpu_seconds(threads)
        threading.Event().wait(1.0)  # measuring what the agent's thread burns, not waiting for it
        return _cpu_seconds(threads) - start


def test_an_idle_progress_thread_does_not_spin() -> None:
    assert _agent_cpu_while_idle() < 0.1
    # what NIXL's own wrapper does (no pause): a core, or what of it a loaded machine leaves
    assert _agent_cpu_while_idle(progress_delay_us=0) > 0.25


class TestMetadata:
    def test_round_trip(self) -> None:
        blob = _metadata.encode("agent-1", b"\x01md", [(4096, 8192)])
        assert _metadata.decode(blob) == ("agent-1", b"\x01md", [(4096, 8192)], ("host",))
        blob = _metadata.encode("agent-1", b"\x01md", [(4096, 8192), (1 << 40, 4096)], ["host", "cuda:3"])
        assert _metadata.decode(blob)[3] == ("host", "cuda:3")

    def test_a_blob_without_kinds_is_host_memory(self) -> None:
        """A peer from before the kinds field registered host memory only."""
        old = msgpack.packb([b"rd2h-nixl", 1, "a", b"m", [[4096, 8192]]])
        assert _metadata.decode(old)[3] == ("host",)

    @pytest.mark.parametrize(
        "blob",
        [
            msgpack.packb([b"rd2h-mooncake", 1, "a", b"m", []]),
            msgpack.packb([b"rd2h-nixl", 2, "a", b"m", []]),
            msgpack.packb([b"rd2h-nixl", 1, "", b"m", []]),
            msgpack.packb([b"rd2h-nixl", 1, "a", "not bytes", []]),
            msgpack.packb([b"rd2h-nixl", 1, "a", b"", []]),
            msgpack.packb([b"rd2h-nixl", 1, "a", b"m", [[1, 0]]]),
            msgpack.packb([b"rd2h-nixl", 1, "a", b"m", [[4096, 1]], ["cuda"]]),
            msgpack.packb([b"rd2h-nixl", 1, "a", b"m", [[4096, 1]], ["cpu"]]),
            msgpack.packb([b"rd2h-nixl", 1, "a", b"m", [[4096, 1]], [0]]),
            msgpack.packb([b"rd2h-nixl", 1, "a", b"m", [[4096, 1]], ["host", "host"]]),
            msgpack.packb([b"rd2h-nixl", 1, "a", b"m", [[4096, 1]], "host"]),
        ],
    )
    def test_garbage_names_the_engine(self, blob: bytes) -> None:
        with pytest.raises(TransferError, match="nixl-engine metadata"):
            _metadata.decode(blob)


def test_metadata_of_another_agent_is_refused() -> None:
    with NixlEngine("prefill") as a, NixlEngine("decode") as reader:
        mem = mmap.mmap(-1, 4096)
        real = a.register([Region(np.frombuffer(mem, np.uint8).ctypes.data, 4096)])
        name, md, regions, kinds = _metadata.decode(real)
        with pytest.raises(TransferError, match="names agent"):
            reader.connect(_metadata.encode("someone-else", md, regions, kinds))


def test_declares_host_and_cuda_memory() -> None:
    both = frozenset({"host", "cuda"})
    assert NixlEngine.memory_kinds() == MemoryKinds(both, both)


def test_regions_of_two_kinds_that_overlap_are_refused() -> None:
    with NixlEngine("decode") as reader:
        blob = _metadata.encode("a", b"m", [(1 << 20, 8192), (1 << 20, 4096)], ["host", "cuda:0"])
        with pytest.raises(TransferError, match="two memory kinds overlap"):
            reader.connect(blob)


def test_gpu_memory_is_registered_as_vram_of_its_device() -> None:
    """A cuda region goes to NIXL as VRAM: with no GPU here, UCX finds host memory where
    VRAM was promised and NIXL refuses it (as DRAM it would have been registered). The
    refusal is a TransferError, and the engine goes on registering host memory."""
    with NixlEngine("prefill") as engine:
        mem = mmap.mmap(-1, 1 << 20)
        addr = np.frombuffer(mem, np.uint8).ctypes.data
        with pytest.raises(TransferError, match="registerMem"):
            engine.register([Region(addr, 1 << 20, kind="cuda:0")])
        name, _, regions, kinds = _metadata.decode(engine.register([Region(addr, 4096)]))
        assert regions == [(addr, 4096)] and kinds == ("host",)


def test_a_read_is_one_request_per_pair_of_kinds() -> None:
    """Local destinations in host and GPU memory, remote sources in two GPUs: the batch is
    cut into one NIXL descriptor list per (local kind, remote kind), each row carrying its
    device index; host-only on both sides stays one list without a lookup."""
    with NixlEngine("decode") as engine:
        engine._kinds = KindIndex([Region(0x1000, 0x1000), Region(0x7F0000000000, 0x1000, "cuda:1")])
        session = NixlSession(engine, "peer", [Region(0x10000, 0x1000, "cuda:0"), Region(0x7E0000000000, 0x1000, "cuda:2")])
        local = np.array([0x1000, 0x7F0000000000, 0x1100, 0x7F0000000100], np.int64)
        remote = np.array([0x10000, 0x10100, 0x7E0000000000, 0x10200], np.int64)
        groups = engine._groups(session, local, remote, np.array([16, 32, 48, 64], np.int64))
        got = {(g.local_kind, g.remote_kind): (g.local.tolist(), g.remote.tolist()) for g in groups}
        assert got == {
            ("host", "cuda:0"): ([[0x1000, 16, 0]], [[0x10000, 16, 0]]),
            ("host", "cuda:2"): ([[0x1100, 48, 0]], [[0x7E0000000000, 48, 2]]),
            ("cuda:1", "cuda:0"): ([[0x7F0000000000, 32, 1], [0x7F0000000100, 64, 1]], [[0x10100, 32, 0], [0x10200, 64, 0]]),
        }
        assert {nx for nx in (engine._segment("host"), engine._segment("cuda:1"))} == {engine._nx.DRAM_SEG, engine._nx.VRAM_SEG}


@pytest.fixture
def tcp_reader(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[NixlEngine, np.ndarray]]:
    for key, value in TCP.items():
        monkeypatch.setenv(key, value)
    with load_engine("nixl", "decode", timeout=3.0) as engine:
        mem = mmap.mmap(-1, 4 << 20)
        dest = np.frombuffer(mem, dtype=np.uint8)
        engine.register([Region(dest.ctypes.data, len(dest))])
        yield engine, dest


@pytest.fixture
def tcp_peer() -> Iterator[PeerProcess]:
    with PeerProcess("nixl", sizes=(4 << 20,), seed=9, env=TCP) as p:
        yield p


def _whole(dest: np.ndarray, peer: PeerProcess) -> tuple[np.ndarray, ...]:
    return (
        np.array([dest.ctypes.data], np.int64),
        np.array([peer.regions[0][0]], np.int64),
        np.array([len(dest)], np.int64),
    )


def test_tcp_stopped_peer_times_out_and_a_resumed_one_is_read_again(
    tcp_reader: tuple[NixlEngine, np.ndarray], tcp_peer: PeerProcess
) -> None:
    engine, dest = tcp_reader
    session = engine.connect(tcp_peer.metadata)
    engine.read_batch(session, *_whole(dest, tcp_peer))
    assert np.array_equal(dest, tcp_peer.expected(0))
    _stop(tcp_peer.pid)
    try:
        start, cpu = time.monotonic(), time.process_time()
        with pytest.raises(TransferTimeout, match="in progress"):
            engine.read_batch(session, *_whole(dest, tcp_peer))
        waited = time.monotonic() - start
        assert waited < engine.timeout + 2
        # polled every poll_interval_us after the first millisecond, not flat out for 3 s
        assert time.process_time() - cpu < waited / 3
    finally:
        os.kill(tcp_peer.pid, signal.SIGCONT)
    dest[:] = 0
    engine.read_batch(engine.connect(tcp_peer.metadata), *_whole(dest, tcp_peer))
    assert np.array_equal(dest, tcp_peer.expected(0))


def test_tcp_killed_peer_is_peer_gone(tcp_reader: tuple[NixlEngine, np.ndarray], tcp_peer: PeerProcess) -> None:
    engine, dest = tcp_reader
    session = engine.connect(tcp_peer.metadata)
    engine.read_batch(session, *_whole(dest, tcp_peer))
    tcp_peer.kill()
    with pytest.raises(PeerGoneError):
        engine.read_batch(session, *_whole(dest, tcp_peer))


def test_a_process_with_an_agent_exits_cleanly() -> None:
    # nixl-cu12 1.5.1 with UCX's InfiniBand modules loaded dies in libnl-route at exit (rc -11);
    # UCX logs to stdout unless told otherwise
    env = {k: v for k, v in os.environ.items() if k not in ("UCX_MODULES", "UCX_LOG_FILE")}
    code = "from rd2h_nixl import NixlEngine\nNixlEngine('decode').close()\nNixlEngine('prefill')\n"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-2000:]


def test_a_range_the_peer_never_registered_is_a_transfer_error(tcp_reader: tuple[NixlEngine, np.ndarray]) -> None:
    # rd2h metadata that claims more than the agent registered passes rd2h's check; NIXL refuses
    engine, dest = tcp_reader
    with PeerProcess("nixl", sizes=(1 << 20,), seed=3) as peer:
        name, agent_md, regions, _ = _metadata.decode(peer.metadata)
        (addr, length), *rest = regions
        session = engine.connect(_metadata.encode(name, agent_md, [(addr, length + 4096), *rest]))
        args = (np.array([dest.ctypes.data], np.int64), np.array([addr + length], np.int64), np.array([4096], np.int64))
        with pytest.raises(TransferError, match="nixl") as failure:
            engine.read_batch(session, *args)
        assert type(failure.value) is TransferError
