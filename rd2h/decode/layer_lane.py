"""A step's small layers, planned for every layer at once (pure: numpy, no I/O).

Every layer of a Prefill step names the same requests and blocks; only the layers' base
addresses differ. The general path (``rd2h.decode.layer_read``) admits, plans and reads each
readiness on its own, a dozen Python steps of a few microseconds each that dominate a small
layer. Once one layer of a step was read cleanly from a peer, a :class:`Lane` holds the
descriptors of that step for every other layer of the same shapes, computed in one numpy
pass from the clean plan, so the next layers of the step are a row lookup, a check that
the tracker would admit the same requests again, the read and the reply.

Why a lane's descriptors are as safe as the general path's: they are the clean plan's
descriptors, each kept as an offset into its tensor and checked to lie inside it (as
``rd2h.layout.step_plans`` does), moved to other layers whose layout pair was validated and
whose tensors have the same shapes (stride, bytes per block, block count) and lie whole
inside the registered regions on both sides (:class:`PeerLayers`, derived at the peer's
admission). A layer that fails any of these has no row, and goes the general way, which
says precisely what is wrong.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from rd2h.decode.receive_tracker import Admission
from rd2h.errors import LayoutError
from rd2h.layout.layers import LayerLayout, validate_layer
from rd2h.layout.planning import LayerPlan, RequestRead
from rd2h.layout.regions import RegionSet
from rd2h.wire.protocol import ReadReadyBatch

__all__ = ["Lane", "PeerLayers", "MAX_LANE_DESCRIPTORS"]

Int64Array = npt.NDArray[np.int64]
_Shape = tuple[tuple[int, int, int], ...]

MAX_LANE_DESCRIPTORS = 64  # a lane is for small layers: bigger ones take the batched path


def _shape(layout: LayerLayout) -> _Shape:
    return tuple((t.stride, t.block_bytes, t.num_blocks) for t in layout.tensors())


def _inside(layout: LayerLayout, regions: RegionSet) -> bool:
    tensors = [t for t in layout.tensors() if t.nbytes > 0]  # a tensor of no blocks holds no descriptor
    return bool(regions.contains([t.base_addr for t in tensors], [t.nbytes for t in tensors]).all())


@dataclass(frozen=True, slots=True)
class _Group:
    """The layers of one peer sharing a shape pair: row per layer name, bases per row and tensor."""

    rows: dict[str, int]
    src_bases: Int64Array  # [rows, tensors]
    dst_bases: Int64Array
    src_extents: Int64Array  # [tensors]: the same for every row (same shapes)
    dst_extents: Int64Array


class PeerLayers:
    """What lanes need of one admitted peer's layers, derived once: the layer pairs that
    validate, have no head split on Decode and lie whole inside both sides' registered
    regions, grouped by the shapes of their tensors."""

    def __init__(
        self, src: Mapping[str, LayerLayout], dst: Mapping[str, LayerLayout], src_regions: RegionSet,
        dst_regions: RegionSet,
    ) -> None:
        found: dict[tuple[_Shape, _Shape], list[tuple[str, LayerLayout, LayerLayout]]] = {}
        for name, s in src.items():
            d = dst.get(name)
            if d is None or d.heads is not None:
                continue
            try:
                validate_layer(name, s, d)
            except LayoutError:
                continue  # the general path raises it, for the requests that layer names
            if _inside(s, src_regions) and _inside(d, dst_regions):
                found.setdefault((_shape(s), _shape(d)), []).append((name, s, d))
        self._groups: dict[str, _Group] = {}
        for members in found.values():
            group = _Group(
                {name: row for row, (name, _, _) in enumerate(members)},
                np.array([[t.base_addr for t in s.tensors()] for _, s, _ in members], dtype=np.int64),
                np.array([[t.base_addr for t in d.tensors()] for _, _, d in members], dtype=np.int64),
                np.array([t.nbytes for t in members[0][1].tensors()], dtype=np.int64),
                np.array([t.nbytes for t in members[0][2].tensors()], dtype=np.int64),
            )
            self._groups.update(dict.fromkeys(group.rows, group))

    def group(self, layer_name: str) -> _Group | None:
        return self._groups.get(layer_name)


class Lane:
    """One step of one peer: the admission to repeat and every same-shaped layer's descriptors.

    ``fits`` says whether a readiness of its peer is the next layer of this step (same
    ``read_reqs`` bytes, contributor and ratio, no final signal); ``descriptors`` gives a
    layer's ``(local, remote, lengths)`` or None where the layer has no row.
    """

    __slots__ = (
        "peer", "reqs_bytes", "member", "ratio", "admission", "peer_token", "reads", "requests",
        "nbytes", "rows", "local", "remote", "lengths", "key",
    )

    def __init__(
        self, *, peer: object, batch: ReadReadyBatch, admission: Admission, peer_token: object,
        reads: Sequence[RequestRead], rows: dict[str, int], local: Int64Array, remote: Int64Array,
        lengths: Int64Array, requests: tuple[str, ...], nbytes: int, key: Hashable,
    ) -> None:
        self.peer = peer  # the AdmittedPeer the lane was made for
        self.reqs_bytes, self.member, self.ratio = batch.reqs_bytes, batch.group_member_idx, batch.tp_ratio
        self.admission, self.peer_token, self.reads = admission, peer_token, reads
        self.rows, self.local, self.remote, self.lengths = rows, local, remote, lengths
        self.requests, self.nbytes, self.key = requests, nbytes, key

    def fits(self, batch: ReadReadyBatch) -> bool:
        return (
            not batch.done_ext_ids
            and batch.group_member_idx == self.member
            and batch.tp_ratio == self.ratio
            and batch.reqs_bytes == self.reqs_bytes
        )

    def descriptors(self, layer_name: str) -> tuple[Int64Array, Int64Array, Int64Array] | None:
        row = self.rows.get(layer_name)
        if row is None:
            return None
        return self.local[row], self.remote[row], self.lengths

    @staticmethod
    def offsets(
        plan: LayerPlan, layer_name: str, table: PeerLayers
    ) -> tuple[_Group, npt.NDArray[np.intp], Int64Array, Int64Array] | None:
        """The clean plan of ``layer_name`` as offsets into its tensors, with its group;
        None where it cannot be moved (its layer has no group, a descriptor lies outside its
        tensor, the plan is not grouped by tensor, or it is too big for a lane)."""
        group = table.group(layer_name)
        if group is None or not 0 < len(plan) <= MAX_LANE_DESCRIPTORS or plan.failed:
            return None
        row = group.rows[layer_name]
        counts = np.diff(np.asarray((0, *plan.bounds), dtype=np.int64))
        if len(counts) != group.src_bases.shape[1] or counts.sum() != len(plan) or (counts < 0).any():
            return None
        tensor = np.repeat(np.arange(len(counts), dtype=np.intp), counts)
        src_offsets = plan.remote - group.src_bases[row, tensor]
        dst_offsets = plan.local - group.dst_bases[row, tensor]
        for offsets, extents in ((src_offsets, group.src_extents), (dst_offsets, group.dst_extents)):
            if not ((offsets >= 0).all() and (plan.lengths <= extents[tensor] - offsets).all()):
                return None  # a descriptor outside its own tensor: moving it could leave the regions
        return group, tensor, src_offsets, dst_offsets

    @classmethod
    def of(
        cls, *, peer: object, batch: ReadReadyBatch, admission: Admission, peer_token: object,
        reads: Sequence[RequestRead], plan: LayerPlan, table: PeerLayers, nbytes: int, key: Hashable,
    ) -> Lane | None:
        """A lane from the clean plan of ``batch``'s layer, or None where it cannot be moved."""
        found = cls.offsets(plan, batch.layer_name, table)
        if found is None:
            return None
        group, tensor, src_offsets, dst_offsets = found
        return cls(
            peer=peer, batch=batch, admission=admission, peer_token=peer_token, reads=reads,
            rows=group.rows, local=group.dst_bases[:, tensor] + dst_offsets,
            remote=group.src_bases[:, tensor] + src_offsets, lengths=plan.lengths.copy(),
            requests=plan.requests, nbytes=nbytes, key=key,
        )
