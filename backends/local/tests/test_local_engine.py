"""What is particular to the local engine: options, metadata, errno mapping, chunking,
partial transfers, thread split, liveness. The shared contract is in test_conformance.py."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import subprocess
import sys
import threading
import time

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rd2h.errors import ConfigError, PeerGoneError, RegionError, TransferError, TransferTimeout
from rd2h.interfaces import Capability, MemoryKinds, Region
from rd2h.layout.regions import RegionSet
from rd2h.testing.peer import PeerProcess
from rd2h_local import LocalEngine, _iov, _metadata, _sys
from rd2h_local._bounds import FastBounds

PAGE = mmap.PAGESIZE
I64 = np.int64


class Buffers:
    """A source and a destination in this process; the engine reads from itself."""

    def __init__(self, size: int, seed: int = 0) -> None:
        self.src = np.frombuffer(np.random.default_rng(seed).bytes(size), dtype=np.uint8).copy()
        self.dst = np.zeros(size, dtype=np.uint8)
        self.src_addr, self.dst_addr = self.src.ctypes.data, self.dst.ctypes.data


@pytest.fixture
def pair():
    """(engine, session, buffers): a decode engine connected to its own process."""
    buf = Buffers(4 << 20)
    engine = LocalEngine("prefill", threads=1)  # a prefill engine proves itself to its own reads
    meta = engine.register([Region(buf.src_addr, buf.src.nbytes), Region(buf.dst_addr, buf.dst.nbytes)])
    session = engine.connect(meta)
    yield engine, session, buf
    engine.close()


def arrays(buf: Buffers, descs):
    d = np.array(descs, dtype=I64).reshape(-1, 3)
    return buf.dst_addr + d[:, 0], buf.src_addr + d[:, 1], d[:, 2].copy()


def expect(buf: Buffers, descs) -> np.ndarray:
    img = np.zeros_like(buf.dst)
    for dst, src, n in descs:
        img[dst : dst + n] = buf.src[src : src + n]
    return img


def blocks(n: int, bl: int, seed: int = 0):
    ids = np.random.default_rng(seed).permutation(n)
    return [(i * bl, int(b) * bl, bl) for i, b in enumerate(ids)]


class Recorder:
    """Wraps the real syscall: records (iovec count, bytes returned) per call, and can
    cap the bytes one call moves, the way the kernel stops early (mid-iovec included)."""

    def __init__(self, real, budget: int | None = None) -> None:
        self.real, self.budget, self.calls = real, budget, []

    def __call__(self, pid, liov, lcnt, riov, rcnt, flags):
        if self.budget is None:
            got = self.real(pid, liov, lcnt, riov, rcnt, flags)
        else:
            lv = np.ctypeslib.as_array((ctypes.c_uint64 * (2 * lcnt)).from_address(liov)).reshape(-1, 2).copy()
            rv = np.ctypeslib.as_array((ctypes.c_uint64 * (2 * rcnt)).from_address(riov)).reshape(-1, 2).copy()
            ends = np.cumsum(lv[:, 1])
            keep = min(len(ends), int(np.searchsorted(ends, self.budget, side="left")) + 1)
            lv, rv = lv[:keep].copy(), rv[:keep].copy()
            excess = max(0, int(ends[keep - 1]) - self.budget)
            lv[-1, 1] -= np.uint64(excess)
            rv[-1, 1] -= np.uint64(excess)
            got = self.real(pid, lv.ctypes.data, keep, rv.ctypes.data, keep, flags)
        self.calls.append((lcnt, got))
        return got


@pytest.fixture
def recorder(monkeypatch):
    _sys._load()
    rec = Recorder(_sys.process_vm_readv)
    monkeypatch.setattr(_sys, "process_vm_readv", rec)
    return rec


def failing(err: int):
    def fake(*args):
        ctypes.set_errno(err)
        return -1

    return fake


# -- construction ---------------------------------------------------------------------------


def test_capabilities_and_availability():
    assert LocalEngine.capabilities & Capability.READ_FROM_HOST
    assert LocalEngine.capabilities & Capability.WRITE_TO_HOST
    assert not LocalEngine.capabilities & (Capability.READ_FROM_DEVICE | Capability.CROSS_HOST)
    assert LocalEngine.availability().ok


@pytest.mark.parametrize(
    "kwargs",
    [
        {"role": "prefill", "bogus": 1},
        {"role": "sideways"},
        {"role": "decode", "threads": 0},
        {"role": "decode", "threads": 1.5},
        {"role": "decode", "parallel_threshold_bytes": -1},
        {"role": "decode", "timeout": 0},
        {"role": "decode", "timeout": "1"},
        {"role": "prefill", "ptracer": "everyone"},
    ],
)
def test_bad_options_are_config_errors(kwargs):
    with pytest.raises(ConfigError):
        LocalEngine(**kwargs)


def test_unknown_option_message_lists_known_ones():
    with pytest.raises(ConfigError, match="bogus.*known: threads"):
        LocalEngine("decode", bogus=1)


def test_loaded_by_name_through_plugins():
    from rd2h.plugins import load_engine

    with load_engine("local", "decode", threads=3) as engine:
        assert isinstance(engine, LocalEngine) and engine.threads == 3


# -- registration and metadata --------------------------------------------------------------


def test_register_merges_and_metadata_covers_everything_so_far():
    with LocalEngine("decode") as engine:
        engine.register([Region(0x10000, 0x1000)])
        meta = engine.register([Region(0x11000, 0x1000), Region(0x20000, 0x100)])
        info = _metadata.decode(meta)
        assert info.regions == (Region(0x10000, 0x2000), Region(0x20000, 0x100))
        assert info.pid == os.getpid() and info.boot_id == _sys.boot_id()
        assert engine.session_id == f"local:{_sys.hostname()}:{os.getpid()}"


def test_declares_host_memory_only():
    assert LocalEngine.memory_kinds() == MemoryKinds(frozenset({"host"}), frozenset({"host"}))


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_device_memory_is_refused_naming_the_kind_and_engines_that_can(role):
    """The refusal comes from the capability check: it names the kind, what the engine
    moves and the installed engines whose memory_kinds() take it (nixl reads CUDA memory)."""
    with LocalEngine(role) as engine, pytest.raises(TransferError) as info:
        engine.register([Region(0x10000, 4096), Region(0x7F0000000000, 4096, kind="cuda:0")])
    text = str(info.value)
    assert "0x7f0000000000" in text and "cuda:0 memory" in text and "host memory only" in text
    assert "installed engines that can: nixl" in text
    with LocalEngine(role) as engine, pytest.raises(TransferError, match="no installed engine can"):
        engine.register([Region(0x10000, 4096, kind="rd2hfake:0")])


def test_prefill_never_opens_itself_to_any_process(monkeypatch):
    """Issue 9: the Prefill engine called prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY) in
    register(), opening itself to every same-user process under Yama. Now it grants nothing
    until a reader proves itself, and then that reader's pid only (test_proof.py)."""
    calls = []
    monkeypatch.setattr(_sys, "ptrace_scope", lambda: 1)
    monkeypatch.setattr(_sys, "set_ptracer", lambda pid: calls.append(pid) or True)
    with LocalEngine("decode") as d:
        d.register([Region(0x10000, 4096)])
    with LocalEngine("prefill") as p:
        p.register([Region(0x10000, 4096)])
        p.register([Region(0x20000, 4096)])
    assert calls == []
    with LocalEngine("prefill", ptracer="any") as p:  # the old behaviour, opted into by name
        p.register([Region(0x10000, 4096)])
    assert calls == [_sys.PTRACER_ANY]


def test_ptrace_scope_reads_yama(monkeypatch):
    seen = {}
    monkeypatch.setattr(_sys, "_read", lambda path: seen.setdefault(path, "1"))
    assert _sys.ptrace_scope() == 1
    assert "/proc/sys/kernel/yama/ptrace_scope" in seen
    monkeypatch.setattr(_sys, "_read", lambda path: None)
    assert _sys.ptrace_scope() is None


def _info(**changes):
    base = dict(
        boot_id=_sys.boot_id(), hostname="h", pid_namespace=_sys.pid_namespace(), pid=os.getpid(),
        start_time=_sys.start_time(os.getpid()), regions=(Region(4096, 4096),), proof_socket="",
    )  # fmt: skip
    return _metadata.encode(_metadata.PeerInfo(**{**base, **changes}))


def test_other_host_is_refused_with_advice():
    with LocalEngine("decode") as engine, pytest.raises(TransferError, match="same-host only.*cross-host"):
        engine.connect(_info(boot_id="00000000-0000-0000-0000-000000000000", hostname="elsewhere"))


def test_other_pid_namespace_is_refused():
    with LocalEngine("decode") as engine, pytest.raises(TransferError, match="pid namespace"):
        engine.connect(_info(pid_namespace=(_sys.pid_namespace() or 0) + 1))


def test_missing_process_is_peer_gone():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    with LocalEngine("decode") as engine, pytest.raises(PeerGoneError, match="not running"):
        engine.connect(_info(pid=child.pid, start_time=None))


def test_reused_pid_is_peer_gone():
    with LocalEngine("decode") as engine, pytest.raises(PeerGoneError):
        engine.connect(_info(start_time=_sys.start_time(os.getpid()) + 1))


@pytest.mark.parametrize(
    "blob, field",
    [
        (b"", "not msgpack"),
        (msgpack.packb({"a": 1}), "array"),
        (msgpack.packb([b"other", 1, "", "", None, 1, None, [], "", b""]), "not produced by the local engine"),
        (msgpack.packb([b"rd2h-local", 99, "", "", None, 1, None, [], "", b""]), "version 99"),
        (msgpack.packb([b"rd2h-local", 1, "b", "h", None, -1, None, [], "", b""]), "pid"),
        (msgpack.packb([b"rd2h-local", 1, "b", "h", None, 0, None, [], "", b""]), "pid must be positive"),
        (msgpack.packb([b"rd2h-local", 1, "b", "h", None, 5, None, [[1]], "", b""]), "region 0"),
        (msgpack.packb([b"rd2h-local", 1, "b", "h", None, 5, None, [[1, 0]], "", b""]), "region 0"),
        (msgpack.packb([b"rd2h-local", 1, "b", "h", None, 5, None, [[2**63 - 2, 2]], "", b""]), "region 0"),
    ],
)
def test_malformed_metadata_names_the_field(blob, field):
    with pytest.raises(TransferError, match=field):
        _metadata.decode(blob)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_decode_or_raise_transfer_error(blob):
    try:
        _metadata.decode(blob)
    except TransferError:
        pass


@settings(max_examples=300)
@given(
    st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(1, 1 << 12)), max_size=6),
    st.lists(st.tuples(st.integers(-(1 << 12), 1 << 21), st.integers(-2, 1 << 13)), min_size=1, max_size=20),
)
def test_fast_bounds_agree_with_region_set(regions, ranges):
    """The per-layer fast check and rd2h's RegionSet accept exactly the same batches."""
    rs = RegionSet(regions)
    addrs = np.array([a for a, _ in ranges], dtype=I64)
    lens = np.array([n for _, n in ranges], dtype=I64)
    fast, want = FastBounds(rs), bool(rs.contains(addrs, lens).all())
    assert fast.all_inside(addrs, lens) == want
    assert fast.few_inside(addrs.tolist(), lens.tolist()) == want  # both paths, whatever the size
    assert fast.many_inside(addrs, lens) == want


# -- the copy loop ----------------------------------------------------------------------------


def test_batches_above_iov_max_are_chunked(pair, recorder):
    engine, session, buf = pair
    descs = blocks(2500, 1024)
    engine.read_batch(session, *arrays(buf, descs))
    assert [c for c, _ in recorder.calls] == [1024, 1024, 452]
    assert np.array_equal(buf.dst, expect(buf, descs))


@pytest.mark.parametrize("budget", [4096 * 3, 7777, 999, 65536 + 3])
def test_partial_transfers_resume_mid_iovec(pair, recorder, budget):
    engine, session, buf = pair
    recorder.budget = budget
    descs = blocks(64, 4096, seed=3) + [(64 * 4096 + 5, 1_000_001, 3333)]
    engine.read_batch(session, *arrays(buf, descs))
    assert np.array_equal(buf.dst, expect(buf, descs))
    total = 64 * 4096 + 3333
    assert sum(got for _, got in recorder.calls) == total
    assert len(recorder.calls) == -(-total // budget)  # every call moved exactly its budget


def test_real_partial_transfer_then_efault_names_the_range(recorder):
    """The kernel itself stops part-way when a registered page is no longer readable."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    src = mmap.mmap(-1, 3 * PAGE)
    src.write(b"\x07" * (3 * PAGE))
    src_addr = ctypes.addressof(ctypes.c_char.from_buffer(src))
    dst = np.zeros(3 * PAGE, dtype=np.uint8)
    with LocalEngine("prefill", threads=1) as engine:
        session = engine.connect(engine.register([Region(src_addr, 3 * PAGE), Region(dst.ctypes.data, dst.nbytes)]))
        assert libc.mprotect(src_addr + 2 * PAGE, PAGE, 0) == 0  # PROT_NONE
        try:
            with pytest.raises(TransferError, match=f"remote \\[{src_addr + 2 * PAGE:#x}, \\+{PAGE}\\)"):
                engine.read_batch(session, np.array([dst.ctypes.data], I64), np.array([src_addr], I64), np.array([3 * PAGE], I64))
        finally:
            libc.mprotect(src_addr + 2 * PAGE, PAGE, 3)
    assert recorder.calls[-2] == (1, 2 * PAGE) and recorder.calls[-1] == (1, -1)
    assert (dst[: 2 * PAGE] == 7).all()
    del session
    src.close()


def test_eperm_explains_the_fix(pair, monkeypatch):
    engine, session, buf = pair
    monkeypatch.setattr(_sys, "process_vm_readv", failing(errno.EPERM))
    with pytest.raises(TransferError) as info:
        engine.read_batch(session, *arrays(buf, [(0, 0, 64)]))
    for hint in ("EPERM", "PR_SET_PTRACER", "CAP_SYS_PTRACE", "ptrace_scope"):
        assert hint in str(info.value)
    assert not isinstance(info.value, PeerGoneError)


def test_eperm_shows_at_connect(monkeypatch):
    buf = Buffers(PAGE)
    with LocalEngine("prefill") as engine:
        meta = engine.register([Region(buf.src_addr, PAGE)])
        monkeypatch.setattr(_sys, "process_vm_readv", failing(errno.EPERM))
        with pytest.raises(TransferError, match="PR_SET_PTRACER"):
            engine.connect(meta)


def test_esrch_is_peer_gone(pair, monkeypatch):
    engine, session, buf = pair
    monkeypatch.setattr(_sys, "process_vm_readv", failing(errno.ESRCH))
    with pytest.raises(PeerGoneError):
        engine.read_batch(session, *arrays(buf, [(0, 0, 64)]))


def test_other_errno_is_named(pair, monkeypatch):
    engine, session, buf = pair
    monkeypatch.setattr(_sys, "process_vm_readv", failing(errno.ENOMEM))
    with pytest.raises(TransferError, match="ENOMEM"):
        engine.read_batch(session, *arrays(buf, [(0, 0, 64)]))


def test_no_progress_is_an_error_not_a_spin(pair, monkeypatch):
    engine, session, buf = pair
    monkeypatch.setattr(_sys, "process_vm_readv", lambda *a: 0)
    with pytest.raises(TransferError, match="returned 0 of 64"):
        engine.read_batch(session, *arrays(buf, [(0, 0, 64)]))


def test_slow_copy_times_out(pair, monkeypatch):
    engine, session, buf = pair
    engine.timeout = 0.2
    rec = Recorder(_sys.process_vm_readv, budget=64)
    monkeypatch.setattr(_sys, "process_vm_readv", lambda *a: (time.sleep(0.05), rec(*a))[1])
    start = time.monotonic()
    with pytest.raises(TransferTimeout):
        engine.read_batch(session, *arrays(buf, [(0, 0, 1 << 20)]))
    assert time.monotonic() - start < 1.0


def test_peer_that_dies_during_the_read_fails_it(monkeypatch):
    with PeerProcess("local", sizes=[1 << 20], seed=5) as peer, LocalEngine("decode") as engine:
        dst = np.zeros(1 << 20, dtype=np.uint8)
        engine.register([Region(dst.ctypes.data, dst.nbytes)])
        session = engine.connect(peer.metadata)
        args = (np.array([dst.ctypes.data], I64), np.array([peer.regions[0][0]], I64), np.array([1 << 20], I64))
        engine.read_batch(session, *args)
        assert np.array_equal(dst, peer.expected(0))
        real = _sys.process_vm_readv

        def read_then_kill(*a):
            got = real(*a)
            peer.kill()  # the bytes arrived, but from a process that is now gone
            return got

        monkeypatch.setattr(_sys, "process_vm_readv", read_then_kill)
        with pytest.raises(PeerGoneError, match="exited during the read"):
            engine.read_batch(session, *args)


# -- argument and region checks ------------------------------------------------------------


def test_regions_are_checked_before_any_byte_moves(pair, recorder):
    engine, session, buf = pair
    descs = [(0, 0, 4096), (4096, buf.src.nbytes - 10, 20)]
    with pytest.raises(RegionError, match="remote range from local:.* is outside the registered regions"):
        engine.read_batch(session, *arrays(buf, descs))
    with pytest.raises(RegionError, match="local destination: range"):
        engine.read_batch(session, *arrays(buf, [(buf.dst.nbytes - 10, 0, 20)]))
    assert recorder.calls == [] and not buf.dst.any()


@pytest.mark.parametrize(
    "mangle, match",
    [
        (lambda l, r, n: (l.astype(np.int32), r, n), "local_addrs must be a 1-d numpy int64"),
        (lambda l, r, n: (l, list(r), n), "remote_addrs must be a 1-d numpy int64 array, got list"),
        (lambda l, r, n: (l, r, n.reshape(1, -1)), "lengths must be"),
        (lambda l, r, n: (l[:1], r, n), "differ in length"),
        (lambda l, r, n: (l, r, n * 0), "must be > 0"),
    ],
)
def test_bad_arrays(pair, mangle, match):
    engine, session, buf = pair
    with pytest.raises(TransferError, match=match):
        engine.read_batch(session, *mangle(*arrays(buf, [(0, 0, 64), (64, 64, 64)])))


def test_foreign_and_closed_sessions(pair):
    engine, session, buf = pair

    class Other(type(session).__mro__[1]):  # a Session of another engine
        peer_id = "x"
        peer_regions = ()

    with pytest.raises(TransferError, match="not a local-engine session"):
        engine.read_batch(Other(), *arrays(buf, [(0, 0, 64)]))
    session.close()
    session.close()
    with pytest.raises(PeerGoneError, match="closed"):
        engine.read_batch(session, *arrays(buf, [(0, 0, 64)]))


# -- threads ----------------------------------------------------------------------------------


@given(st.lists(st.integers(1, 100_000), min_size=1, max_size=50), st.integers(1, 8), st.sampled_from([1, 4096]))
def test_split_partitions_the_byte_stream(lengths, parts, align):
    n = np.array(lengths, dtype=I64)
    starts = np.concatenate([[0], np.cumsum(n)[:-1]])
    whole = _iov.build(starts + (1 << 30), starts + (1 << 40), n)
    shares = _iov.split(whole, parts, align)
    assert 1 <= len(shares) <= parts
    covered = []
    for s in shares:
        assert np.array_equal(s.local[:, 0] - (1 << 30), s.remote[:, 0] - (1 << 40))
        assert (s.local[:, 1] > 0).all() and np.array_equal(s.local[:, 1], s.remote[:, 1])
        covered += [(int(a) - (1 << 30), int(m)) for a, m in s.local]
    pos = 0
    for a, m in covered:  # in order, no gap, no overlap
        assert a == pos
        pos += m
    assert pos == int(n.sum())


def test_split_balances_cost_not_bytes():
    """An SFA layer: 16 KiB main blocks, then 2 KiB and 64 B ones. Each iovec costs about
    IOV_COST_BYTES beside its bytes, so the share of small iovecs gets fewer bytes."""
    n = np.array([16384] * 400 + [2048] * 800 + [64] * 400, dtype=I64)
    starts = np.concatenate([[0], np.cumsum(n)[:-1]])
    first, second = _iov.split(_iov.build(starts, starts, n), 2)
    cost = [s.nbytes + _iov.IOV_COST_BYTES * len(s.local) for s in (first, second)]
    assert first.nbytes > second.nbytes + (1 << 20)
    assert abs(cost[0] - cost[1]) * 16 < sum(cost)
    by_bytes = _iov.split(_iov.build(starts, starts, n), 2, per_iov=0)
    assert abs(by_bytes[0].nbytes - by_bytes[1].nbytes) <= 16384


def test_big_batches_use_the_pool_and_close_joins_it(recorder):
    buf = Buffers(8 << 20, seed=9)
    before = set(threading.enumerate())  # engines of other tests may still have pools alive
    engine = LocalEngine("prefill", threads=3, parallel_threshold_bytes=1 << 20)
    session = engine.connect(engine.register([Region(buf.src_addr, buf.src.nbytes), Region(buf.dst_addr, buf.dst.nbytes)]))
    descs = blocks(128, 64 << 10, seed=1)
    recorder.calls.clear()  # drop connect's one-byte probe
    engine.read_batch(session, *arrays(buf, descs))
    assert np.array_equal(buf.dst, expect(buf, descs))
    assert len(recorder.calls) == 3  # one share per thread, caller included
    small = [(0, 0, 4096)]
    recorder.calls.clear()
    engine.read_batch(session, *arrays(buf, small))
    assert len(recorder.calls) == 1
    workers = [t for t in set(threading.enumerate()) - before if t.name.startswith("rd2h-local")]
    assert 1 <= len(workers) <= 2  # the pool starts a second thread only if the first is still busy
    engine.close()
    engine.close()
    assert not any(t.is_alive() for t in workers)
    with pytest.raises(TransferError, match="closed"):
        engine.read_batch(session, *arrays(buf, small))


def test_failure_in_one_share_stops_the_others_and_is_raised(monkeypatch):
    buf = Buffers(8 << 20, seed=2)
    real = (_sys._load(), _sys.process_vm_readv)[1]
    second = buf.src_addr + (4 << 20)

    def fail_second_half(pid, liov, lcnt, riov, rcnt, flags):
        first_remote = ctypes.c_uint64.from_address(riov).value
        if first_remote >= second:
            ctypes.set_errno(errno.EFAULT)
            return -1
        return real(pid, liov, lcnt, riov, rcnt, flags)

    monkeypatch.setattr(_sys, "process_vm_readv", fail_second_half)
    with LocalEngine("prefill", threads=2, parallel_threshold_bytes=0) as engine:
        session = engine.connect(engine.register([Region(buf.src_addr, buf.src.nbytes), Region(buf.dst_addr, buf.dst.nbytes)]))
        with pytest.raises(TransferError, match="EFAULT"):
            engine.read_batch(session, *arrays(buf, [(0, 0, 8 << 20)]))


def test_a_live_peer_behind_a_high_fd_is_alive():
    """Issue 9 D4: the pidfd check used select(), which refuses fds >= 1024; the refusal was
    taken for "peer exited", so every read from a Prefill that connected after Decode had
    opened ~1,000 fds failed while the peer was alive."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1100:
        pytest.fail(f"RLIMIT_NOFILE hard limit {hard} is too low to open fd 1024 here")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1100), hard))
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    fillers = []
    try:
        while True:  # push the next fd the kernel hands out above 1023
            fd = os.open(os.devnull, os.O_RDONLY)
            fillers.append(fd)
            if fd >= 1024:
                break
        handle = _sys.ProcessHandle(child.pid, _sys.start_time(child.pid))
        try:
            assert handle._fd is not None and handle._fd >= 1024
            assert handle.exited() is False
            child.stdin.close()
            child.wait(10)
            assert handle.exited() is True
        finally:
            handle.close()
    finally:
        for fd in fillers:
            os.close(fd)
        if child.poll() is None:
            child.kill()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
