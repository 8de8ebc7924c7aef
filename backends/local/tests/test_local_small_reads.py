"""A tiny layer's read (up to FastBounds.SMALL descriptors) goes through Python ints and one
syscall on array.array iovecs (_iov.copy_small); what it reads, refuses and raises is the
general path's, and a partial or failed call is finished by that path."""

from __future__ import annotations

import ctypes
import errno

import numpy as np
import pytest
from rd2h_local import LocalEngine, _iov, _sys
from rd2h_local._bounds import FastBounds
from test_local_engine import I64, Buffers, Recorder, arrays, expect

from rd2h.errors import RegionError, TransferError
from rd2h.interfaces import Region


@pytest.fixture
def pair():
    buf = Buffers(1 << 20, seed=3)
    engine = LocalEngine("prefill", threads=2)  # a few small descriptors stay on this thread
    session = engine.connect(engine.register([Region(buf.src_addr, buf.src.nbytes), Region(buf.dst_addr, buf.dst.nbytes)]))
    yield engine, session, buf
    engine.close()


DESCS = [(0, 4096, 64), (128, 0, 16), (8192, 65536, 4000)]


def test_a_few_descriptors_are_one_syscall(pair, monkeypatch) -> None:
    engine, session, buf = pair
    rec = Recorder((_sys._load(), _sys.process_vm_readv)[1])
    monkeypatch.setattr(_sys, "process_vm_readv", rec)

    def no_numpy_iovecs(*args: object) -> None:
        raise AssertionError("a tiny read built numpy iovecs")

    monkeypatch.setattr(_iov, "build", no_numpy_iovecs)
    engine.read_batch(session, *arrays(buf, DESCS))
    assert rec.calls == [(3, 4080)]
    assert np.array_equal(buf.dst, expect(buf, DESCS))


def test_a_partial_first_call_is_finished_by_the_general_loop(pair, monkeypatch) -> None:
    engine, session, buf = pair
    rec = Recorder((_sys._load(), _sys.process_vm_readv)[1], budget=100)  # the kernel stops mid-iovec
    monkeypatch.setattr(_sys, "process_vm_readv", rec)
    engine.read_batch(session, *arrays(buf, DESCS))
    assert np.array_equal(buf.dst, expect(buf, DESCS))
    assert rec.calls[0] == (3, 100) and len(rec.calls) > 2


def test_a_failed_call_raises_as_the_general_path_does(pair, monkeypatch) -> None:
    engine, session, buf = pair
    calls = []

    def efault(*args: object) -> int:
        calls.append(args)
        ctypes.set_errno(errno.EFAULT)
        return -1

    monkeypatch.setattr(_sys, "process_vm_readv", efault)
    with pytest.raises(TransferError, match="EFAULT"):
        engine.read_batch(session, *arrays(buf, DESCS))
    assert len(calls) == 2  # the small call, then the general loop's, which names the error


def test_a_few_descriptors_outside_the_regions_move_nothing(pair, monkeypatch) -> None:
    engine, session, buf = pair
    rec = Recorder((_sys._load(), _sys.process_vm_readv)[1])
    monkeypatch.setattr(_sys, "process_vm_readv", rec)
    local, remote, lengths = arrays(buf, DESCS)
    remote[1] = buf.src_addr + buf.src.nbytes - 8  # runs 8 bytes past the source region
    with pytest.raises(RegionError):
        engine.read_batch(session, local, remote, lengths)
    lengths[1] = 0
    remote[1] = buf.src_addr
    with pytest.raises(TransferError, match="> 0"):
        engine.read_batch(session, local, remote, lengths)
    assert rec.calls == [] and not buf.dst.any()


def test_a_few_big_descriptors_are_still_split_across_threads(monkeypatch) -> None:
    buf = Buffers(8 << 20, seed=4)
    with LocalEngine("prefill", threads=2, parallel_threshold_bytes=1 << 20) as engine:
        session = engine.connect(engine.register([Region(buf.src_addr, buf.src.nbytes), Region(buf.dst_addr, buf.dst.nbytes)]))
        shares = []
        real_split = _iov.split
        monkeypatch.setattr(_iov, "split", lambda pair, parts: shares.append(parts) or real_split(pair, parts))
        descs = [(0, 4 << 20, 4 << 20), (4 << 20, 0, 4 << 20)]
        assert len(descs) <= FastBounds.SMALL
        engine.read_batch(session, *arrays(buf, descs))
        assert shares == [2] and np.array_equal(buf.dst, expect(buf, descs))
        engine.read_batch(session, *(np.array([a], I64) for a in (buf.dst_addr, buf.src_addr, 1 << 10)))  # small: no split
        assert shares == [2]
