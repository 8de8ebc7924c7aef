"""Which destination blocks live requests hold on one Decode rank (pure: numpy, no I/O).

``expect`` refuses destinations that repeat a block, fall outside the destination tensors,
or whose written part overlaps what a live request writes: two requests writing one block
would each be reported DONE with the other's bytes in it. A cached prefix (before the first
block Prefill sends) is only read by the model, and vLLM shares it between requests. One
boolean per block and group; a request's blocks are released when it settles, once no read
can be writing them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import numpy.typing as npt

from rd2h.decode.rank_reads import Destinations
from rd2h.errors import DestinationError
from rd2h.layout.layers import LayerLayout

__all__ = ["HeldBlocks"]

Int64Array = npt.NDArray[np.int64]


class HeldBlocks:
    """The main and indexer blocks held by live requests. The block counts are the smallest
    over the layers (a destination block id must be valid in every layer)."""

    def __init__(self, layers: Mapping[str, LayerLayout]) -> None:
        main_blocks = min(t.num_blocks for layout in layers.values() for t in layout.main)
        indexers = [layout.indexer.num_blocks for layout in layers.values() if layout.indexer is not None]
        self.main = np.zeros(main_blocks, dtype=np.bool_)
        self.indexer = np.zeros(min(indexers), dtype=np.bool_) if indexers else None

    def check(self, ext_id: str, destinations: Destinations, written: Destinations,
              owner: Callable[[str, int], str]) -> None:
        """Raise DestinationError unless ``destinations`` are valid and the ``written`` part of
        them (from the first block Prefill sends: the prefix before it is a cached block that
        vLLM may share with live requests) is held by no live request; ``owner(group, block)``
        names the live request holding a block, for the message."""
        _check(ext_id, "main", destinations.main, written.main, self.main, owner)
        if self.indexer is not None:
            _check(ext_id, "indexer", destinations.indexer, written.indexer, self.indexer, owner)

    def hold(self, destinations: Destinations, held: bool = True) -> None:
        self.main[destinations.main] = held
        if self.indexer is not None:
            self.indexer[destinations.indexer] = held


def _check(
    ext_id: str, what: str, ids: Int64Array, written: Int64Array, taken: npt.NDArray[np.bool_],
    owner: Callable[[str, int], str],
) -> None:
    limit = len(taken)
    if len(ids) and (ids.min() < 0 or ids.max() >= limit):
        bad = int(ids[(ids < 0) | (ids >= limit)][0])
        raise DestinationError(f"request {ext_id!r}: {what} destination block {bad} outside 0..{limit - 1}")
    values, counts = np.unique(ids, return_counts=True)
    if len(values) != len(ids):
        raise DestinationError(f"request {ext_id!r}: {what} destination block {int(values[counts > 1][0])} given twice")
    clash = taken[written]
    if clash.any():
        block = int(written[np.argmax(clash)])
        raise DestinationError(
            f"request {ext_id!r}: {what} destination block {block} is held by live request {owner(what, block)!r}"
        )
