"""Descriptor planning for one layer's batched read (pure: numpy, no I/O).

Decode turns one layer's readiness into a ``LayerPlan``: ``build_layer_plan`` validates the
layer (``rd2h.layout.layers.validate_layer``; a mismatch fails the whole layer), then checks every
request's block ids and address ranges, sets aside the requests that fail, and emits
coalesced ``(local, remote, length)`` descriptors for one batched read. Everything is
vectorized: a layer can carry 10^5 blocks, and a Python step per block would dominate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from rd2h.errors import BlockRangeError, LayoutError, RegionError
from rd2h.layout.layers import LayerLayout, TensorLayout, validate_layer
from rd2h.layout.regions import RegionSet, describe_range

__all__ = [
    "RequestRead",
    "LayerPlan",
    "PlanBuilder",
    "block_addresses",
    "build_layer_plan",
]

Int64Array = npt.NDArray[np.int64]

_EMPTY_IDS: Int64Array = np.empty(0, dtype=np.int64)
_EMPTY_IDS.flags.writeable = False


def block_addresses(tensor: TensorLayout, ids: npt.ArrayLike) -> Int64Array:
    """Start address of each block id: ``base_addr + id * stride``.

    Raises ``BlockRangeError`` naming the first id outside ``[0, num_blocks)``.
    """
    a = _as_ids(ids)
    bad = a.view(np.uint64) >= tensor.num_blocks  # negative ids wrap to huge values
    if bad.any():
        first = int(a[np.argmax(bad)])
        raise BlockRangeError(f"block id {first} outside [0, {tensor.num_blocks})")
    out = a * tensor.stride
    out += tensor.base_addr
    return out


def _as_ids(ids: npt.ArrayLike) -> Int64Array:
    if type(ids) is np.ndarray and ids.dtype == np.int64 and ids.ndim == 1:
        return ids
    a = np.asarray(ids)
    if a.size == 0:
        return _EMPTY_IDS
    if a.ndim != 1:
        raise ValueError(f"block ids must be one-dimensional, got shape {a.shape}")
    if a.dtype.kind not in "iu":
        raise TypeError(f"block ids must be integers, got dtype {a.dtype}")
    return a.astype(np.int64)  # uint64 ids above int64 range wrap negative and fail the range check


@dataclass(frozen=True, slots=True, eq=False)
class RequestRead:
    """The blocks of one request that this Decode rank reads for one layer.

    ``src_*`` are Prefill block ids, ``dst_*`` the Decode block ids they go to, pairwise.
    The caller has applied the work split already. Indexer ids also address the LIC8
    scale tensor; they are ignored for a layer without an indexer. Ids are converted to
    int64 arrays (``TypeError`` for non-integer ids, ``ValueError`` for other than 1-D).
    """

    ext_req_id: str
    src_main: Int64Array
    dst_main: Int64Array
    src_indexer: Int64Array = field(default_factory=lambda: _EMPTY_IDS)
    dst_indexer: Int64Array = field(default_factory=lambda: _EMPTY_IDS)

    def __post_init__(self) -> None:
        for name in ("src_main", "dst_main", "src_indexer", "dst_indexer"):
            object.__setattr__(self, name, _as_ids(getattr(self, name)))


@dataclass(frozen=True, slots=True, eq=False)
class LayerPlan:
    """Descriptors for one batched read of one layer, and the requests left out.

    ``local[i]``, ``remote[i]`` and ``lengths[i]`` describe one contiguous copy; ``requests``
    are the request ids that are fully described (in input order, including requests with
    no blocks), ``failed`` maps each left-out request id to its error. ``blocks`` counts
    the block ids read (main plus indexer), ``nbytes`` the bytes moved. ``bounds[k]`` is
    where the descriptors of the layer's ``k``-th tensor (in ``LayerLayout.tensors()``
    order) end; the first start at 0.
    """

    local: Int64Array
    remote: Int64Array
    lengths: Int64Array
    requests: tuple[str, ...]
    failed: dict[str, LayoutError]
    blocks: int
    nbytes: int
    bounds: tuple[int, ...] = ()

    def __len__(self) -> int:
        """Number of descriptors."""
        return len(self.lengths)


class _Scratch:
    """Work and output arrays: fresh for each plan, or kept and reused between plans."""

    __slots__ = ("keep", "_bufs")

    def __init__(self, keep: bool) -> None:
        self.keep = keep
        self._bufs: dict[str, np.ndarray] = {}

    def take(self, key: str, n: int, dtype: type = np.int64) -> np.ndarray:
        if not self.keep:
            return np.empty(n, dtype=dtype)
        buf = self._bufs.get(key)
        if buf is None or buf.size < n:
            # headroom so that a slowly growing layer does not reallocate every time
            buf = self._bufs[key] = np.empty(n + n // 8, dtype=dtype)
        return buf[:n]


class _Group:
    """One id list (main or indexer) of all requests, concatenated, and the tensors it addresses."""

    def __init__(
        self,
        kind: str,
        names: list[str],
        src: list[TensorLayout],
        dst: list[TensorLayout],
        src_ids: list[Int64Array],
        dst_ids: list[Int64Array],
        ctx: _Call,
    ) -> None:
        self.kind, self.names, self.src, self.dst, self.ctx = kind, names, src, dst, ctx
        n = len(src_ids)
        counts = np.fromiter(map(len, src_ids), dtype=np.int64, count=n)
        dst_counts = np.fromiter(map(len, dst_ids), dtype=np.int64, count=n)
        for i in np.flatnonzero(counts != dst_counts).tolist():
            ctx.fail(
                i,
                BlockRangeError(
                    f"{ctx.layer}request {ctx.ext_ids[i]!r}: {counts[i]} source {kind} block ids "
                    f"but {dst_counts[i]} destination block ids"
                ),
            )
            src_ids[i] = dst_ids[i] = _EMPTY_IDS
            counts[i] = 0
        self.counts = counts
        self.offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(counts, out=self.offsets[1:])
        total = int(self.offsets[-1])
        take = ctx.scratch.take
        self.S = np.concatenate(src_ids, out=take(kind + ".S", total)) if total else _EMPTY_IDS
        self.D = np.concatenate(dst_ids, out=take(kind + ".D", total)) if total else _EMPTY_IDS
        self.src_limit = min(t.num_blocks for t in src)
        self.dst_limit = min(t.num_blocks for t in dst)

    def owners(self, positions: Int64Array) -> Int64Array:
        """The request index of each block position."""
        return np.searchsorted(self.offsets, positions, side="right") - 1

    def check_ranges(self) -> None:
        S, D, ctx = self.S, self.D, self.ctx
        # viewed unsigned, negative ids are huge: one max per side checks both bounds, and
        # a reduction allocates nothing, so the common all-good case stays cheap
        if S.size == 0 or (S.view(np.uint64).max() < self.src_limit and D.view(np.uint64).max() < self.dst_limit):
            return
        bad = S.view(np.uint64) >= self.src_limit
        bad |= D.view(np.uint64) >= self.dst_limit
        pos = np.flatnonzero(bad)
        reqs, first = np.unique(self.owners(pos), return_index=True)
        for r, p in zip(reqs.tolist(), pos[first].tolist()):
            if S[p] < 0 or S[p] >= self.src_limit:
                side, block, limit = "source (Prefill)", int(S[p]), self.src_limit
            else:
                side, block, limit = "destination (Decode)", int(D[p]), self.dst_limit
            ctx.fail(
                r,
                BlockRangeError(
                    f"{ctx.layer}request {ctx.ext_ids[r]!r}: {side} {self.kind} block id {block} "
                    f"outside [0, {limit})"
                ),
            )

    def check_regions(self, src_regions: RegionSet, dst_regions: RegionSet) -> None:
        ctx = self.ctx
        for name, s, d in zip(self.names, self.src, self.dst):
            for side, t, ids, regions in (("remote", s, self.S, src_regions), ("local", d, self.D, dst_regions)):
                intervals = regions.block_intervals(t.base_addr, t.stride, t.num_blocks, t.block_bytes)
                if intervals == [(0, t.num_blocks)] or ids.size == 0:
                    continue  # every in-range id lies inside (ids out of range failed already)
                outside = _outside(ids, intervals)
                if not outside.any():
                    continue
                pos = np.flatnonzero(outside)
                reqs, first = np.unique(self.owners(pos), return_index=True)
                for r, p in zip(reqs.tolist(), pos[first].tolist()):
                    addr = t.base_addr + int(ids[p]) * t.stride
                    ctx.fail(
                        r,
                        RegionError(
                            f"{ctx.layer}{side} {name} of request {ctx.ext_ids[r]!r}: "
                            f"{describe_range(addr, t.block_bytes)} is outside the registered regions"
                        ),
                    )

    def drop(self, keep_req: npt.NDArray[np.bool_]) -> None:
        if keep_req[self.counts > 0].all():
            return
        mask = np.repeat(keep_req, self.counts)
        self.S, self.D = self.S[mask], self.D[mask]

    def runs(self) -> tuple[Int64Array, Int64Array, Int64Array | None]:
        """Maximal runs of blocks contiguous on both sides: ``(src_start, dst_start, blocks)``.

        Within one tensor, consecutive descriptors are contiguous in memory on both sides
        exactly when both ids advance by one, so the same runs serve every tensor of the
        group. ``blocks`` is None when no two blocks merge (every run is one block).
        """
        S, D, take = self.S, self.D, self.ctx.scratch.take
        m = S.size
        if m <= 1:
            return S, D, None
        # step and break masks die here, so the groups share them
        step = take("step", m - 1)
        brk = take("brk", m, np.bool_)
        brk2 = take("brk2", m - 1, np.bool_)
        brk[0] = True
        np.subtract(S[1:], S[:-1], out=step)
        np.not_equal(step, 1, out=brk[1:])
        np.subtract(D[1:], D[:-1], out=step)
        np.not_equal(step, 1, out=brk2)
        np.logical_or(brk[1:], brk2, out=brk[1:])
        k = int(np.count_nonzero(brk))
        if k == m:
            return S, D, None
        starts = np.flatnonzero(brk)
        blocks = take(self.kind + ".run", k)
        np.subtract(starts[1:], starts[:-1], out=blocks[:-1])
        blocks[-1] = m - starts[-1]
        return (
            np.take(S, starts, out=take(self.kind + ".S0", k)),
            np.take(D, starts, out=take(self.kind + ".D0", k)),
            blocks,
        )


def _outside(ids: Int64Array, intervals: list[tuple[int, int]]) -> npt.NDArray[np.bool_]:
    """Per id, whether it falls in none of the sorted, disjoint ``[lo, hi)`` intervals."""
    if not intervals:
        return np.ones(ids.size, dtype=bool)
    if len(intervals) == 1:
        lo, hi = intervals[0]
        return (ids - lo).view(np.uint64) >= hi - lo  # below lo wraps to huge
    lo_a, hi_a = (np.array(v, dtype=np.int64) for v in zip(*intervals))
    j = np.searchsorted(lo_a, ids, side="right") - 1
    return (j < 0) | (ids >= hi_a[np.maximum(j, 0)])


class _Call:
    """What one build shares between groups: request ids, failures so far, buffers."""

    def __init__(self, ext_ids: list[str], layer: str, scratch: _Scratch) -> None:
        self.ext_ids, self.layer, self.scratch = ext_ids, layer, scratch
        self.failed: dict[int, LayoutError] = {}

    def fail(self, i: int, error: LayoutError) -> None:
        self.failed.setdefault(i, error)  # the first problem found is the one reported


class PlanBuilder:
    """Builds ``LayerPlan``s like ``build_layer_plan``, reusing its arrays between calls.

    Large fresh arrays cost page faults on first touch (several times the arithmetic
    here); a builder keeps its work and output arrays instead. The arrays of a plan it
    returns are read-only views that stay valid only until the next ``build`` call on the
    same builder: read the layer first. Not thread-safe: one builder per thread.
    """

    def __init__(self) -> None:
        self._scratch = _Scratch(keep=True)

    def build(
        self,
        src: LayerLayout,
        dst: LayerLayout,
        reads: Sequence[RequestRead],
        *,
        src_regions: RegionSet,
        dst_regions: RegionSet,
        layer_name: str = "",
    ) -> LayerPlan:
        """See ``build_layer_plan``."""
        return _build(src, dst, reads, src_regions, dst_regions, layer_name, self._scratch)


def build_layer_plan(
    src: LayerLayout,
    dst: LayerLayout,
    reads: Sequence[RequestRead],
    *,
    src_regions: RegionSet,
    dst_regions: RegionSet,
    layer_name: str = "",
) -> LayerPlan:
    """Descriptors that read every good request of one layer from Prefill into Decode.

    Runs ``validate_layer`` first and lets its ``LayoutError`` out: a layout mismatch
    fails the whole layer. Then each request is checked on its own and left out, with
    its error in ``LayerPlan.failed``, when: its source and destination id lists differ
    in length (``BlockRangeError``); an id is outside its tensor's block count on either
    side (``BlockRangeError``; indexer ids must fit the scale tensor too); a block's
    remote range is outside ``src_regions`` or its local range outside ``dst_regions``
    (``RegionError``). A request that fails contributes no descriptor; a request id that
    appears twice fails as a whole if either entry fails.

    Descriptors are in tensor-major order (main[0], main[1], ..., indexer, scale), in
    request order within a tensor, and consecutive blocks contiguous on both sides are
    merged into one descriptor (only in tensors dense on both sides: a padded tensor's
    blocks are not contiguous, so each is its own descriptor of ``block_bytes``). The plan's arrays are freshly allocated; ``PlanBuilder``
    reuses them instead.
    """
    return _build(src, dst, reads, src_regions, dst_regions, layer_name, _Scratch(keep=False))


def _build(
    src: LayerLayout,
    dst: LayerLayout,
    reads: Sequence[RequestRead],
    src_regions: RegionSet,
    dst_regions: RegionSet,
    layer_name: str,
    scratch: _Scratch,
) -> LayerPlan:
    validate_layer(layer_name, src, dst)
    n = len(reads)
    ext_ids = [r.ext_req_id for r in reads]
    ctx = _Call(ext_ids, f"layer {layer_name!r}: " if layer_name else "", scratch)
    main_names = [f"main[{i}]" for i in range(len(src.main))]
    src_main, dst_main = [r.src_main for r in reads], [r.dst_main for r in reads]
    groups = [_Group("main", main_names, list(src.main), list(dst.main), src_main, dst_main, ctx)]
    if src.indexer is not None and dst.indexer is not None:
        names, s_tensors, d_tensors = ["indexer"], [src.indexer], [dst.indexer]
        if src.scale is not None and dst.scale is not None:
            names.append("scale")
            s_tensors.append(src.scale)
            d_tensors.append(dst.scale)
        groups.append(
            _Group(
                "indexer",
                names,
                s_tensors,
                d_tensors,
                [r.src_indexer for r in reads],
                [r.dst_indexer for r in reads],
                ctx,
            )
        )
    for g in groups:
        g.check_ranges()
    for g in groups:
        g.check_regions(src_regions, dst_regions)

    failed = ctx.failed
    if failed and len(set(ext_ids)) < n:  # a duplicated id fails as a whole
        bad_ids = {ext_ids[i]: e for i, e in sorted(failed.items(), reverse=True)}
        for i, ext in enumerate(ext_ids):
            if ext in bad_ids:
                ctx.fail(i, bad_ids[ext])
    if failed:
        keep_req = np.ones(n, dtype=bool)
        keep_req[list(failed)] = False
        for g in groups:
            g.drop(keep_req)

    # A run of consecutive ids is one copy only in tensors dense on both sides; a padded
    # tensor (stride above its block's bytes) gets one descriptor per block.
    pieces: list[tuple[TensorLayout, TensorLayout, int, Int64Array, Int64Array, Int64Array | None]] = []
    for g in groups:
        pairs = list(zip(g.src, g.dst))
        s_start, d_start, run = g.runs() if any(s.dense and d.dense for s, d in pairs) else (g.S, g.D, None)
        for s, d in pairs:
            ids = (s_start, d_start, run) if s.dense and d.dense else (g.S, g.D, None)
            pieces.append((s, d, g.S.size, *ids))
    total = sum(p[3].size for p in pieces)
    local = scratch.take("local", total)
    remote = scratch.take("remote", total)
    lengths = scratch.take("lengths", total)
    at = nbytes = 0
    bounds = []
    blocks = sum(g.S.size for g in groups)
    for s, d, count, s_ids, d_ids, run in pieces:
        seg = slice(at, at + s_ids.size)
        np.multiply(s_ids, s.stride, out=remote[seg])
        remote[seg] += s.base_addr
        np.multiply(d_ids, d.stride, out=local[seg])
        local[seg] += d.base_addr
        if run is None:
            lengths[seg] = s.block_bytes
        else:
            np.multiply(run, s.block_bytes, out=lengths[seg])
        nbytes += count * s.block_bytes
        at = seg.stop
        bounds.append(at)
    if scratch.keep:
        for a in (local, remote, lengths):
            a.flags.writeable = False

    failed_by_id: dict[str, LayoutError] = {}
    for i, e in sorted(failed.items()):
        failed_by_id.setdefault(ext_ids[i], e)
    return LayerPlan(
        local=local,
        remote=remote,
        lengths=lengths,
        requests=tuple(dict.fromkeys(ext for i, ext in enumerate(ext_ids) if i not in failed)),
        failed=failed_by_id,
        blocks=blocks,
        nbytes=nbytes,
        bounds=tuple(bounds),
    )
