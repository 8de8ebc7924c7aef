"""Registered memory regions and vectorized range checks (pure: numpy, no I/O).

Every remote address Decode reads from and every local address it writes to must lie
inside memory that was registered for the purpose. ``RegionSet`` answers that question
for a whole layer's worth of ranges at once.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from rd2h.errors import RegionError

__all__ = ["Region", "RegionSet", "merge_by_device"]

Int64Array = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]


@dataclass(frozen=True, slots=True)
class Region:
    """One contiguous range of memory, ``[addr, addr + length)``, on ``device``."""

    addr: int
    length: int
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.addr < 0 or self.length <= 0:
            raise ValueError(f"region needs addr >= 0 and length > 0, got {self.addr:#x}+{self.length}")

    @property
    def end(self) -> int:
        return self.addr + self.length


RegionLike = Region | tuple[int, int]


class RegionSet:
    """An immutable set of memory ranges ``[addr, addr + length)``.

    Built from ``Region`` objects or ``(addr, length)`` pairs. Overlapping and adjacent
    ranges are merged, so a range is inside the set exactly when it lies inside one
    merged range; a range that straddles a gap between two ranges is outside.

    Raises ``ValueError`` for a negative address or a length that is not positive.
    """

    __slots__ = ("_starts", "_ends")

    def __init__(self, regions: Iterable[RegionLike] = ()) -> None:
        pairs: list[tuple[int, int]] = []
        for r in regions:
            addr, length = (r.addr, r.length) if isinstance(r, Region) else (int(r[0]), int(r[1]))
            if addr < 0 or length <= 0:
                raise ValueError(f"region needs addr >= 0 and length > 0, got {addr:#x}+{length}")
            if addr + length > np.iinfo(np.int64).max:
                raise ValueError(f"region {addr:#x}+{length} does not fit in int64 addresses")
            pairs.append((addr, addr + length))
        pairs.sort()
        starts: list[int] = []
        ends: list[int] = []
        for start, end in pairs:
            if ends and start <= ends[-1]:  # overlapping or adjacent: extend the last range
                ends[-1] = max(ends[-1], end)
            else:
                starts.append(start)
                ends.append(end)
        self._starts: Int64Array = np.array(starts, dtype=np.int64)
        self._ends: Int64Array = np.array(ends, dtype=np.int64)
        self._starts.flags.writeable = False
        self._ends.flags.writeable = False

    def __len__(self) -> int:
        """Number of merged ranges."""
        return len(self._starts)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        """The merged ranges as ``(addr, length)``, in address order."""
        return ((int(s), int(e - s)) for s, e in zip(self._starts, self._ends))

    def __repr__(self) -> str:
        inner = ", ".join(f"{s:#x}+{n:#x}" for s, n in self)
        return f"RegionSet([{inner}])"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RegionSet):
            return NotImplemented
        return np.array_equal(self._starts, other._starts) and np.array_equal(self._ends, other._ends)

    def __hash__(self) -> int:
        return hash((self._starts.tobytes(), self._ends.tobytes()))

    @property
    def nbytes(self) -> int:
        """Total bytes covered."""
        return int((self._ends - self._starts).sum())

    def covers(self, addr: int, length: int) -> bool:
        """Whether the single range ``[addr, addr + length)`` lies inside the set."""
        if length <= 0 or addr < 0:
            return False
        i = int(np.searchsorted(self._starts, addr, side="right")) - 1
        return i >= 0 and length <= int(self._ends[i]) - addr

    def block_intervals(
        self, base: int, stride: int, num_blocks: int, length: int | None = None
    ) -> list[tuple[int, int]]:
        """The id ranges ``[lo, hi)`` of blocks ``[base + id * stride, base + id * stride + length)``,
        ``0 <= id < num_blocks``, that lie inside the set; sorted and disjoint. ``length``
        (the bytes of one block) defaults to ``stride``: dense blocks.

        Checking ids against these is cheaper than looking up every block's address.
        """
        length = stride if length is None else length
        if num_blocks <= 0 or stride <= 0 or length <= 0:
            return []
        end = base + stride * (num_blocks - 1) + length
        first = int(np.searchsorted(self._ends, base, side="right"))  # first range ending after base
        last = int(np.searchsorted(self._starts, end, side="left"))  # ranges starting before end
        out = []
        for s, e in zip(self._starts[first:last].tolist(), self._ends[first:last].tolist()):
            lo = max(0, -((base - s) // stride))  # first block starting at or after s
            hi = min(num_blocks, (e - length - base) // stride + 1)  # blocks ending at or before e
            if lo < hi:
                out.append((lo, hi))
        return out

    def contains(self, addrs: npt.ArrayLike, lengths: npt.ArrayLike) -> BoolArray:
        """Per range, whether ``[addrs[i], addrs[i] + lengths[i])`` lies inside the set.

        ``lengths`` may be a scalar. Ranges with a length <= 0 or a negative address are
        outside. Overflow-free: the end is never computed as ``addr + length``.
        """
        a = np.asarray(addrs, dtype=np.int64)
        n = np.asarray(lengths, dtype=np.int64)
        if len(self._starts) == 0:
            return np.zeros(np.broadcast(a, n).shape, dtype=bool)
        i = np.searchsorted(self._starts, a, side="right") - 1
        found = i >= 0
        room = self._ends[np.maximum(i, 0)] - a  # bytes from addr to the end of its range
        return found & (n > 0) & (n <= room)

    def check(self, addrs: npt.ArrayLike, lengths: npt.ArrayLike, what: str) -> None:
        """Raise ``RegionError`` unless every range lies inside the set.

        The message names ``what`` (e.g. ``"remote main[0] of request 'r7'"``), the first
        offending range in hex and how many ranges are outside.
        """
        inside = self.contains(addrs, lengths)
        if inside.all():
            return
        bad = np.flatnonzero(~inside.ravel())
        a = np.broadcast_to(np.asarray(addrs, dtype=np.int64), inside.shape).ravel()
        n = np.broadcast_to(np.asarray(lengths, dtype=np.int64), inside.shape).ravel()
        first = int(bad[0])
        raise RegionError(
            f"{what}: {describe_range(int(a[first]), int(n[first]))} is outside the registered "
            f"regions ({len(bad)} of {inside.size} ranges outside)"
        )


def merge_by_device(regions: Iterable[Region]) -> list[Region]:
    """``regions`` with overlapping and adjacent ranges merged, device by device: what a
    process registers with its engine (layers that share a physical buffer share regions)."""
    by_device: dict[str, list[Region]] = {}
    for region in regions:
        by_device.setdefault(region.device, []).append(region)
    return [
        Region(addr, length, device)
        for device, group in by_device.items()
        for addr, length in RegionSet(group)
    ]


def describe_range(addr: int, length: int) -> str:
    """``[0x1000, 0x1040) (64 bytes)``: how errors name one address range."""
    if length <= 0:
        return f"range at {addr:#x} with length {length}"
    return f"range [{addr:#x}, {addr + length:#x}) ({length} bytes)"
