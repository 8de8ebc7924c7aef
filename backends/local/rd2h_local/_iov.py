"""iovec arrays and the copy loop around ``process_vm_readv``.

An iovec array is an ``(n, 2)`` int64 C-contiguous numpy array: column 0 the address,
column 1 the length, which is bit for bit ``struct iovec[n]`` on 64-bit Linux (addresses
and lengths are non-negative, so int64 and the kernel's unsigned words agree; int64 also
spares a casting copy from the caller's int64 arrays). Local and
remote arrays are built side by side with equal lengths, so both advance in lockstep.
"""

from __future__ import annotations

import ctypes
import errno
import time
from array import array

import numpy as np
import numpy.typing as npt

from rd2h.errors import PeerGoneError, TransferError, TransferTimeout
from rd2h_local import _sys

__all__ = ["IovPair", "build", "split", "copy", "copy_small"]

Iov = npt.NDArray[np.int64]
_IOV_BYTES = 16

if ctypes.sizeof(ctypes.c_void_p) != 8:  # pragma: no cover - 32-bit hosts
    raise ImportError("rd2h-local needs a 64-bit platform (struct iovec is two 64-bit words)")


class IovPair:
    """Matching local and remote iovec arrays for one share of a batch."""

    __slots__ = ("local", "remote", "nbytes")

    def __init__(self, local: Iov, remote: Iov, nbytes: int | None = None) -> None:
        self.local = local
        self.remote = remote
        self.nbytes = int(local[:, 1].sum()) if nbytes is None else nbytes


def build(
    local_addrs: npt.NDArray[np.int64],
    remote_addrs: npt.NDArray[np.int64],
    lengths: npt.NDArray[np.int64],
    nbytes: int | None = None,
) -> IovPair:
    """Both iovec arrays for a batch, without a Python loop per descriptor.

    One allocation and three assignments: each numpy call costs tens of microseconds
    right after a large copy has evicted the caches, so the per-layer path keeps few.
    """
    iov = np.empty((2, len(lengths), 2), dtype=np.int64)
    iov[0, :, 0] = local_addrs
    iov[1, :, 0] = remote_addrs
    iov[:, :, 1] = lengths
    return IovPair(iov[0], iov[1], int(lengths.sum()) if nbytes is None else nbytes)


def copy_small(pid: int, local_addrs: list[int], remote_addrs: list[int], lengths: list[int], deadline: float) -> None:
    """``copy`` of a few descriptors (at most ``IOV_MAX``) given as Python ints: one call on
    iovecs built in ``array.array``s, whose addresses cost nothing (a numpy array's
    ``.ctypes`` costs ~3 us, each numpy call ~1-2 us: more than the tiny copy itself). A
    partial or failed call is done again by ``copy`` from the start (reading the same bytes
    again is harmless), which resumes, retries EINTR and names the error."""
    n = len(lengths)
    local = array("q", [v for pair in zip(local_addrs, lengths) for v in pair])
    remote = array("q", [v for pair in zip(remote_addrs, lengths) for v in pair])
    if _sys.process_vm_readv(pid, local.buffer_info()[0], n, remote.buffer_info()[0], n, 0) == sum(lengths):
        return
    as_int64 = np.asarray
    copy(pid, build(as_int64(local_addrs, np.int64), as_int64(remote_addrs, np.int64), as_int64(lengths, np.int64)), deadline)


# What one iovec costs beside its bytes, in bytes: ~0.38 us at ~11 GB/s, measured by timing
# the two shares of an SFA layer (16 KiB blocks beside 2 KiB and 64 B ones) on 2 cores. A
# split by bytes alone gave the share of small iovecs twice the time of the other.
IOV_COST_BYTES = 4096


def split(pair: IovPair, parts: int, align: int = 4096, per_iov: int = IOV_COST_BYTES) -> list[IovPair]:
    """Cut a batch into at most ``parts`` shares of nearly equal cost.

    A share's cost is its bytes plus ``per_iov`` per descriptor, so shares of many small
    descriptors get fewer bytes. A cut goes on the descriptor boundary nearest the ideal
    point when that is within 1/8 of a share (a share is then a view, nothing copied: the
    usual case of many blocks); otherwise inside a descriptor, on an ``align`` multiple of
    the byte stream (that share gets its own adjusted arrays). Shares never overlap.
    """
    lengths = pair.local[:, 1]
    ends = np.cumsum(lengths)
    total = pair.nbytes
    costs = ends + per_iov * np.arange(1, len(lengths) + 1, dtype=np.int64)  # cost up to each end
    whole = int(costs[-1])
    ideal = [whole * k // parts for k in range(1, parts)]
    nearest = costs.searchsorted(ideal).tolist()  # first boundary at or after each ideal cut
    cuts = [0]
    for k, (t, j) in enumerate(zip(ideal, nearest), 1):
        after = int(costs[j])
        before = int(costs[j - 1]) if j else 0
        cut = int(ends[j]) if after - t <= t - before else (int(ends[j - 1]) if j else 0)
        if min(after - t, t - before) * parts * 8 > whole:  # a big descriptor: cut it by bytes
            cut = total * k // parts // align * align
        if cuts[-1] < cut < total:
            cuts.append(cut)
    cuts.append(total)
    shares = []
    for a, b in zip(cuts, cuts[1:]):
        first = int(ends.searchsorted(a, side="right"))  # first descriptor ending after a
        last = int(ends.searchsorted(b, side="left"))  # descriptor holding byte b-1
        start = int(ends[first]) - int(lengths[first])
        if start == a and int(ends[last]) == b:
            shares.append(IovPair(pair.local[first : last + 1], pair.remote[first : last + 1], b - a))
            continue
        local = pair.local[first : last + 1].copy()
        remote = pair.remote[first : last + 1].copy()
        for arr in (local, remote):
            arr[0, 0] += a - start
            arr[0, 1] -= a - start
            arr[-1, 1] -= int(ends[last]) - b
        shares.append(IovPair(local, remote, b - a))
    return shares


def _failure(err: int, pid: int, pair: IovPair, i: int) -> TransferError:
    lo, ln = int(pair.local[i, 0]), int(pair.local[i, 1])
    ro = int(pair.remote[i, 0])
    if err == errno.ESRCH:
        return PeerGoneError(f"peer process {pid} is gone (process_vm_readv: ESRCH)")
    if err == errno.EPERM:
        return TransferError(
            f"not allowed to read the memory of process {pid} (process_vm_readv: EPERM). "
            "The peer must allow it: with kernel.yama.ptrace_scope=1 the Prefill's local engine "
            "grants it (prctl PR_SET_PTRACER) to the one Decode process that proved itself on its "
            "socket (ptracer='peer'); "
            "otherwise give the Decode process CAP_SYS_PTRACE or run both as the same user"
        )
    if err == errno.EFAULT:
        return TransferError(
            f"bad address: remote [{ro:#x}, +{ln}) in process {pid} or local [{lo:#x}, +{ln}) here "
            "is not mapped (process_vm_readv: EFAULT); was the memory freed after register()?"
        )
    if err == errno.ENOMEM:
        return TransferError("the kernel could not allocate memory for the copy (process_vm_readv: ENOMEM)")
    return TransferError(f"process_vm_readv from process {pid} failed: {errno.errorcode.get(err, err)} ({err})")


def copy(pid: int, pair: IovPair, deadline: float, stop: list[bool] | None = None) -> None:
    """Copy one share, IOV_MAX iovecs per call, resuming after partial transfers.

    The share's arrays are advanced in place. ``stop[0]`` set by another share aborts
    between calls. Raises ``TransferError`` (``PeerGoneError``, ``TransferTimeout``).
    """
    local, remote = pair.local, pair.remote
    lbase, rbase = local.ctypes.data, remote.ctypes.data
    n = len(local)
    i = 0
    left = pair.nbytes  # bytes not yet copied; saves a sum when the rest fits one call
    while i < n:
        k = min(_sys.IOV_MAX, n - i)
        want = left if k == n - i else int(local[i : i + k, 1].sum())
        got = _sys.process_vm_readv(pid, lbase + i * _IOV_BYTES, k, rbase + i * _IOV_BYTES, k, 0)
        if got > 0:
            left -= got
        if got == want:
            i += k
        elif got < 0:
            err = ctypes.get_errno()
            if err == errno.EINTR:
                continue
            raise _failure(err, pid, pair, i)
        elif got == 0 or got > want:
            raise TransferError(f"process_vm_readv from process {pid} returned {got} of {want} bytes at {int(remote[i, 0]):#x}")
        else:
            # Partial: skip the whole iovecs done, then the done head of the next one.
            ends = np.cumsum(local[i : i + k, 1])
            e = int(np.searchsorted(ends, got, side="right"))
            head = got - (int(ends[e - 1]) if e else 0)
            i += e
            if head:
                local[i, 0] += head
                remote[i, 0] += head
                local[i, 1] -= head
                remote[i, 1] -= head
        if i < n:
            if stop is not None and stop[0]:
                return
            if time.monotonic() > deadline:
                raise TransferTimeout(f"read from process {pid} did not finish in time ({n - i} iovecs left)")
