"""What the conformance suite cannot know about the mooncake engine: its options, its metadata,
its split under mooncake's per-peer queue, and a stopped (not dead) peer."""

from __future__ import annotations

import mmap
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import pytest

from rd2h.errors import BackendUnavailableError, ConfigError, PeerGoneError, TransferError, TransferTimeout
from rd2h.interfaces import Availability, MemoryKinds, Region
from rd2h.layout.regions import RegionSet
from rd2h.plugins import engine_class, list_backends, load_engine
from rd2h.testing.peer import PeerProcess
from rd2h_mooncake import MooncakeEngine, _metadata, _native

from mooncake_test_options import OPTIONS


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
    assert engine_class("mooncake") is MooncakeEngine



def test_listed_as_available_by_rd2h_backends() -> None:
    row = next(b for b in list_backends() if (b.kind, b.name) == ("engine", "mooncake"))
    assert row.available and row.distribution == "rd2h-mooncake", row

@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"role": "both"}, "role"),
        ({"role": "decode", "hostname": "localhost"}, "IPv4"),
        ({"role": "decode", "protocol": "udp"}, "protocol"),
        ({"role": "decode", "device_name": 3}, "device_name"),
        ({"role": "decode", "timeout": 0}, "timeout"),
        ({"role": "decode", "timeout": True}, "timeout"),
        ({"role": "decode", "transfer_timeout_s": 0}, "transfer_timeout_s"),
        ({"role": "decode", "progress_timeout_s": 1.5}, "progress_timeout_s"),
        ({"role": "decode", "max_queued_per_peer": -1}, "max_queued_per_peer"),
        ({"role": "decode", "queue": 1}, "queue"),
    ],
)
def test_bad_options_are_config_errors(options: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        MooncakeEngine(**options)


def test_knobs_are_process_wide() -> None:
    with load_engine("mooncake", "decode", **OPTIONS):
        assert os.environ["MC_TCP_PROGRESS_TIMEOUT_SEC"] == str(OPTIONS["progress_timeout_s"])
        assert os.environ["MC_TRANSFER_TIMEOUT"] == str(OPTIONS["transfer_timeout_s"])
        with pytest.raises(ConfigError, match="once per process"):
            MooncakeEngine("decode", **{**OPTIONS, "progress_timeout_s": 7})


def test_missing_pieces_name_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_native.ctypes.util, "find_library", lambda name: None)
    assert MooncakeEngine.availability() == Availability(False, _native.environment()[1])
    assert "apt-get install libibverbs1" in MooncakeEngine.availability().reason
    with pytest.raises(BackendUnavailableError, match="libibverbs"):
        MooncakeEngine("decode", **OPTIONS)
    monkeypatch.setattr(_native.importlib.util, "find_spec", lambda name: None)
    assert "rd2h[mooncake]" in MooncakeEngine.availability().reason


class TestMetadata:
    def test_round_trip(self) -> None:
        blob = _metadata.encode("10.1.2.3:5000", [(4096, 8192)])
        assert _metadata.decode(blob) == ("10.1.2.3:5000", [(4096, 8192)])

    @pytest.mark.parametrize(
        "blob",
        [
            msgpack.packb([b"rd2h-memfabric", 1, "127.0.0.1:1", []]),
            msgpack.packb([b"rd2h-mooncake", 2, "127.0.0.1:1", []]),
            msgpack.packb([b"rd2h-mooncake", 1, "127.0.0.1", []]),
            msgpack.packb([b"rd2h-mooncake", 1, 7, []]),
            msgpack.packb([b"rd2h-mooncake", 1, "127.0.0.1:1", [[0, 0]]]),
        ],
    )
    def test_garbage_names_the_engine(self, blob: bytes) -> None:
        with pytest.raises(TransferError, match="mooncake-engine metadata"):
            _metadata.decode(blob)


class _Dest:
    """A registered host destination of ``size`` bytes."""

    def __init__(self, engine: MooncakeEngine, size: int) -> None:
        self.mem = mmap.mmap(-1, size)
        self.view = np.frombuffer(self.mem, dtype=np.uint8)
        self.addr = self.view.ctypes.data
        engine.register([Region(self.addr, size)])


@pytest.fixture(scope="module")
def reader() -> Iterator[MooncakeEngine]:
    with load_engine("mooncake", "decode", **OPTIONS) as engine:
        yield engine


@pytest.fixture
def peer() -> Iterator[PeerProcess]:
    with PeerProcess("mooncake", sizes=(8 << 20,), seed=5, options=OPTIONS) as p:
        yield p


def test_batch_above_the_queue_limit_is_split(reader: MooncakeEngine, peer: PeerProcess) -> None:
    # mooncake alone fails a batch of this many 1 KiB entries at once (rc -1, "queue-full")
    n, bl = 3 * OPTIONS.get("max_queued_per_peer", 2048), 1024
    dest = _Dest(reader, n * bl)
    order = np.random.default_rng(1).permutation(n)
    session = reader.connect(peer.metadata)
    remote = peer.regions[0][0] + order.astype(np.int64) * bl
    reader.read_batch(session, dest.addr + np.arange(n, dtype=np.int64) * bl, remote, np.full(n, bl, np.int64))
    expected = peer.expected(0).reshape(-1, bl)[order].ravel()
    assert np.array_equal(dest.view, expected)


def test_stopped_peer_is_a_timeout_and_a_resumed_one_is_read_again(reader: MooncakeEngine, peer: PeerProcess) -> None:
    dest = _Dest(reader, 4 << 20)
    session = reader.connect(peer.metadata)
    args = (np.array([dest.addr], np.int64), np.array([peer.regions[0][0]], np.int64), np.array([4 << 20], np.int64))
    reader.read_batch(session, *args)
    _stop(peer.pid)
    try:
        with pytest.raises(TransferTimeout, match="no progress"):
            reader.read_batch(session, *args)
    finally:
        os.kill(peer.pid, signal.SIGCONT)
    dest.view[:] = 0
    reader.read_batch(session, *args)
    assert np.array_equal(dest.view, peer.expected(0)[: 4 << 20])


def test_connect_to_a_dead_peer_is_peer_gone(reader: MooncakeEngine, peer: PeerProcess) -> None:
    peer.kill()
    with pytest.raises(PeerGoneError, match="no mooncake engine answers"):
        reader.connect(peer.metadata)


def test_declares_cuda_only_for_a_cuda_build_of_mooncake() -> None:
    """The kinds follow the wheel installed: the -non-cuda wheel (installed here) moves host
    memory only; the CUDA builds register GPU memory under its location."""
    assert MooncakeEngine.memory_kinds() == MemoryKinds()  # mooncake-transfer-engine-non-cuda here
    for names, expected in (
        ({"mooncake-transfer-engine"}, {"cuda"}),
        ({"mooncake-transfer-engine-cuda13"}, {"cuda"}),
        ({"mooncake-transfer-engine-efa"}, {"cuda"}),
        ({"mooncake-transfer-engine-non-cuda"}, set()),
        ({"mooncake-transfer-engine-npu"}, set()),
        ({"mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda"}, set()),
    ):
        assert _native.device_types(names.__contains__) == expected, names


def test_device_regions_are_refused_by_a_non_cuda_build(reader: MooncakeEngine) -> None:
    with pytest.raises(TransferError, match="host memory only") as info:
        reader.register([Region(1 << 30, 4096, kind="cuda:0")])
    assert "cuda:0 memory" in str(info.value) and "nixl" in str(info.value)


def test_a_cuda_build_registers_gpu_memory_under_its_location(
    reader: MooncakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a CUDA build, a GPU region goes to mooncake with location "cuda:N" and a host
    region with "cpu:0" (no GPU here: mooncake's own register_memory is recorded, not run)."""
    monkeypatch.setattr(_native, "device_types", lambda: frozenset({"cuda"}))
    calls: list[tuple[int, int, str]] = []

    class Recorder:
        def register_memory(self, addr: int, length: int, location: str) -> int:
            calls.append((addr, length, location))
            return 0

        def unregister_memory(self, addr: int) -> int:
            return 0

    engine = MooncakeEngine.__new__(MooncakeEngine)
    engine.__dict__.update(reader.__dict__)  # the real engine's state, with mooncake recorded
    engine._te, engine._regions, engine._native_regions, engine._bounds = Recorder(), [], {}, RegionSet()
    engine._lock, engine._closed = threading.Lock(), False
    engine.register([Region(0x7F0000000000, 8192, kind="cuda:1"), Region(0x10000, 4096), Region(0x7F0000002000, 4096, kind="cuda:1")])
    assert sorted(calls) == [(0x10000, 4096, "cpu:0"), (0x7F0000000000, 12288, "cuda:1")]


def test_merged_registrations_replace_their_parts(reader: MooncakeEngine) -> None:
    mem = mmap.mmap(-1, 3 * 4096)
    base = np.frombuffer(mem, dtype=np.uint8).ctypes.data
    reader.register([Region(base, 4096)])
    reader.register([Region(base + 4096, 4096)])
    assert reader._native_regions.get(base) == (2 * 4096, "cpu:0")
    assert base + 4096 not in reader._native_regions


def test_a_range_the_peer_never_registered_is_a_transfer_error(reader: MooncakeEngine, peer: PeerProcess) -> None:
    # metadata that claims more than the peer registered passes rd2h's check; mooncake refuses
    # at once with -1 while the peer still answers: neither PeerGoneError nor TransferTimeout
    session_id, regions = _metadata.decode(peer.metadata)
    (addr, length), *rest = regions
    claimed = _metadata.encode(session_id, [(addr, length + 4096), *rest])
    dest = _Dest(reader, 4096)
    session = reader.connect(claimed)
    args = (np.array([dest.addr], np.int64), np.array([addr + length], np.int64), np.array([4096], np.int64))
    with pytest.raises(TransferError, match="rc -1") as failure:
        reader.read_batch(session, *args)
    assert type(failure.value) is TransferError
