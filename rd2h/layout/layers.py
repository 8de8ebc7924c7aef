"""Layer layouts and their validation (pure: no I/O).

A layer is a set of tensors addressed by block id: one or more main K/V tensors, an
optional indexer tensor and an optional LIC8 scale tensor that follows the indexer's
block ids. Main and indexer block ids are independent lists.

A logical block id ``b`` of a tensor covers ``block_size_scale`` physical rows of
``block_len`` bytes: it starts at ``base_addr + b * stride``, where the stride is
``block_len * block_size_scale`` for dense tensors and ``block_stride`` for padded ones.
A ``LayoutTag`` says what the blocks hold (dtype, per-block shape, tokens, layout name).

``validate_layer`` says whether Prefill's layout of a layer can be read into Decode's; a
mismatch fails the whole layer. Turning one layer's readiness into descriptors is
``rd2h.layout.planning``.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import numpy as np

from rd2h.errors import (
    IndexerBlockLengthMismatch,
    IndexerPresenceMismatch,
    LayoutTagMismatch,
    MainBlockLengthMismatch,
    MainTensorCountMismatch,
    ScaleLayoutMismatch,
    ScalePresenceMismatch,
)
from rd2h.layout.regions import HOST, Region, local_kind

__all__ = ["TensorLayout", "LayoutTag", "HeadSpan", "LayerLayout", "validate_layer"]

_INT64_MAX = int(np.iinfo(np.int64).max)


@dataclass(frozen=True, slots=True)
class TensorLayout:
    """Where one tensor of a layer lives and how its blocks are sized.

    Block id ``b`` moves ``block_bytes`` (``block_len * block_size_scale``) bytes from
    ``base_addr + b * stride``. ``stride`` is ``block_stride`` where given: blocks may sit
    further apart than their size (padded pages, or block-outermost views of one big
    allocation), and only the block's own bytes move. An explicit ``block_stride`` equal to
    ``block_bytes`` is stored as None, so equal memory layouts compare equal.

    Raises ``ValueError`` for a negative address or count, a non-positive block length,
    scale or stride, a stride smaller than a block (blocks would overlap), a tensor
    whose end does not fit in an int64 address, or a malformed memory ``kind`` (torch's
    ``"cpu"`` is taken for ``"host"``).
    """

    base_addr: int
    block_len: int  # bytes per physical block row
    num_blocks: int  # logical block ids 0 .. num_blocks-1 are valid
    block_size_scale: int = 1  # physical rows per logical block id
    # what memory it is: "host", "cuda:0", "npu:1", ... (rd2h.layout.regions.check_memory_kind);
    # sent to the peer (layer metadata, layout 4). Not compared: equal addresses and sizes plan
    # equal reads, and the engine, not the plan, deals with the kind.
    kind: str = field(default=HOST, compare=False)
    block_stride: int | None = None  # bytes from one block id to the next; None: dense

    def __post_init__(self) -> None:
        for name in ("base_addr", "block_len", "num_blocks", "block_size_scale"):
            object.__setattr__(self, name, operator.index(getattr(self, name)))
        if self.base_addr < 0 or self.num_blocks < 0 or self.block_len <= 0 or self.block_size_scale <= 0:
            raise ValueError(f"invalid tensor layout {self!r}")
        if self.block_stride is not None:
            stride = operator.index(self.block_stride)
            if stride < self.block_bytes:
                raise ValueError(
                    f"tensor layout {self!r}: block_stride {stride} is smaller than a block "
                    f"({self.block_bytes} bytes), so blocks would overlap"
                )
            object.__setattr__(self, "block_stride", None if stride == self.block_bytes else stride)
        if self.base_addr + self.nbytes > _INT64_MAX:
            raise ValueError(f"tensor layout {self!r} does not fit in int64 addresses")
        object.__setattr__(self, "kind", local_kind(self.kind, "tensor layout"))  # "cpu" is "host"

    @property
    def block_bytes(self) -> int:
        """Bytes one block id moves: what must match between Prefill and Decode."""
        return self.block_len * self.block_size_scale

    @property
    def stride(self) -> int:
        """Bytes from the start of one block id to the start of the next."""
        return self.block_bytes if self.block_stride is None else self.block_stride

    @property
    def dense(self) -> bool:
        """Whether consecutive block ids are adjacent in memory (a run of them is one copy)."""
        return self.block_stride is None

    @property
    def nbytes(self) -> int:
        """Bytes from the first block's start to the last block's end: the one range that
        holds every block (padding between blocks included, none after the last)."""
        if self.num_blocks == 0:
            return 0
        return self.stride * (self.num_blocks - 1) + self.block_bytes


@dataclass(frozen=True, slots=True)
class LayoutTag:
    """What a layer's blocks hold, beyond their size: two layouts with equal bytes per block
    but a different dtype or head layout must not be mixed, and bytes alone cannot tell.

    ``block_shape`` is the shape of one block (e.g. ``(kv_heads, block_size, 2 * head_size)``)
    of the layer's first main tensor; ``block_tokens`` the tokens one block holds and ``name``
    the layout's name (e.g. ``"LBHNC"``). ``block_tokens`` 0 and ``name`` "" mean not stated:
    ``validate_layer`` compares them only when both sides state them.

    Raises ``ValueError`` for a negative ``block_tokens`` or a negative dimension.
    """

    dtype: str
    block_shape: tuple[int, ...]
    block_tokens: int
    name: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_shape", tuple(operator.index(n) for n in self.block_shape))
        object.__setattr__(self, "block_tokens", operator.index(self.block_tokens))
        if self.block_tokens < 0 or any(n < 0 for n in self.block_shape):
            raise ValueError(f"invalid layout tag {self!r}")


@dataclass(frozen=True, slots=True)
class HeadSpan:
    """The KV heads ``[first, first + count)`` of a model of ``total`` KV heads that one TP
    rank's blocks hold, in this order. Raises ``ValueError`` for a span outside ``total``."""

    total: int
    first: int
    count: int

    def __post_init__(self) -> None:
        for name in ("total", "first", "count"):
            object.__setattr__(self, name, operator.index(getattr(self, name)))
        if self.count < 1 or self.first < 0 or self.end > self.total:
            raise ValueError(f"invalid head span {self!r}")

    @property
    def end(self) -> int:
        return self.first + self.count


@dataclass(frozen=True, slots=True)
class LayerLayout:
    """The tensors of one layer on one side (Prefill sources or Decode destinations).

    Raises ``ValueError`` without a main tensor, or with a scale tensor but no indexer.
    """

    main: tuple[TensorLayout, ...]
    indexer: TensorLayout | None = None
    scale: TensorLayout | None = None  # LIC8 scale: follows the indexer's block ids
    tag: LayoutTag | None = None  # what the blocks hold; None: not stated, not checked
    # which of the model's KV heads this rank's main blocks hold (a dense GQA/MHA paged cache,
    # heads outermost in a block): Decode then reads a peer of another TP size head range by
    # head range (rd2h.layout.heads). Local to this process, never on the wire.
    heads: HeadSpan | None = field(default=None, compare=False)

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
        """One region per non-empty tensor, of its memory kind, e.g. to register with an engine."""
        return tuple(Region(t.base_addr, t.nbytes, t.kind) for t in self.tensors() if t.nbytes > 0)


# --------------------------------------------------------------------------- validation


def _describe_block_bytes(t: TensorLayout) -> str:
    return f"{t.block_bytes} (block_len {t.block_len} x block_size_scale {t.block_size_scale})"


def validate_layer(layer_name: str, src: LayerLayout, dst: LayerLayout) -> None:
    """Check that Prefill's layout ``src`` can be read into Decode's layout ``dst``.

    Checks, in this order, and raises the first that fails: main tensor count
    (``MainTensorCountMismatch``), bytes per block of each main tensor
    (``MainBlockLengthMismatch``), indexer presence (``IndexerPresenceMismatch``), indexer
    bytes per block (``IndexerBlockLengthMismatch``), scale presence
    (``ScalePresenceMismatch``), scale bytes per block (``ScaleLayoutMismatch``), and, when
    both sides carry a ``LayoutTag``, each of its fields (``LayoutTagMismatch``). Bytes per
    block is ``block_len * block_size_scale``: what one block id moves. Strides may differ
    (a padded Prefill page may feed a dense Decode page). Each message names the layer, what
    differs, Prefill's value and Decode's value. Block ranges are per request and are
    checked by ``rd2h.layout.planning.build_layer_plan``.
    """
    where = f"layer {layer_name!r}"
    if len(src.main) != len(dst.main):
        raise MainTensorCountMismatch(
            f"{where}: main tensor count differs: Prefill {len(src.main)}, Decode {len(dst.main)}"
        )
    for i, (s, d) in enumerate(zip(src.main, dst.main)):
        if s.block_bytes != d.block_bytes:
            raise MainBlockLengthMismatch(
                f"{where}: main tensor {i} bytes per block differ: "
                f"Prefill {_describe_block_bytes(s)}, Decode {_describe_block_bytes(d)}"
            )
    for what, s, d, presence_error, length_error in (
        ("indexer", src.indexer, dst.indexer, IndexerPresenceMismatch, IndexerBlockLengthMismatch),
        ("LIC8 scale", src.scale, dst.scale, ScalePresenceMismatch, ScaleLayoutMismatch),
    ):
        if (s is None) != (d is None):
            raise presence_error(f"{where}: {what} presence differs: Prefill {_has(s)}, Decode {_has(d)}")
        if s is not None and d is not None and s.block_bytes != d.block_bytes:
            raise length_error(
                f"{where}: {what} bytes per block differ: "
                f"Prefill {_describe_block_bytes(s)}, Decode {_describe_block_bytes(d)}"
            )
    if src.tag is not None and dst.tag is not None:
        _validate_tags(where, src.tag, dst.tag)


# tag fields a side may leave unstated, and the value that says so
_NOT_STATED: dict[str, object] = {"block_tokens": 0, "name": ""}


def _validate_tags(where: str, src: LayoutTag, dst: LayoutTag) -> None:
    for name in ("dtype", "block_shape", "block_tokens", "name"):
        s, d = getattr(src, name), getattr(dst, name)
        if name in _NOT_STATED and _NOT_STATED[name] in (s, d):
            continue
        if s != d:
            raise LayoutTagMismatch(
                f"{where}: layout tag {name} differs: Prefill {s!r}, Decode {d!r} "
                f"(same bytes per block, different contents: refusing to mix them)"
            )


def _has(t: TensorLayout | None) -> str:
    return "absent" if t is None else "present"
