"""Layer layouts and their validation (pure: no I/O).

A layer is a set of tensors addressed by block id: one or more main K/V tensors, an
optional indexer tensor and an optional LIC8 scale tensor that follows the indexer's
block ids. Main and indexer block ids are independent lists.

A logical block id ``b`` of a tensor covers ``block_size_scale`` physical rows of
``block_len`` bytes: it starts at ``base_addr + b * block_len * block_size_scale``.

``validate_layer`` says whether Prefill's layout of a layer can be read into Decode's; a
mismatch fails the whole layer. Turning one layer's readiness into descriptors is
``rd2h.planning``.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import numpy as np

from rd2h.errors import (
    IndexerBlockLengthMismatch,
    IndexerPresenceMismatch,
    MainBlockLengthMismatch,
    MainTensorCountMismatch,
    ScaleLayoutMismatch,
    ScalePresenceMismatch,
)
from rd2h.regions import Region

__all__ = ["TensorLayout", "LayerLayout", "validate_layer"]

_INT64_MAX = int(np.iinfo(np.int64).max)


@dataclass(frozen=True, slots=True)
class TensorLayout:
    """Where one tensor of a layer lives and how its blocks are sized.

    Raises ``ValueError`` for a negative address or count, a non-positive block length
    or scale, or a tensor whose end does not fit in an int64 address.
    """

    base_addr: int
    block_len: int  # bytes per physical block row
    num_blocks: int  # logical block ids 0 .. num_blocks-1 are valid
    block_size_scale: int = 1  # physical rows per logical block id
    # where the memory is ("cpu", "cuda", "npu"); local to this process, never on the wire
    device: str = field(default="cpu", compare=False)

    def __post_init__(self) -> None:
        for name in ("base_addr", "block_len", "num_blocks", "block_size_scale"):
            object.__setattr__(self, name, operator.index(getattr(self, name)))
        if self.base_addr < 0 or self.num_blocks < 0 or self.block_len <= 0 or self.block_size_scale <= 0:
            raise ValueError(f"invalid tensor layout {self!r}")
        if self.base_addr + self.nbytes > _INT64_MAX:
            raise ValueError(f"tensor layout {self!r} does not fit in int64 addresses")

    @property
    def stride(self) -> int:
        """Bytes per logical block id."""
        return self.block_len * self.block_size_scale

    @property
    def nbytes(self) -> int:
        return self.stride * self.num_blocks


@dataclass(frozen=True, slots=True)
class LayerLayout:
    """The tensors of one layer on one side (Prefill sources or Decode destinations).

    Raises ``ValueError`` without a main tensor, or with a scale tensor but no indexer.
    """

    main: tuple[TensorLayout, ...]
    indexer: TensorLayout | None = None
    scale: TensorLayout | None = None  # LIC8 scale: follows the indexer's block ids

    def __post_init__(self) -> None:
        object.__setattr__(self, "main", tuple(self.main))
        if not self.main:
            raise ValueError("a layer layout needs at least one main tensor")
        if self.scale is not None and self.indexer is None:
            raise ValueError("a LIC8 scale tensor follows the indexer; this layout has no indexer")

    @property
    def main_slot(self) -> int:
        """The physical storage slot of the main tensors, keyed by storage address."""
        return self.main[0].base_addr

    @property
    def indexer_slot(self) -> int | None:
        """The physical storage slot of the indexer tensor, if the layer has one."""
        return None if self.indexer is None else self.indexer.base_addr

    def named_tensors(self) -> tuple[tuple[str, TensorLayout], ...]:
        """``(name, tensor)`` in plan order: ``main[0]``, ``main[1]``, ..., ``indexer``, ``scale``."""
        named = [(f"main[{i}]", t) for i, t in enumerate(self.main)]
        if self.indexer is not None:
            named.append(("indexer", self.indexer))
        if self.scale is not None:
            named.append(("scale", self.scale))
        return tuple(named)

    def tensors(self) -> tuple[TensorLayout, ...]:
        """The tensors in plan order: main tensors, then indexer, then scale."""
        return tuple(t for _, t in self.named_tensors())

    def regions(self) -> tuple[Region, ...]:
        """One region per non-empty tensor, on its device, e.g. to register with an engine."""
        return tuple(Region(t.base_addr, t.nbytes, t.device) for t in self.tensors() if t.nbytes > 0)


# --------------------------------------------------------------------------- validation


def _describe_stride(t: TensorLayout) -> str:
    return f"{t.stride} (block_len {t.block_len} x block_size_scale {t.block_size_scale})"


def validate_layer(layer_name: str, src: LayerLayout, dst: LayerLayout) -> None:
    """Check that Prefill's layout ``src`` can be read into Decode's layout ``dst``.

    Checks, in this order, and raises the first that fails: main tensor count
    (``MainTensorCountMismatch``), bytes per block of each main tensor
    (``MainBlockLengthMismatch``), indexer presence (``IndexerPresenceMismatch``), indexer
    bytes per block (``IndexerBlockLengthMismatch``), scale presence
    (``ScalePresenceMismatch``), scale bytes per block (``ScaleLayoutMismatch``). Bytes
    per block is ``block_len * block_size_scale``: what one block id moves. Each message
    names the layer, what differs, Prefill's value and Decode's value. Block ranges are
    per request and are checked by ``build_layer_plan``.
    """
    where = f"layer {layer_name!r}"
    if len(src.main) != len(dst.main):
        raise MainTensorCountMismatch(
            f"{where}: main tensor count differs: Prefill {len(src.main)}, Decode {len(dst.main)}"
        )
    for i, (s, d) in enumerate(zip(src.main, dst.main)):
        if s.stride != d.stride:
            raise MainBlockLengthMismatch(
                f"{where}: main tensor {i} bytes per block differ: "
                f"Prefill {_describe_stride(s)}, Decode {_describe_stride(d)}"
            )
    for what, s, d, presence_error, length_error in (
        ("indexer", src.indexer, dst.indexer, IndexerPresenceMismatch, IndexerBlockLengthMismatch),
        ("LIC8 scale", src.scale, dst.scale, ScalePresenceMismatch, ScaleLayoutMismatch),
    ):
        if (s is None) != (d is None):
            raise presence_error(f"{where}: {what} presence differs: Prefill {_has(s)}, Decode {_has(d)}")
        if s is not None and d is not None and s.stride != d.stride:
            raise length_error(
                f"{where}: {what} bytes per block differ: "
                f"Prefill {_describe_stride(s)}, Decode {_describe_stride(d)}"
            )


def _has(t: TensorLayout | None) -> str:
    return "absent" if t is None else "present"
