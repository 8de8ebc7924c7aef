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

    def outside(self, addrs: npt.NDArray[np.int64], lengths: npt.NDArray[np.int64]) -> npt.NDArray[np.intp] | None:
        """Indices of the ranges not wholly inside one region, or None when all are inside.

        Merging first means a range may span regions that touch; lengths must be > 0.
        A handful of numpy operations whatever the count: this runs once per layer.
        """
        starts, ends = self._starts, self._ends
        if len(starts) == 0:
            return np.arange(len(addrs))
        # ``lengths <= end - addr`` rather than ``addr + lengths <= end``: no overflow.
        if len(starts) == 1:
            ok = (addrs >= starts[0]) & (lengths <= ends[0] - addrs)
        else:
            idx = starts.searchsorted(addrs, side="right") - 1
            ok = (idx >= 0) & (lengths <= ends[idx] - addrs)  # idx -1 reads the last end: masked
        if ok.all():
            return None
        return np.flatnonzero(~ok)
