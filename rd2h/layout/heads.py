"""KV heads split over tensor-parallel ranks, and reading a head range of each block (pure).

A dense GQA/MHA paged cache is rank-local: each TP rank's blocks hold only its own KV heads
(vLLM's rule, :func:`kv_heads_of`: ``total // tp`` heads per rank, or one head replicated on
``tp // total`` ranks when the model has fewer KV heads than ranks). When Prefill and Decode
run different TP sizes, a Decode rank's block is assembled from the head ranges of the
Prefill ranks that hold its heads: with ``p_tp > d_tp`` several contributors each fill a part
of every block; with ``p_tp < d_tp`` the one contributor gives a sub-range of its block. A
head a Prefill replica holds twice is read from the first contributor that holds it only.

The read is planned over *narrowed* layouts (:func:`narrow_heads`): the head range of every
block as a tensor of its own (base moved to the first head, one block the range's bytes, the
stride unchanged), so the ordinary planner (``rd2h.layout.planning``) validates, checks
regions and builds one vectorized descriptor per block. That needs a head range of a block to
be contiguous: the heads must be the outermost dimension inside a block, as in vLLM's CPU
cache ``[blocks, kv_heads, block_size, 2 * head_size]`` (LBHNC). Layouts that put the heads
inside (NHD) are refused where heads would be cut.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass

from rd2h.errors import LayoutError, TopologyError
from rd2h.layout.layers import HeadSpan, LayerLayout, LayoutTag, TensorLayout

__all__ = [
    "HeadSpan",
    "HeadSlice",
    "kv_heads_of",
    "check_heads",
    "reads_heads",
    "head_slice",
    "narrow_heads",
    "tag_heads",
    "HeadViews",
]


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool):
        raise TopologyError(f"{name} must be an integer, got {value!r}")
    try:
        n = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TopologyError(f"{name} must be an integer, got {value!r}") from None
    if n < 1:
        raise TopologyError(f"{name} must be >= 1, got {n}")
    return n


def check_heads(total: int, tp: int, side: str = "") -> None:
    """Raise ``TopologyError`` unless a model of ``total`` KV heads splits over ``tp`` ranks
    as vLLM splits it: ``total % tp == 0`` (each rank its own heads) or ``tp % total == 0``
    (each head replicated on ``tp // total`` ranks). ``side`` names the engine in the message."""
    total, tp = _positive("total KV heads", total), _positive("TP size", tp)
    if total % tp and tp % total:
        who = f"{side} " if side else ""
        raise TopologyError(
            f"a model of {total} KV heads cannot be split over {who}TP {tp}: vLLM needs the KV heads to be a "
            f"multiple of the TP size, or the TP size a multiple of the KV heads (each head then replicated)"
        )


def kv_heads_of(total: int, tp: int, rank: int) -> HeadSpan:
    """The KV heads TP rank ``rank`` of ``tp`` holds (vLLM's ``QKVParallelLinear``): ``total //
    tp`` heads from ``rank * (total // tp)`` when ``tp <= total``, else the one head
    ``rank // (tp // total)``. Raises ``TopologyError`` (see :func:`check_heads`)."""
    check_heads(total, tp)
    rank = operator.index(rank)
    if not 0 <= rank < tp:
        raise TopologyError(f"rank {rank} is out of range for TP {tp}")
    if tp <= total:
        n = total // tp
        return HeadSpan(total, rank * n, n)
    return HeadSpan(total, rank // (tp // total), 1)


def reads_heads(total: int, decode_tp: int, decode_rank: int, ratio: int, member: int) -> bool:
    """Whether contributor ``member`` of a Decode rank's ``ratio`` contributors gives any head:
    a Prefill rank that holds the same heads as the member before it (a replica) gives none,
    so no head is read twice. One contributor (equal TP or ``p_tp < d_tp``) always gives."""
    ratio, member = operator.index(ratio), operator.index(member)
    if ratio == 1 or member == 0:
        return True
    p_tp, p_rank = decode_tp * ratio, decode_rank * ratio + member
    return kv_heads_of(total, p_tp, p_rank) != kv_heads_of(total, p_tp, p_rank - 1)


@dataclass(frozen=True, slots=True)
class HeadSlice:
    """Heads ``[src_first, src_first + count)`` of a contributor's block (of ``src_heads``)
    go to heads ``[dst_first, dst_first + count)`` of Decode's block (of ``dst_heads``)."""

    src_first: int
    dst_first: int
    count: int
    src_heads: int
    dst_heads: int

    @property
    def whole(self) -> bool:
        """Whole blocks on both sides: nothing to narrow."""
        return self.count == self.src_heads == self.dst_heads


def head_slice(dst: HeadSpan, decode_tp: int, decode_rank: int, ratio: int, member: int, src_heads: int) -> HeadSlice:
    """What contributor ``member`` (of ``ratio``) gives Decode rank ``decode_rank``, whose blocks
    hold ``dst``, from its blocks of ``src_heads`` heads each.

    With several contributors, Prefill's TP is ``decode_tp * ratio``; with one, it is told by
    the contributor's head count (a rank with more heads than Decode's serves several Decode
    ranks: ``p_tp = total // src_heads``). Raises ``LayoutError`` naming both sides when the
    contributor's head count is not what that TP gives this model, or it holds none of
    Decode's heads: the two engines do not run the same model split as vLLM splits it.
    """
    total = dst.total
    src_heads = operator.index(src_heads)
    if ratio > 1:
        p_tp, p_rank = decode_tp * ratio, decode_rank * ratio + member
    elif src_heads > dst.count and total % src_heads == 0 and decode_tp % (total // src_heads) == 0:
        p_tp = total // src_heads
        p_rank = decode_rank // (decode_tp // p_tp)
    else:
        p_tp, p_rank = decode_tp, decode_rank
    try:
        src = kv_heads_of(total, p_tp, p_rank)
    except TopologyError as exc:
        raise LayoutError(f"Prefill's KV heads do not fit Decode's: {exc}") from None
    if src.count != src_heads:
        raise LayoutError(
            f"a Prefill rank's blocks hold {src_heads} KV head(s), but a model of {total} KV heads split over "
            f"Prefill TP {p_tp} (Decode TP {decode_tp}, {ratio} contributor(s) per Decode rank) puts {src.count} "
            f"on each rank: the engines do not run the same model, or not at these TP sizes"
        )
    lo, hi = max(src.first, dst.first), min(src.end, dst.end)
    if lo >= hi:
        raise LayoutError(
            f"Prefill rank {p_rank} of TP {p_tp} holds KV heads {src.first}..{src.end - 1}, none of Decode rank "
            f"{decode_rank}'s heads {dst.first}..{dst.end - 1}"
        )
    return HeadSlice(lo - src.first, lo - dst.first, hi - lo, src_heads, dst.count)


def narrow_heads(layout: LayerLayout, first: int, count: int, heads: int, side: str = "") -> LayerLayout:
    """``layout`` with every main block cut to heads ``[first, first + count)`` of its
    ``heads``: same block ids and stride, the base moved to the first head, a block the
    range's bytes (its tag's ``block_shape[0]`` becomes ``count``). The layout itself when the
    range is the whole block. Raises ``LayoutError`` for a layer with an indexer (not split by
    heads) or a block whose bytes or tag do not split into ``heads`` equal heads."""
    if first == 0 and count == heads:
        return layout
    where = f"{side} layout" if side else "layout"
    if layout.indexer is not None:
        raise LayoutError(f"{where}: a layer with an indexer is not split by KV heads")
    tag = layout.tag
    if tag is not None and (not tag.block_shape or tag.block_shape[0] != heads):
        raise LayoutError(
            f"{where}: a block of shape {tag.block_shape} does not hold its {heads} KV heads outermost, so a head "
            f"range of a block is not contiguous"
        )
    main = []
    for t in layout.main:
        if t.block_bytes % heads:
            raise LayoutError(f"{where}: a block of {t.block_bytes} bytes does not split into {heads} KV heads")
        per_head = t.block_bytes // heads
        main.append(
            TensorLayout(
                t.base_addr + first * per_head, count * per_head, t.num_blocks, 1, t.kind, block_stride=t.stride
            )
        )
    narrowed_tag = None if tag is None else dataclasses.replace(tag, block_shape=(count, *tag.block_shape[1:]))
    return dataclasses.replace(layout, main=tuple(main), tag=narrowed_tag, heads=None)


def tag_heads(tag: LayoutTag | None) -> int | None:
    """The KV heads a block holds per its tag (``block_shape[0]``), None without a tag."""
    return tag.block_shape[0] if tag is not None and tag.block_shape else None


class HeadViews:
    """The narrowed ``(src, dst)`` layouts of each layer a Decode rank reads from each peer,
    built once and kept: the step plans remember layouts by identity, so the same pair must
    come back for every step. Not thread-safe: one per loop."""

    def __init__(self, *, decode_tp: int, decode_rank: int, remembered: int = 1 << 14) -> None:
        self._tp, self._rank, self._remembered = decode_tp, decode_rank, remembered
        self._pairs: dict[tuple[int, int, int, int], tuple[LayerLayout, LayerLayout, LayerLayout, LayerLayout]] = {}

    def pair(self, src: LayerLayout, dst: LayerLayout, ratio: int, member: int) -> tuple[LayerLayout, LayerLayout]:
        """``(src, dst)`` cut to the heads contributor ``member`` (of ``ratio``) gives; unchanged
        where Decode's layout is not split by heads or both blocks are whole. Raises
        ``LayoutError`` as :func:`head_slice` and :func:`narrow_heads` do."""
        if dst.heads is None:
            return src, dst
        key = (id(src), id(dst), ratio, member)
        entry = self._pairs.get(key)
        if entry is not None and entry[0] is src and entry[1] is dst:
            return entry[2], entry[3]
        src_heads = tag_heads(src.tag)
        if src_heads is None:
            if ratio > 1:
                raise LayoutError(
                    f"Prefill's layout states no block shape, so its KV heads are unknown: {ratio} contributors "
                    f"cannot fill Decode's blocks of {dst.heads.count} KV head(s)"
                )
            narrowed = src, dst  # one contributor that says nothing: whole blocks, validate_layer judges them
        else:
            s = head_slice(dst.heads, self._tp, self._rank, ratio, member, src_heads)
            narrowed = (
                narrow_heads(src, s.src_first, s.count, s.src_heads, "Prefill"),
                narrow_heads(dst, s.dst_first, s.count, s.dst_heads, "Decode"),
            )
        if len(self._pairs) >= self._remembered:
            self._pairs.clear()  # peers come and go: start afresh now and then
        self._pairs[key] = (src, dst, *narrowed)
        return narrowed
