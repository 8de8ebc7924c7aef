"""A fast yes/no over a ``RegionSet``, for the once-per-layer check.

``rd2h.layout.regions.RegionSet`` is the authority: it merges regions and, when a range is
outside, names it in the ``RegionError``. This only answers "is every range inside?"
in as few numpy calls as possible, because right after a large copy has evicted the
caches each call costs tens of microseconds. A "no" is always re-checked by
``RegionSet.check``, which raises; the two agree (property-tested).
"""

from __future__ import annotations

import bisect

import numpy as np
import numpy.typing as npt

from rd2h.layout.regions import RegionSet

__all__ = ["FastBounds"]


class FastBounds:
    """Merged ``[start, end)`` bounds of a ``RegionSet`` as two int64 arrays."""

    __slots__ = ("_starts", "_ends", "_one", "_start_list", "_end_list")

    #: up to this many ranges are checked in Python: a handful of numpy calls cost more
    SMALL = 8

    def __init__(self, regions: RegionSet) -> None:
        pairs = list(regions)
        self._starts = np.array([a for a, _ in pairs], dtype=np.int64)
        self._ends = np.array([a + n for a, n in pairs], dtype=np.int64)
        self._one = (int(self._starts[0]), int(self._ends[0])) if len(pairs) == 1 else None
        self._start_list = [a for a, _ in pairs]
        self._end_list = [a + n for a, n in pairs]

    def all_inside(self, addrs: npt.NDArray[np.int64], lengths: npt.NDArray[np.int64]) -> bool:
        """Whether every ``[addrs[i], +lengths[i])`` has ``lengths[i] > 0`` and lies in one region."""
        if len(addrs) <= self.SMALL:
            return self.few_inside(addrs.tolist(), lengths.tolist())
        return self.many_inside(addrs, lengths)

    def few_inside(self, addrs: list[int], lengths: list[int]) -> bool:
        """``all_inside`` over Python ints, for a few ranges (a tiny layer's read)."""
        starts, ends = self._start_list, self._end_list
        for addr, length in zip(addrs, lengths):
            i = bisect.bisect_right(starts, addr) - 1
            if i < 0 or length <= 0 or addr + length > ends[i]:  # Python ints: no overflow
                return False
        return True

    def many_inside(self, addrs: npt.NDArray[np.int64], lengths: npt.NDArray[np.int64]) -> bool:
        """``all_inside``, vectorized. ``lengths <= end - addr`` rather than ``addr + lengths
        <= end``: no overflow."""
        if self._one is not None:  # the common case: one registered tensor pool
            start, end = self._one
            return bool(((addrs >= start) & (lengths > 0) & (lengths <= end - addrs)).all())
        if len(self._starts) == 0:
            return False
        idx = self._starts.searchsorted(addrs, side="right") - 1
        # idx -1 (before the first region) reads the last end; the idx >= 0 term masks it.
        return bool(((idx >= 0) & (lengths > 0) & (lengths <= self._ends[idx] - addrs)).all())
