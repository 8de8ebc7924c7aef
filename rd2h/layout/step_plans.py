"""Plans of a step, built once and moved to each layer's addresses (pure: numpy, no I/O).

Every layer of a Prefill step announces the same requests with the same block ids; only the
layer's base addresses differ. Building a plan (range checks, region checks, coalescing) per
layer re-derives the same descriptors each time, a fixed cost that dominated small layers. A
:class:`StepPlans` keeps the last few clean plans, keyed by what fixes the descriptors (the
caller's key: the peer, the step's ``read_reqs`` bytes, the contributor, the requests read)
and the shape of both layouts (per tensor: stride, bytes per block, block count). A template
holds each descriptor as an offset into its tensor; for a layer of the same shape the plan
is the new layer's tensor bases plus those offsets.

Why a moved plan needs no per-descriptor region check: the full build put every descriptor
of the template inside its tensor (``[base, base + nbytes)``, checked again when the
template is kept), a moved descriptor has the same offset into a tensor of the same shape,
and each tensor of the new layouts is checked once, whole, against the registered regions
(remembered per layout and region set). Any doubt (a tensor outside the regions, a new
shape, a plan that failed some request) falls back to a full build, which says precisely
what is wrong.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from rd2h.errors import LayoutError
from rd2h.layout.layers import LayerLayout, validate_layer
from rd2h.layout.planning import LayerPlan, PlanBuilder, RequestRead
from rd2h.layout.regions import RegionSet

__all__ = ["StepPlans"]

Int64Array = npt.NDArray[np.int64]
_Shape = tuple[tuple[int, int, int], ...]
_FORGET_AT = 1 << 16  # layouts described (or pairs validated) before starting afresh


@dataclass(frozen=True, slots=True, eq=False)
class _Described:
    """What a template depends on (per tensor: stride, bytes per block, block count), the
    tensors' base addresses and extents. Kept beside its layout, so an id is never reused
    while it is here."""

    layout: LayerLayout
    shape: _Shape
    bases: Int64Array
    extents: Int64Array


def _describe(layout: LayerLayout) -> _Described:
    tensors = layout.tensors()
    shape = tuple((t.stride, t.block_bytes, t.num_blocks) for t in tensors)
    bases = np.fromiter((t.base_addr for t in tensors), dtype=np.int64, count=len(tensors))
    extents = np.fromiter((t.nbytes for t in tensors), dtype=np.int64, count=len(tensors))
    return _Described(layout, shape, bases, extents)


@dataclass(frozen=True, slots=True, eq=False)
class _Template:
    """A clean plan as offsets into its tensors: ``tensor[i]`` is the tensor index of
    descriptor ``i`` (for both sides: a plan's descriptors are grouped by tensor)."""

    plan: LayerPlan
    shapes: tuple[_Shape, _Shape]
    tensor: npt.NDArray[np.intp]
    src_offsets: Int64Array
    dst_offsets: Int64Array


class StepPlans:
    """``PlanBuilder.build`` with a memory of the step. Not thread-safe: one per loop.

    The arrays of a plan it returns stay valid until its next call (as a builder's do).
    ``rebuilt``/``moved`` count full builds and plans moved from a template. ``learn``
    describes layouts ahead of time (at a peer's admission), so the first layer of a step
    pays nothing for it.
    """

    def __init__(self, remembered: int = 8) -> None:
        self._builder = PlanBuilder()
        self._remembered = remembered
        self._templates: dict[Hashable, _Template] = {}  # insertion order = age
        self._out: dict[str, Int64Array] = {}
        self._described: dict[int, _Described] = {}
        # (layout, regions) -> every tensor lies inside the regions; both kept, ids stay theirs
        self._inside: dict[tuple[int, int], tuple[LayerLayout, RegionSet, bool]] = {}
        self._validated: dict[tuple[int, int], tuple[LayerLayout, LayerLayout]] = {}
        self.rebuilt = self.moved = 0

    def learn(self, layouts: Iterable[LayerLayout], regions: RegionSet) -> None:
        """Describe ``layouts`` and check their tensors against ``regions`` now."""
        for layout in layouts:
            self._within(layout, regions)

    def learn_pairs(self, pairs: Iterable[tuple[str, LayerLayout, LayerLayout]]) -> None:
        """Validate ``(layer_name, src, dst)`` pairs now; a mismatch is not remembered and
        is raised by ``build`` when that layer is read."""
        for layer_name, src, dst in pairs:
            try:
                self._validate(layer_name, src, dst)
            except LayoutError:
                pass

    def build(
        self,
        key: Hashable | None,
        src: LayerLayout,
        dst: LayerLayout,
        reads: Sequence[RequestRead],
        *,
        src_regions: RegionSet,
        dst_regions: RegionSet,
        layer_name: str = "",
    ) -> LayerPlan:
        """The plan of ``reads`` from ``src`` into ``dst``; ``key`` (None: do not remember)
        must change whenever ``reads`` would. Raises like ``build_layer_plan``."""
        self._validate(layer_name, src, dst)
        template = None if key is None else self._templates.get(key)
        if (
            template is not None
            and template.shapes == (self._description(src).shape, self._description(dst).shape)
            and self._within(src, src_regions)
            and self._within(dst, dst_regions)
        ):
            self.moved += 1
            return self._move(template, src, dst)
        plan = self._builder.build(
            src, dst, reads, src_regions=src_regions, dst_regions=dst_regions, layer_name=layer_name
        )
        self.rebuilt += 1
        if key is not None and not plan.failed:
            self._remember(key, plan, src, dst)
        return plan

    def _validate(self, layer_name: str, src: LayerLayout, dst: LayerLayout) -> None:
        pair = self._validated.get((id(src), id(dst)))
        if pair is not None and pair[0] is src and pair[1] is dst:
            return
        validate_layer(layer_name, src, dst)  # raises: nothing remembered
        if len(self._validated) > _FORGET_AT:
            self._validated.clear()
        self._validated[(id(src), id(dst))] = (src, dst)

    def _remember(self, key: Hashable, plan: LayerPlan, src: LayerLayout, dst: LayerLayout) -> None:
        described = self._description(src), self._description(dst)
        counts = np.diff(np.asarray((0, *plan.bounds), dtype=np.int64))
        if len(counts) != len(described[0].shape) or counts.sum() != len(plan):
            return  # not grouped by tensor as expected: never move it
        tensor = np.repeat(np.arange(len(counts), dtype=np.intp), counts)
        src_offsets = plan.remote - described[0].bases[tensor]
        dst_offsets = plan.local - described[1].bases[tensor]
        for offsets, d in ((src_offsets, described[0]), (dst_offsets, described[1])):
            if len(offsets) and not (
                (offsets >= 0).all() and (plan.lengths <= d.extents[tensor] - offsets).all()
            ):
                return  # a descriptor outside its own tensor: moving it could leave the regions
        own = LayerPlan(
            plan.local.copy(), plan.remote.copy(), plan.lengths.copy(),
            plan.requests, {}, plan.blocks, plan.nbytes, plan.bounds,
        )
        self._templates.pop(key, None)
        self._templates[key] = _Template(own, (described[0].shape, described[1].shape), tensor, src_offsets, dst_offsets)
        while len(self._templates) > self._remembered:
            del self._templates[next(iter(self._templates))]

    def _move(self, template: _Template, src: LayerLayout, dst: LayerLayout) -> LayerPlan:
        base = template.plan
        n = len(base)
        local, remote = self._take("local", n), self._take("remote", n)
        np.take(self._description(src).bases, template.tensor, out=remote)
        remote += template.src_offsets
        np.take(self._description(dst).bases, template.tensor, out=local)
        local += template.dst_offsets
        return LayerPlan(local, remote, base.lengths, base.requests, {}, base.blocks, base.nbytes, base.bounds)

    def _within(self, layout: LayerLayout, regions: RegionSet) -> bool:
        """Whether every tensor of ``layout`` lies, whole, inside ``regions`` (remembered)."""
        entry = self._inside.get((id(layout), id(regions)))
        if entry is None or entry[0] is not layout or entry[1] is not regions:
            if len(self._inside) > _FORGET_AT:
                self._inside.clear()
            d = self._description(layout)
            held = d.extents > 0  # a tensor of no blocks holds no descriptor
            ok = bool(regions.contains(d.bases[held], d.extents[held]).all())
            entry = self._inside[(id(layout), id(regions))] = (layout, regions, ok)
        return entry[2]

    def _description(self, layout: LayerLayout) -> _Described:
        entry = self._described.get(id(layout))
        if entry is None or entry.layout is not layout:
            if len(self._described) > _FORGET_AT:  # peers come and go: start afresh now and then
                self._described.clear()
            entry = self._described[id(layout)] = _describe(layout)
        return entry

    def _take(self, name: str, n: int) -> Int64Array:
        buf = self._out.get(name)
        if buf is None or buf.size < n:
            buf = self._out[name] = np.empty(n + n // 8, dtype=np.int64)
        return buf[:n]
