"""Registered regions as sorted, merged numpy bounds, with a vectorized containment check.

``rd2h.layout`` has no shared region set yet; this is the local engine's own (small) one.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import numpy.typing as npt

from rd2h.interfaces import Region

__all__ = ["merge", "RegionBounds"]


def merge(regions: Iterable[Region]) -> tuple[Region, ...]:
    """Sort and merge overlapping or touching regions of one device."""
    out: list[Region] = []
    for r in sorted(regions, key=lambda r: (r.device, r.addr)):
        last = out[-1] if out else None
        if last is not None and last.device == r.device and r.addr <= last.end:
            out[-1] = Region(last.addr, max(last.end, r.end) - last.addr, last.device)
        else:
            out.append(r)
    return tuple(out)


class RegionBounds:
    """Merged host regions; answers "is each ``[addr, addr + length)`` inside one?" at once."""

    __slots__ = ("regions", "_starts", "_ends")

    def __init__(self, regions: Iterable[Region]) -> None:
        self.regions = merge(regions)
        self._starts = np.array([r.addr for r in self.regions], dtype=np.int64)
        self._ends = np.array([r.end for r in self.regions], dtype=np.int64)

    def outside(self, addrs: npt.NDArray[np.int64], lengths: npt.NDArray[np.int64]) -> npt.NDArray[np.intp]:
        """Indices of the ranges not wholly inside one region (empty when all are fine).

        Merging first means a range may span regions that touch; lengths must be > 0.
        """
        if len(self._starts) == 0:
            return np.arange(len(addrs))
        idx = np.searchsorted(self._starts, addrs, side="right") - 1
        ok = idx >= 0
        safe = np.where(ok, idx, 0)
        # ``lengths <= end - addr`` instead of ``addr + lengths <= end``: no overflow.
        ok &= lengths <= self._ends[safe] - addrs
        return np.flatnonzero(~ok)
