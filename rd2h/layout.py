"""Layer layouts, their validation, and descriptor building (pure: numpy, no I/O).

A layer is a set of tensors addressed by block id: one or more main K/V tensors, an
optional indexer tensor and an optional LIC8 scale tensor that follows the indexer's
block ids. Main and indexer block ids are independent lists.

A logical block id ``b`` of a tensor covers ``block_size_scale`` physical rows of
``block_len`` bytes: it starts at ``base_addr + b * block_len * block_size_scale``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TensorLayout", "LayerLayout"]


@dataclass(frozen=True, slots=True)
class TensorLayout:
    """Where one tensor of a layer lives and how its blocks are sized."""

    base_addr: int
    block_len: int  # bytes per physical block row
    num_blocks: int  # logical block ids 0 .. num_blocks-1 are valid
    block_size_scale: int = 1  # physical rows per logical block id

    @property
    def stride(self) -> int:
        """Bytes per logical block id."""
        return self.block_len * self.block_size_scale

    @property
    def nbytes(self) -> int:
        return self.stride * self.num_blocks


@dataclass(frozen=True, slots=True)
class LayerLayout:
    """The tensors of one layer on one side (Prefill sources or Decode destinations)."""

    main: tuple[TensorLayout, ...]
    indexer: TensorLayout | None = None
    scale: TensorLayout | None = None  # LIC8 scale: follows the indexer's block ids

    @property
    def main_slot(self) -> int:
        """The physical storage slot of the main tensors, keyed by storage address."""
        return self.main[0].base_addr

    @property
    def indexer_slot(self) -> int | None:
        """The physical storage slot of the indexer tensor, if the layer has one."""
        return None if self.indexer is None else self.indexer.base_addr
