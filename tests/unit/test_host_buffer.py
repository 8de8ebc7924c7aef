"""host_buffer: private huge-page memory by default, shared memory on request."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from rd2h.tensors import host_buffer

HUGE = 2 << 20


def _vm_flags(addr: int) -> list[str]:
    """The VmFlags of the mapping that holds ``addr`` in this process."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    inside = False
    for line in lines:
        head = line.split(" ", 1)[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


def _child_writes_are_seen(buf: np.ndarray) -> bool:
    pid = os.fork()
    if pid == 0:
        buf.reshape(-1)[0] = 7
        os._exit(0)
    os.waitpid(pid, 0)
    return bool(buf.reshape(-1)[0] == 7)


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc")
def test_default_is_private_huge_page_advised_and_2mib_aligned() -> None:
    buf = host_buffer((5, HUGE // 4 + 3), np.uint32)
    assert buf.shape == (5, HUGE // 4 + 3) and buf.dtype == np.uint32 and not buf.any()
    assert buf.ctypes.data % HUGE == 0
    flags = _vm_flags(buf.ctypes.data)
    assert "sh" not in flags
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.exists() and "[never]" not in thp.read_text():
        assert "hg" in flags  # advised before the first touch, so faults take huge pages
    assert not _child_writes_are_seen(buf)


def test_shared_is_shared_with_a_forked_child() -> None:
    buf = host_buffer(HUGE, shared=True)
    assert buf.ctypes.data % 4096 == 0
    assert "sh" in _vm_flags(buf.ctypes.data)
    assert _child_writes_are_seen(buf)


def test_small_and_empty_buffers() -> None:
    small = host_buffer(10, np.uint16)
    assert small.nbytes == 20 and small.ctypes.data % 4096 == 0
    assert host_buffer(0).nbytes == 0
