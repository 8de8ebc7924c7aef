"""Plans of a step, built once and moved to each layer's addresses (pure: numpy, no I/O).

Every layer of a Prefill step announces the same requests with the same block ids; only the
layer's base addresses differ. Building a plan (range checks, region checks, coalescing) per
layer re-derives the same descriptors each time, a fixed cost that dominated small layers. A
:class:`StepPlans` keeps the last few clean plans, keyed by what fixes the descriptors (the
caller's key: the peer, the step's ``read_reqs`` bytes, the contributor, the requests read)
and the shape of both layouts (per tensor: stride, bytes per block, block count), and for a
layer of the same shape only shifts each tensor's descriptors by the change in its base
address. The shifted descriptors are checked against the registered regions, vectorized,
before they are handed out; any doubt (a range outside them, a new shape, a plan that failed
some request) falls back to a full build, which says precisely what is wrong.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from rd2h.layout import LayerLayout, validate_layer
from rd2h.planning import LayerPlan, PlanBuilder, RequestRead
from rd2h.regions import RegionSet

__all__ = ["StepPlans"]

Int64Array = npt.NDArray[np.int64]
_Shape = tuple[tuple[int, int, int], ...]


def _describe(layout: LayerLayout) -> tuple[_Shape, Int64Array]:
    """What a template depends on (per tensor: stride, bytes per block, block count), and
    the tensors' base addresses."""
    tensors = layout.tensors()
    shape = tuple((t.stride, t.block_bytes, t.num_blocks) for t in tensors)
    return shape, np.fromiter((t.base_addr for t in tensors), dtype=np.int64, count=len(tensors))


@dataclass(frozen=True, slots=True, eq=False)
class _Template:
    """A clean plan with its own copies of the arrays, and the layouts it was built for."""

    plan: LayerPlan
    shapes: tuple[_Shape, _Shape]
    src_bases: Int64Array
    dst_bases: Int64Array


class StepPlans:
    """``PlanBuilder.build`` with a memory of the step. Not thread-safe: one per loop.

    The arrays of a plan it returns stay valid until its next call (as a builder's do).
    ``rebuilt``/``moved`` count full builds and plans moved from a template.
    """

    def __init__(self, remembered: int = 8) -> None:
        self._builder = PlanBuilder()
        self._remembered = remembered
        self._templates: dict[Hashable, _Template] = {}  # insertion order = age
        self._out: dict[str, Int64Array] = {}
        # layouts live as long as their peer or sink: describe each once (kept beside its
        # description, so an id is never reused while it is here)
        self._described: dict[int, tuple[LayerLayout, _Shape, Int64Array]] = {}
        self.rebuilt = self.moved = 0

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
        validate_layer(layer_name, src, dst)
        template = None if key is None else self._templates.get(key)
        if template is not None and template.shapes == (self._shape(src), self._shape(dst)):
            moved = self._move(template, src, dst, src_regions, dst_regions)
            if moved is not None:
                self.moved += 1
                return moved
        plan = self._builder.build(
            src, dst, reads, src_regions=src_regions, dst_regions=dst_regions, layer_name=layer_name
        )
        self.rebuilt += 1
        if key is not None and not plan.failed:
            self._remember(key, plan, src, dst)
        return plan

    def _remember(self, key: Hashable, plan: LayerPlan, src: LayerLayout, dst: LayerLayout) -> None:
        own = LayerPlan(
            plan.local.copy(), plan.remote.copy(), plan.lengths.copy(),
            plan.requests, {}, plan.blocks, plan.nbytes, plan.bounds,
        )
        self._templates.pop(key, None)
        self._templates[key] = _Template(own, (self._shape(src), self._shape(dst)), self._bases(src), self._bases(dst))
        while len(self._templates) > self._remembered:
            del self._templates[next(iter(self._templates))]

    def _move(
        self, template: _Template, src: LayerLayout, dst: LayerLayout, src_regions: RegionSet, dst_regions: RegionSet
    ) -> LayerPlan | None:
        base = template.plan
        n = len(base)
        local, remote = self._take("local", n), self._take("remote", n)
        src_shift = self._bases(src) - template.src_bases
        dst_shift = self._bases(dst) - template.dst_bases
        start = 0
        for k, end in enumerate(base.bounds):
            np.add(base.remote[start:end], src_shift[k], out=remote[start:end])
            np.add(base.local[start:end], dst_shift[k], out=local[start:end])
            start = end
        if n and not (src_regions.contains(remote, base.lengths).all() and dst_regions.contains(local, base.lengths).all()):
            return None
        return LayerPlan(local, remote, base.lengths, base.requests, {}, base.blocks, base.nbytes, base.bounds)

    def _shape(self, layout: LayerLayout) -> _Shape:
        return self._description(layout)[1]

    def _bases(self, layout: LayerLayout) -> Int64Array:
        return self._description(layout)[2]

    def _description(self, layout: LayerLayout) -> tuple[LayerLayout, _Shape, Int64Array]:
        entry = self._described.get(id(layout))
        if entry is None or entry[0] is not layout:
            if len(self._described) > 4096:  # peers come and go: start afresh now and then
                self._described.clear()
            entry = self._described[id(layout)] = (layout, *_describe(layout))
        return entry

    def _take(self, name: str, n: int) -> Int64Array:
        buf = self._out.get(name)
        if buf is None or buf.size < n:
            buf = self._out[name] = np.empty(n + n // 8, dtype=np.int64)
        return buf[:n]
