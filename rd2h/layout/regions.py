"""Registered memory regions and vectorized range checks (pure: numpy, no I/O).

Every remote address Decode reads from and every local address it writes to must lie
inside memory that was registered for the purpose. ``RegionSet`` answers that question
for a whole layer's worth of ranges at once.

Every region also says what memory it is, its *memory kind*: ``"host"`` for memory the CPU
addresses directly, ``"<device type>:<index>"`` for an accelerator's (``"cuda:0"``,
``"npu:3"``). Engines declare which device types they move (``"host"``, ``"cuda"``, ...);
``KindIndex`` tells, for a whole batch of addresses at once, which kind each one is.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from rd2h.errors import RegionError

__all__ = [
    "HOST", "Region", "RegionSet", "KindIndex", "check_memory_kind", "local_kind", "device_type", "device_index",
    "merge_by_kind", "merge_by_device",
]  # fmt: skip

Int64Array = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

HOST = "host"  # the memory kind (and device type) of memory the CPU addresses directly
_KIND = re.compile(r"([a-z][a-z0-9_]{0,30}):(0|[1-9][0-9]{0,4})")  # "cuda:0"; an index below 100000
_INDEX_END = 100_000


def check_memory_kind(kind: object, what: str = "memory kind") -> str:
    """``kind`` if it is a memory kind: ``"host"``, or a device type and an index
    (``"cuda:0"``, ``"npu:7"``: lowercase, at most 31 characters, index below 100000).

    Raises ``TypeError`` for a non-string and ``ValueError`` naming ``what`` for anything
    else (``"cpu"``, ``"cuda"`` without its index, ``"host:0"``, ``"CUDA:0"``, ``"cuda:01"``).
    """
    if type(kind) is not str:
        raise TypeError(f"{what}: expected a string such as 'host' or 'cuda:0', got {type(kind).__name__}")
    if kind != HOST and (_KIND.fullmatch(kind) is None or kind.startswith(HOST + ":")):
        raise ValueError(f"{what}: {kind[:40]!r} is not a memory kind ('host', or a device type and index such as 'cuda:0')")
    return kind


def local_kind(kind: object, what: str) -> str:
    """``kind`` checked as :func:`check_memory_kind` does, for objects built in this process:
    torch's ``"cpu"`` is taken for ``"host"``, and every refusal is a ``ValueError``. (The
    wire takes no such liberty: a peer's ``"cpu"`` is malformed.)"""
    if kind == "cpu":
        return HOST
    try:
        return check_memory_kind(kind, what)
    except TypeError as exc:
        raise ValueError(str(exc)) from None


def device_type(kind: str) -> str:
    """The device type of a memory kind: ``"cuda"`` for ``"cuda:1"``, ``"host"`` for ``"host"``."""
    return kind.partition(":")[0]


def device_index(kind: str) -> int:
    """The device index of a memory kind: 1 for ``"cuda:1"``, 0 for ``"host"``."""
    _, _, index = kind.partition(":")
    return int(index) if index else 0


@dataclass(frozen=True, slots=True)
class Region:
    """One contiguous range of memory, ``[addr, addr + length)``, of memory kind ``kind``
    (``"host"``, ``"cuda:0"``, ...; ``"cpu"`` is taken for ``"host"``). Raises ``ValueError``
    for a negative address, a length that is not positive or a malformed kind."""

    addr: int
    length: int
    kind: str = HOST

    def __post_init__(self) -> None:
        if self.addr < 0 or self.length <= 0:
            raise ValueError(f"region needs addr >= 0 and length > 0, got {self.addr:#x}+{self.length}")
        object.__setattr__(self, "kind", local_kind(self.kind, f"region {self.addr:#x}+{self.length}"))

    @property
    def device_type(self) -> str:
        """``"host"``, ``"cuda"``, ``"npu"``, ...: what engines declare they can move."""
        return device_type(self.kind)

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


def merge_by_kind(regions: Iterable[Region]) -> list[Region]:
    """``regions`` with overlapping and adjacent ranges merged, kind by kind: what a process
    registers with its engine (layers that share a physical buffer share regions)."""
    by_kind: dict[str, list[Region]] = {}
    for region in regions:
        by_kind.setdefault(region.kind, []).append(region)
    return [Region(addr, length, kind) for kind, group in by_kind.items() for addr, length in RegionSet(group)]


merge_by_device = merge_by_kind  # the older name, kept for callers


class KindIndex:
    """Which memory kind each of many addresses is, from regions of known kinds (pure).

    Built from ``Region`` objects: ranges of one kind are merged; ranges of different kinds
    must not overlap (one virtual address is one memory), else ``ValueError``. ``codes``
    answers for a whole array at once with an index into ``kinds`` (-1: in no region).
    """

    __slots__ = ("kinds", "_starts", "_ends", "_codes")

    def __init__(self, regions: Iterable[Region] = ()) -> None:
        merged = sorted(merge_by_kind(regions), key=lambda r: r.addr)
        self.kinds: tuple[str, ...] = tuple(dict.fromkeys(r.kind for r in merged))
        for before, after in zip(merged, merged[1:]):
            if after.addr < before.end:
                raise ValueError(
                    f"regions of two memory kinds overlap: {before.kind} {describe_range(before.addr, before.length)} "
                    f"and {after.kind} {describe_range(after.addr, after.length)}"
                )
        code = {kind: i for i, kind in enumerate(self.kinds)}
        self._starts = np.array([r.addr for r in merged], dtype=np.int64)
        self._ends = np.array([r.end for r in merged], dtype=np.int64)
        self._codes = np.array([code[r.kind] for r in merged], dtype=np.int64)

    @property
    def uniform(self) -> str | None:
        """The one kind of every region, or None for none or several."""
        return self.kinds[0] if len(self.kinds) == 1 else None

    def codes(self, addrs: npt.ArrayLike) -> Int64Array:
        """Per address, the index in ``kinds`` of the region it lies in; -1 for none."""
        a = np.asarray(addrs, dtype=np.int64)
        if not len(self._starts):
            return np.full(a.shape, -1, dtype=np.int64)
        i = np.searchsorted(self._starts, a, side="right") - 1
        j = np.maximum(i, 0)
        inside = (i >= 0) & (a < self._ends[j])
        return np.where(inside, self._codes[j], -1)

    def kind_of(self, addr: int) -> str | None:
        """The kind of the region ``addr`` lies in, None for none."""
        code = int(self.codes(np.array([addr], dtype=np.int64))[0])
        return None if code < 0 else self.kinds[code]


def describe_range(addr: int, length: int) -> str:
    """``[0x1000, 0x1040) (64 bytes)``: how errors name one address range."""
    if length <= 0:
        return f"range at {addr:#x} with length {length}"
    return f"range [{addr:#x}, {addr + length:#x}) ({length} bytes)"
