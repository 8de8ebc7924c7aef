"""The transfer-engine conformance suite: what every ``TransferEngine`` must do.

A backend author runs it with a few lines in the backend's tests::

    from rd2h.testing import EngineConformance

    class TestMyEngineConformance(EngineConformance):
        engine_name = "myengine"                    # the entry-point name
        engine_options = {"timeout": 5.0}           # passed to both sides

pytest then collects every ``test_*`` below for that engine. Reads cross two real
processes: the source side (``peer_role``, "prefill") runs in ``python -m
rd2h.cli.peer``, built by name through ``rd2h.plugins``; the reading side
(``reader_role``, "decode") runs in the test process. Bytes are compared exactly against
a pattern the test computes itself.

Hooks for engines that need more than options:

- ``engine_options_for(role)``: per-role options (a store URL, a device id, a port);
- ``peer_env()``: environment variables for the peer process (e.g. ``LD_LIBRARY_PATH``);
  set the test process's own environment in a conftest or an autouse class fixture;
- ``unsupported = {"feature": "why"}``: skips the tests that need an optional feature,
  each with its reason in the report. Features: ``kill_peer`` (fails cleanly when the
  peer dies), ``local_region_check`` (refuses unregistered destinations),
  ``session_close`` (a closed session refuses reads), ``concurrent_reads``;
- ``forged_metadata(genuine, other_pid)``: for an engine with ``Capability.PROVES_PEER``,
  the peer's metadata rewritten to name process ``other_pid`` (or memory the peer did not
  register), as a hostile peer would; ``connect`` must refuse each. Engines that cannot tell
  who sent metadata leave the flag out and the check is skipped with that reason;
- ``failure_bound_s``: how fast a failure must be reported (dead peer, garbage metadata);
  keep it above the engine's own call timeout;
- ``reader_role`` / ``peer_role``: which role reads ("decode") and which is read ("prefill");
- ``region_sizes``, ``destination_size``, ``block_len``: sizes of the memory used.

Memory kinds (``rd2h.testing.engine_device_cases``): every engine is checked to declare
``memory_kinds()`` and to refuse, at registration, memory of a kind it does not declare (on
any machine: host memory labelled with that kind goes through the real check). An engine
that declares a device type is read from (peer regions on the device) and written to
(destinations on the device) where torch can allocate on such a device; elsewhere those
cases skip, naming what is missing.

Services the engine needs in the test process (a config store, a daemon) belong in an
autouse class-scoped fixture of the subclass: pytest sets those up before ``reader``.

Every failure path runs in a watchdog thread, so an engine that hangs fails its test
after ``failure_bound_s`` instead of hanging the run.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, ClassVar

import msgpack
import numpy as np
import pytest

from rd2h.errors import (
    BackendUnavailableError,
    ConfigError,
    IncompatiblePeerError,
    RD2HError,
    RegionError,
    TransferError,
)
from rd2h.interfaces import Availability, Capability, Session, TransferEngine
from rd2h.layout.regions import HOST
from rd2h.testing.engine_device_cases import DeviceCases
from rd2h.testing.engine_kit import (
    SENTINEL,
    Descriptor,
    Reader,
    _arrays,
    _assert_bytes,
    _image,
    _prefer_peer_gone,
    _within,
)
from rd2h.testing.peer import PeerProcess, load_engine

__all__ = ["EngineConformance", "Reader", "Descriptor"]


class EngineConformance(DeviceCases):
    """Subclass with ``engine_name`` set (name the subclass ``Test...``); see the module doc."""

    engine_name: ClassVar[str] = ""
    engine_options: ClassVar[Mapping[str, Any]] = {}
    reader_role: ClassVar[str] = "decode"
    peer_role: ClassVar[str] = "prefill"
    region_sizes: ClassVar[tuple[int, ...]] = (4 << 20, 8 << 20, 1 << 20)
    destination_size: ClassVar[int] = 16 << 20
    block_len: ClassVar[int] = 16 << 10
    failure_bound_s: ClassVar[float] = 10.0
    startup_timeout_s: ClassVar[float] = 60.0
    skip_if_unavailable: ClassVar[bool] = True  # a BackendUnavailableError skips instead of failing
    unsupported: ClassVar[Mapping[str, str]] = {}

    pytestmark = [pytest.mark.rd2h_conformance]

    # -- hooks --------------------------------------------------------------------------

    @classmethod
    def engine_options_for(cls, role: str) -> dict[str, Any]:
        """Options for the engine of ``role``; by default ``engine_options`` for both."""
        return dict(cls.engine_options)

    @classmethod
    def peer_env(cls) -> dict[str, str]:
        """Extra environment variables for the peer process."""
        return {}

    @classmethod
    def make_engine(cls, role: str) -> TransferEngine:
        """A new engine of ``role``, built by name as an application would."""
        if not cls.engine_name:
            raise ConfigError(f"{cls.__name__} must set engine_name")
        return load_engine(cls.engine_name, role, **cls.engine_options_for(role))

    @classmethod
    def start_peer(cls, seed: int, memory: str = HOST) -> PeerProcess:
        """A peer process whose regions are in ``memory`` (a memory kind: ``"cuda:0"``)."""
        return PeerProcess(
            cls.engine_name,
            sizes=cls.region_sizes,
            seed=seed,
            role=cls.peer_role,
            options=cls.engine_options_for(cls.peer_role),
            env=cls.peer_env(),
            timeout=cls.startup_timeout_s,
            memory=memory,
        )

    def require(self, feature: str) -> None:
        if feature in self.unsupported:
            pytest.skip(f"{self.engine_name} does not support {feature}: {self.unsupported[feature]}")

    # -- fixtures -----------------------------------------------------------------------

    @pytest.fixture(scope="class")
    @classmethod
    def reader(cls) -> Iterator[Reader]:
        try:
            engine = cls.make_engine(cls.reader_role)
        except BackendUnavailableError as exc:
            if not cls.skip_if_unavailable:
                raise
            pytest.skip(f"engine {cls.engine_name!r} is unavailable here: {exc}")
        r = Reader(engine, cls.destination_size)
        yield r
        r.close()

    @pytest.fixture(scope="class")
    @classmethod
    def peer(cls, reader: Reader) -> Iterator[PeerProcess]:
        with cls.start_peer(seed=1) as p:
            yield p

    @pytest.fixture(scope="class")
    @classmethod
    def session(cls, reader: Reader, peer: PeerProcess) -> Session:
        return reader.engine.connect(peer.metadata)

    @pytest.fixture
    def fresh_peer(self, reader: Reader) -> Iterator[PeerProcess]:
        """A peer of this test's own, free to kill."""
        with self.start_peer(seed=2) as p:
            yield p

    @pytest.fixture(autouse=True)
    def _clean_destination(self, reader: Reader) -> None:
        reader.reset()

    # -- helpers ------------------------------------------------------------------------

    def blocks(self, peer: PeerProcess, count: int, seed: int, block_len: int | None = None, dest_start: int = 0) -> list[Descriptor]:
        """``count`` distinct random blocks from all regions, to shuffled destination slots."""
        bl = block_len or self.block_len
        per_region = [size // bl for size in peer.sizes]
        ids = np.random.default_rng(seed).choice(sum(per_region), size=count, replace=False)
        bounds = np.cumsum(per_region)
        slots = np.random.default_rng(seed + 1).permutation(count)
        descs = []
        for slot, gid in zip(slots, ids):
            region = int(np.searchsorted(bounds, gid, side="right"))
            block = int(gid - (bounds[region - 1] if region else 0))
            descs.append((dest_start + int(slot) * bl, region, block * bl, bl))
        return descs

    def read(self, reader: Reader, session: Session, peer: PeerProcess, descs: Sequence[Descriptor]) -> None:
        reader.engine.read_batch(session, *_arrays(reader, peer, descs))

    def check(self, reader: Reader, peer: PeerProcess, descs: Sequence[Descriptor], what: str) -> None:
        _assert_bytes(reader.dest, _image(reader, peer, descs), what)

    # -- the contract -------------------------------------------------------------------

    def test_declares_name_capabilities_availability(self, reader: Reader) -> None:
        cls = type(reader.engine)
        assert cls.name == self.engine_name
        assert isinstance(cls.capabilities, Capability)
        assert isinstance(cls.availability(), Availability)
        assert cls.availability().ok

    def test_unknown_option_is_config_error(self, reader: Reader) -> None:
        options = dict(self.engine_options_for(self.reader_role), rd2h_no_such_option=1)
        with pytest.raises(ConfigError):
            load_engine(self.engine_name, self.reader_role, **options).close()

    def test_register_returns_metadata(self, reader: Reader, peer: PeerProcess) -> None:
        assert isinstance(reader.metadata, bytes) and reader.metadata
        assert isinstance(peer.metadata, bytes) and peer.metadata

    def test_session_names_peer_and_its_regions(self, session: Session, peer: PeerProcess) -> None:
        assert session.peer_id == peer.session_id
        for addr, length in peer.regions:
            assert any(r.addr <= addr and addr + length <= r.end for r in session.peer_regions), hex(addr)

    def test_single_read(self, reader: Reader, session: Session, peer: PeerProcess) -> None:
        descs = [(4096, 1, 8192, 4096)]
        self.read(reader, session, peer, descs)
        self.check(reader, peer, descs, "single read")

    def test_batched_random_blocks(self, reader: Reader, session: Session, peer: PeerProcess) -> None:
        count = min(len(reader.dest) // self.block_len, sum(peer.sizes) // self.block_len // 2)
        for seed in (10, 11):
            reader.reset()
            descs = self.blocks(peer, count, seed)
            self.read(reader, session, peer, descs)
            self.check(reader, peer, descs, f"{count} random blocks (seed {seed})")

    def test_unaligned_ranges(self, reader: Reader, session: Session, peer: PeerProcess) -> None:
        rng = np.random.default_rng(20)
        descs, off = [], 1
        for _ in range(300):
            region = int(rng.integers(len(peer.sizes)))
            n = int(rng.integers(1, 9000))
            src = int(rng.integers(0, peer.sizes[region] - n + 1))
            descs.append((off, region, src, n))
            off += n + int(rng.integers(0, 64))
        self.read(reader, session, peer, descs)
        self.check(reader, peer, descs, "unaligned ranges")

    def test_region_edges(self, reader: Reader, session: Session, peer: PeerProcess) -> None:
        descs, off = [], 0
        for region, size in enumerate(peer.sizes):
            descs += [(off, region, 0, 512), (off + 512, region, size - 512, 512)]
            off += 1024
        self.read(reader, session, peer, descs)
        self.check(reader, peer, descs, "first and last bytes of every region")

    def test_many_descriptors(self, reader: Reader, session: Session, peer: PeerProcess) -> None:
        count = min(3000, len(reader.dest) // 1024)
        descs = self.blocks(peer, count, seed=30, block_len=1024)
        self.read(reader, session, peer, descs)
        self.check(reader, peer, descs, f"{count} descriptors of 1 KiB")

    def test_large_batch(self, reader: Reader, session: Session, peer: PeerProcess) -> None:
        bl = 64 << 10
        count = min(len(reader.dest), sum(peer.sizes) * 3 // 4) // bl
        descs = self.blocks(peer, count, seed=40, block_len=bl)
        self.read(reader, session, peer, descs)
        self.check(reader, peer, descs, f"{count} blocks of 64 KiB")

    def test_connect_legacy_reads_or_refuses_clearly(self, reader: Reader, peer: PeerProcess) -> None:
        """A legacy (reference-implementation) peer is known by its session id alone. The
        engine either reads from it with that, or refuses with IncompatiblePeerError naming
        itself; anything else would reach the peer as an unexplained failure."""
        try:
            session = reader.engine.connect_legacy(peer.session_id)
        except IncompatiblePeerError as exc:
            assert self.engine_name in str(exc), f"the refusal should name the engine: {exc}"
            return
        assert isinstance(session, Session) and session.peer_id == peer.session_id
        try:
            descs = [(0, 0, 4096, 4096), (8192, 1, 0, 512)]
            self.read(reader, session, peer, descs)
            self.check(reader, peer, descs, "read through a legacy session")
        finally:
            session.close()

    @classmethod
    def forged_metadata(cls, genuine: bytes, other_pid: int) -> Mapping[str, bytes]:
        """Forgeries of ``genuine`` (see the module doc); engines with PROVES_PEER override."""
        raise NotImplementedError(f"{cls.__name__} declares PROVES_PEER: implement forged_metadata()")

    def test_refuses_metadata_naming_another_process(self, reader: Reader, peer: PeerProcess) -> None:
        """A peer may name only its own registered memory: metadata that names another
        process (here the reader's own, the copy-Decode's-own-memory attack) or memory the
        peer did not register is refused at connect, before any byte moves."""
        if not type(reader.engine).capabilities & Capability.PROVES_PEER:
            pytest.skip(f"{self.engine_name} declares it cannot tell who produced metadata (no PROVES_PEER)")
        for what, blob in self.forged_metadata(peer.metadata, os.getpid()).items():
            exc, _ = _within(self.failure_bound_s, lambda blob=blob: reader.engine.connect(blob))
            assert isinstance(exc, TransferError), f"{what}: connect should raise TransferError, got {exc!r}"
        reader.engine.connect(peer.metadata).close()  # the genuine metadata still connects

    def test_empty_batch(self, reader: Reader, session: Session, peer: PeerProcess) -> None:
        empty = np.zeros(0, dtype=np.int64)
        reader.engine.read_batch(session, empty, empty.copy(), empty.copy())
        self.check(reader, peer, [], "empty batch")

    def test_remote_out_of_range_reads_nothing(self, reader: Reader, session: Session, peer: PeerProcess) -> None:
        size0 = peer.sizes[0]
        good = self.blocks(peer, 32, seed=50)
        cases = {
            "past a region's end": [(0, 0, size0 - 100, 200)],
            "before a region's start": [(0, 0, -16, 32)],
            "between regions": [(0, 0, size0, 16)],
            "unmapped low address": [(0, 0, -peer.regions[0][0] + 4096, 64)],
            "one bad range after good ones": good + [(len(good) * self.block_len, 1, peer.sizes[1] - 8, 16)],
        }
        for what, descs in cases.items():
            exc, _ = _within(self.failure_bound_s, lambda: self.read(reader, session, peer, descs))
            assert isinstance(exc, (RegionError, TransferError)), f"{what}: expected RegionError/TransferError, got {exc!r}"
            self.check(reader, peer, [], f"{what}: destination written")

    def test_local_out_of_range_writes_nothing(self, reader: Reader, session: Session, peer: PeerProcess) -> None:
        self.require("local_region_check")
        descs = [(0, 0, 0, 4096), (len(reader.dest) - 100, 0, 8192, 200)]
        exc, _ = _within(self.failure_bound_s, lambda: self.read(reader, session, peer, descs))
        assert isinstance(exc, (RegionError, TransferError)), f"expected RegionError/TransferError, got {exc!r}"
        self.check(reader, peer, [], "destination written")
        _assert_bytes(reader.guard, np.full(len(reader.guard), SENTINEL, np.uint8), "unregistered memory written")

    def test_bad_arrays_are_refused(self, reader: Reader, session: Session, peer: PeerProcess) -> None:
        a = np.array([reader.addr], dtype=np.int64)
        r = np.array([peer.regions[0][0]], dtype=np.int64)
        for what, args in {
            "arrays of different lengths": (a, np.repeat(r, 2), np.array([16], dtype=np.int64)),
            "zero length": (a, r, np.array([0], dtype=np.int64)),
            "negative length": (a, r, np.array([-16], dtype=np.int64)),
        }.items():
            with pytest.raises(RD2HError):
                reader.engine.read_batch(session, *args)
            self.check(reader, peer, [], f"{what}: destination written")

    @pytest.mark.parametrize(
        "blob",
        [b"", b"\x00", b"not metadata", msgpack.packb(["rd2h", 1]), bytes(range(256)) * 2, "truncated"],
        ids=["empty", "nul", "text", "other-msgpack", "binary", "truncated"],
    )
    def test_garbage_metadata_is_transfer_error(self, reader: Reader, peer: PeerProcess, blob: bytes | str) -> None:
        data = peer.metadata[: len(peer.metadata) // 2] if blob == "truncated" else blob
        exc, _ = _within(self.failure_bound_s, lambda: reader.engine.connect(data))  # type: ignore[arg-type]
        assert isinstance(exc, TransferError), f"connect(garbage) should raise TransferError, got {exc!r}"

    def test_peer_killed_before_read(self, reader: Reader, fresh_peer: PeerProcess) -> None:
        self.require("kill_peer")
        session = reader.engine.connect(fresh_peer.metadata)
        descs = [(0, 0, 0, 4096)]
        self.read(reader, session, fresh_peer, descs)
        fresh_peer.kill()
        exc, took = _within(self.failure_bound_s, lambda: self.read(reader, session, fresh_peer, descs))
        assert isinstance(exc, TransferError), f"read from a dead peer should raise TransferError, got {exc!r}"
        _prefer_peer_gone(exc, "read from a killed peer")

        def connect_and_read() -> None:
            self.read(reader, reader.engine.connect(fresh_peer.metadata), fresh_peer, descs)

        exc, _ = _within(self.failure_bound_s, connect_and_read)
        assert isinstance(exc, TransferError), f"connecting to a dead peer should fail, got {exc!r}"

    def test_peer_killed_mid_read(self, reader: Reader, fresh_peer: PeerProcess) -> None:
        self.require("kill_peer")
        session = reader.engine.connect(fresh_peer.metadata)
        descs = self.blocks(fresh_peer, min(len(reader.dest), sum(fresh_peer.sizes) // 2) // self.block_len, seed=60)
        first_done = threading.Event()
        outcome: list[object] = []

        def keep_reading() -> None:
            try:
                while True:
                    self.read(reader, session, fresh_peer, descs)
                    first_done.set()
            except BaseException as exc:  # noqa: BLE001 - handed to the test
                outcome.append((exc, time.monotonic()))
                first_done.set()

        t = threading.Thread(target=keep_reading, daemon=True, name="rd2h-conformance-reader")
        t.start()
        assert first_done.wait(self.failure_bound_s), "no read finished before the kill"
        assert not outcome, f"reads failed before the kill: {outcome}"
        fresh_peer.kill()
        killed = time.monotonic()
        t.join(self.failure_bound_s)
        assert not t.is_alive(), f"reads went on for {self.failure_bound_s} s after the peer was killed"
        exc, when = outcome[0]  # type: ignore[misc]
        assert isinstance(exc, TransferError), f"expected TransferError after the kill, got {exc!r}"
        assert when - killed < self.failure_bound_s
        _prefer_peer_gone(exc, "peer killed during reads")

    def test_concurrent_reads(self, reader: Reader, session: Session, peer: PeerProcess) -> None:
        self.require("concurrent_reads")
        workers, rounds = 4, 4
        share = len(reader.dest) // workers
        failures: list[str] = []

        def work(w: int) -> None:
            lo, hi = w * share, (w + 1) * share
            for i in range(rounds):
                descs = self.blocks(peer, share // self.block_len // 2, seed=1000 * w + i, dest_start=lo)
                try:
                    reader.dest[lo:hi] = SENTINEL
                    self.read(reader, session, peer, descs)
                    _assert_bytes(reader.dest[lo:hi], _image(reader, peer, descs, lo, hi), f"worker {w} round {i}")
                except BaseException as exc:  # noqa: BLE001 - reported below
                    failures.append(repr(exc))

        threads = [threading.Thread(target=work, args=(w,), daemon=True) for w in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.failure_bound_s * rounds)
        assert not any(t.is_alive() for t in threads), "concurrent reads hung"
        assert not failures, failures

    def test_connect_while_reading(self, reader: Reader, request: pytest.FixtureRequest) -> None:
        """``CONCURRENT_CONNECT``: a connect on one thread while another reads over an open
        session (Decode admits a new Prefill off its loop): both succeed, bytes exact."""
        if not type(reader.engine).capabilities & Capability.CONCURRENT_CONNECT:
            pytest.skip(f"{self.engine_name} does not declare CONCURRENT_CONNECT: Decode connects on its loop")
        peer: PeerProcess = request.getfixturevalue("peer")  # started only where the test runs
        session: Session = request.getfixturevalue("session")
        fresh_peer: PeerProcess = request.getfixturevalue("fresh_peer")
        half = len(reader.dest) // 2
        stop, failures, rounds = threading.Event(), [], [0]

        def read_until_stopped() -> None:
            while not stop.is_set():
                descs = self.blocks(peer, half // self.block_len // 2, seed=rounds[0], dest_start=0)
                try:
                    reader.dest[:half] = SENTINEL
                    self.read(reader, session, peer, descs)
                    _assert_bytes(reader.dest[:half], _image(reader, peer, descs, 0, half), f"round {rounds[0]}")
                except BaseException as exc:  # noqa: BLE001 - reported below
                    failures.append(repr(exc))
                    return
                rounds[0] += 1

        reading = threading.Thread(target=read_until_stopped, daemon=True)
        reading.start()
        try:
            for _ in range(3):
                second = reader.engine.connect(fresh_peer.metadata)
                descs = self.blocks(fresh_peer, 2, seed=7, dest_start=half)
                reader.dest[half:] = SENTINEL
                self.read(reader, second, fresh_peer, descs)
                _assert_bytes(reader.dest[half:], _image(reader, fresh_peer, descs, half), "the new session")
                second.close()
        finally:
            stop.set()
            reading.join(self.failure_bound_s)
        assert not reading.is_alive(), "reads hung while connecting"
        assert not failures and rounds[0] > 0, (failures, rounds)

    def test_close_is_idempotent_and_final(self, reader: Reader, peer: PeerProcess) -> None:
        other = Reader(self.make_engine(self.reader_role), 1 << 20)
        try:
            session = other.engine.connect(peer.metadata)
            self.read(other, session, peer, [(0, 0, 0, 4096)])
            _assert_bytes(other.dest[:4096], peer.expected(0)[:4096], "read before close")
            other.engine.close()
            other.engine.close()
            exc, _ = _within(self.failure_bound_s, lambda: self.read(other, session, peer, [(0, 0, 0, 4096)]))
            assert isinstance(exc, RD2HError), f"read after close should raise an RD2HError, got {exc!r}"
        finally:
            other.close()

    def test_context_manager_closes(self, reader: Reader, peer: PeerProcess) -> None:
        with self.make_engine(self.reader_role) as engine:
            other = Reader(engine, 1 << 20)
            session = engine.connect(peer.metadata)
        exc, _ = _within(self.failure_bound_s, lambda: self.read(other, session, peer, [(0, 0, 0, 4096)]))
        assert isinstance(exc, RD2HError), f"read after the with-block should raise an RD2HError, got {exc!r}"
        other.close()

    def test_closed_session_refuses_reads(self, reader: Reader, peer: PeerProcess) -> None:
        self.require("session_close")
        session = reader.engine.connect(peer.metadata)
        session.close()
        session.close()
        exc, _ = _within(self.failure_bound_s, lambda: self.read(reader, session, peer, [(0, 0, 0, 4096)]))
        assert isinstance(exc, TransferError), f"read on a closed session should raise TransferError, got {exc!r}"
        self.check(reader, peer, [], "closed session: destination written")
