"""Prefill host staging: a registered host mirror of the layers in flight, filled on a copy stream.

For an engine that cannot read the device the KV lives on (every engine but MemFabric, for
now), Prefill registers a host mirror instead of the cache. The mirror has ``slots`` slots;
logical layer ``i`` uses slot ``i % slots``, so layers sharing a slot share its addresses and
the Prefill runtime's storage-slot gate (:mod:`rd2h.prefill.gate`) keeps a slot from being
refilled before every Decode endpoint read the layer it holds. A slot holds
``blocks_per_slot`` blocks of each of the layer's tensors: what one step makes ready, not
the cache. After a layer's compute event, the step's ready blocks are gathered by index on a
copy stream and copied device-to-host into the slot's rows; the layer is announced once that
copy's event completes. Decode reads the mirror rows the send tracker names
(:mod:`rd2h.staging.mirror_tables`).

:class:`StagedSource` is a :class:`~rd2h.prefill.source.Source` over the mirror: same calls,
device block ids in, mirror rows on the wire. ``rd2h.api.StagedKVSource`` builds one from
backend names.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from rd2h.device import DONE, CopyDevice, byte_rows, device_of
from rd2h.errors import ConfigError, RD2HError
from rd2h.layout.layers import LayerLayout, TensorLayout
from rd2h.outcome import Outcome
from rd2h.prefill.source import DecodeEndpoint, Source
from rd2h.staging.mirror_tables import MirrorTables, StagedStep
from rd2h.tensors import LayerTensors, layer_layout

__all__ = ["PrefillMirror", "StagedSource"]

log = logging.getLogger("rd2h.staging")
_ALIGN = 4096  # each tensor's rows start on a page: copies run at full speed


class _Failed:
    """The event of a copy that raised: the sender fails the step's requests with it."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def synchronize(self) -> None:
        raise RD2HError(f"staging copy failed: {type(self.error).__name__}: {self.error}")


class _Counted:
    """A copy's event that adds the copy to its mirror's counters when it is seen complete:
    the Prefill runtime synchronizes every layer's event before it announces the layer, so
    counting there costs no wait of its own."""

    __slots__ = ("event", "mirror", "nbytes", "_counted")

    def __init__(self, event: Any, mirror: PrefillMirror, nbytes: int) -> None:
        self.event, self.mirror, self.nbytes, self._counted = event, mirror, nbytes, False

    def synchronize(self) -> None:
        self.event.synchronize()  # raises for a copy that failed: nothing counted
        if not self._counted:
            self._counted = True
            self.mirror._count(self.nbytes)

    def query(self) -> bool:
        return bool(self.event.query())


class PrefillMirror:
    """The host mirror of a Prefill rank's layers and the copies that fill it.

    ``layers``: every logical layer's device tensors, in layer order; ``layouts``: their
    layouts if the caller tagged them (vLLM does), else taken from the tensors.
    ``blocks_per_slot`` bounds the main blocks one step stages (``indexer_blocks_per_slot``
    the indexer's; default the same). ``device``: the copy adapter (default: the device of
    the first main tensor; :class:`~rd2h.device.HostStandIn` for CPU tensors). Raises
    ConfigError for a bad count or a tensor whose blocks are not contiguous.
    """

    def __init__(
        self,
        layers: Mapping[str, LayerTensors],
        *,
        blocks_per_slot: int,
        slots: int = 2,
        indexer_blocks_per_slot: int | None = None,
        layouts: Mapping[str, LayerLayout] | None = None,
        device: CopyDevice | None = None,
    ) -> None:
        if not layers:
            raise ConfigError("a mirror needs at least one layer")
        if slots < 1 or blocks_per_slot < 1:
            raise ConfigError(f"a mirror needs slots >= 1 and blocks_per_slot >= 1, got {slots} and {blocks_per_slot}")
        self.main_rows = blocks_per_slot
        self.indexer_rows = blocks_per_slot if indexer_blocks_per_slot is None else indexer_blocks_per_slot
        first = next(iter(layers.values())).main[0]
        self.device = device if device is not None else device_of(first)
        given = {} if layouts is None else dict(layouts)
        device_layouts = {name: given.get(name) or layer_layout(t, tag=True) for name, t in layers.items()}
        # per layer: (slot, role, group, device rows, device tensor layout)
        parts: dict[str, list[tuple[int, str, str, Any, TensorLayout]]] = {}
        widths: dict[tuple[int, str], int] = {}
        for i, (name, tensors) in enumerate(layers.items()):
            layout = device_layouts[name]
            named = [(f"main[{k}]", "main", t) for k, t in enumerate(tensors.main)]
            named += [(role, "indexer", t) for role, t in (("indexer", tensors.indexer), ("scale", tensors.scale)) if t is not None]
            tls = layout.tensors()
            if len(tls) != len(named):
                raise ConfigError(f"layer {name!r}: its layout has {len(tls)} tensors, its tensors {len(named)}")
            slot = i % slots
            parts[name] = [(slot, role, group, byte_rows(t), tl) for (role, group, t), tl in zip(named, tls)]
            for _, role, _, _, tl in parts[name]:
                widths[slot, role] = max(widths.get((slot, role), 0), tl.block_bytes)
        offsets: dict[tuple[int, str], int] = {}
        sizes = [0] * slots
        for (slot, role), width in sorted(widths.items()):
            offsets[slot, role] = sizes[slot]
            rows = self.main_rows if role.startswith("main") else self.indexer_rows
            sizes[slot] += -(-rows * width // _ALIGN) * _ALIGN
        self._buffers = [self.device.pinned(size) for size in sizes]  # registered: kept for the mirror's life
        self.nbytes = sum(sizes)
        self.layouts: dict[str, LayerLayout] = {}
        self._copies: dict[str, list[tuple[str, Any, Any]]] = {}  # layer -> (group, device rows, mirror rows)
        for name, layer_parts in parts.items():
            tensors_out: list[TensorLayout] = []
            copies = []
            for slot, role, group, rows_dev, tl in layer_parts:
                width, rows = widths[slot, role], self.main_rows if group == "main" else self.indexer_rows
                start = offsets[slot, role]
                mirror = self._buffers[slot][start : start + rows * width].view(rows, width)[:, : tl.block_bytes]
                tensors_out.append(TensorLayout(mirror.data_ptr(), tl.block_len, rows, tl.block_size_scale, block_stride=width))
                copies.append((group, rows_dev, mirror))
            layout = device_layouts[name]
            n_main = len(layout.main)
            rest = iter(tensors_out[n_main:])
            self.layouts[name] = replace(
                layout, main=tuple(tensors_out[:n_main]),
                indexer=None if layout.indexer is None else next(rest), scale=None if layout.scale is None else next(rest),
            )  # fmt: skip
            self._copies[name] = copies
        self.main_limit = min(len(rows) for c in self._copies.values() for g, rows, _ in c if g == "main")
        indexer = [len(rows) for c in self._copies.values() for g, rows, _ in c if g == "indexer"]
        self.indexer_limit = min(indexer) if indexer else self.main_limit
        self._stream = self.device.stream()
        self._copied: dict[str, Any] = {}  # layer -> event of its latest copy (the device rows are read until then)
        # Counted when a copy is seen complete (its event synchronized), not when it is queued:
        # the sender thread counts what it waited for, the caller what was done at once.
        self._count_lock = threading.Lock()
        self.copied_bytes = 0  # bytes the completed copies moved device-to-host (worker stats)

    def copy(self, layer_name: str, main_blocks: np.ndarray, indexer_blocks: np.ndarray, after: Any | None) -> Any | None:
        """Queue the copy of the layer's ``main_blocks`` / ``indexer_blocks`` (device ids)
        into rows ``0..n-1`` of its mirror slot, after ``after`` (the compute event; None:
        written already). Returns the copy's event, or None where it is done already. The
        copy counts in ``copied_bytes`` once done: at once for a copy already
        done, else when the returned event's ``synchronize`` returns."""
        stream = self._stream
        self.device.after(stream, after)
        nbytes = 0
        for group, rows_dev, rows_host in self._copies[layer_name]:
            ids = main_blocks if group == "main" else indexer_blocks
            self.device.gather_to_host(stream, rows_dev, ids, rows_host)
            nbytes += len(ids) * int(rows_host.shape[1])
        event = self.device.record(stream)
        self._copied[layer_name] = event
        if event is DONE:
            self._count(nbytes)
            return None
        return _Counted(event, self, nbytes) if nbytes else event

    def _count(self, nbytes: int) -> None:
        if nbytes:
            with self._count_lock:  # the caller's thread and the sender thread both count
                self.copied_bytes += nbytes

    def release_device(self, layer_name: str) -> None:
        """Order the compute stream after the layer's latest copy, so it may overwrite the
        device blocks (the host is not blocked)."""
        self.device.current_after(self._copied.get(layer_name))


class StagedSource(Source):
    """A Prefill runtime whose engine reads a host mirror of device tensors.

    Built as a :class:`~rd2h.prefill.source.Source` (or, through ``rd2h.api.StagedKVSource``,
    a ``KVSource``) with ``mirror`` in place of ``layers``; every other option is the
    source's, and ``reuse_slots`` is always on (mirror slots are reused). The calls are the
    source's, with device block ids: ``wait_for_layer_send`` only orders the compute stream
    after the layer's last device-to-host copy (it never waits for Decode);
    ``layer_ready`` waits for the layer's mirror slot (raises GateTimeout after the reply
    timeout plus a margin), queues the copy after ``event`` and announces the layer once
    the copy is done. A request whose step does not fit a mirror slot fails with a
    ConfigError that says so (``schedule`` returns it).
    """

    def __init__(self, *, mirror: PrefillMirror, **options: Any) -> None:
        self._mirror = mirror
        self._tables = MirrorTables(
            block_size=options["block_size"], indexer_block_size=options.get("indexer_block_size"),
            main_rows=mirror.main_rows, indexer_rows=mirror.indexer_rows,
            main_limit=mirror.main_limit, indexer_limit=mirror.indexer_limit,
        )  # fmt: skip
        self._staged = StagedStep()
        super().__init__(layers=mirror.layouts, **{**options, "reuse_slots": True})

    @property
    def mirror(self) -> PrefillMirror:
        return self._mirror

    def add_request(
        self,
        ext_id: str,
        decode: DecodeEndpoint,
        *,
        main_block_ids: Sequence[int] = (),
        indexer_block_ids: Sequence[int] | None = None,
        num_tokens: int,
        first_block: int = 0,
    ) -> None:
        record = self._tables.check(ext_id, main_block_ids, indexer_block_ids, num_tokens, first_block)
        super().add_request(
            ext_id, decode, main_block_ids=(), indexer_block_ids=(), num_tokens=num_tokens, first_block=first_block
        )
        self._tables.add(ext_id, record)

    def extend(self, ext_id: str, *, main_block_ids: Sequence[int] = (), indexer_block_ids: Sequence[int] = ()) -> None:
        if ext_id not in self._tables:
            super().extend(ext_id)  # raises for an id never added, ignores one that ended
            return
        self._tables.extend(ext_id, main_block_ids, indexer_block_ids)

    def schedule(self, computed_tokens: Mapping[str, int]) -> dict[str, RD2HError]:
        step = self._tables.plan(computed_tokens)
        for ext_id, (main, indexer) in step.extend.items():
            try:
                super().extend(ext_id, main_block_ids=main, indexer_block_ids=indexer)
            except RD2HError:  # collected meanwhile: the tracker refuses it below
                pass
        self._tables.handed(step)
        problems = super().schedule(computed_tokens)
        self._tables.commit(step, (e for e in step.extend if e not in problems))
        for ext_id, error in step.refused.items():
            if ext_id in problems:  # the tracker failed it for want of rows: say why
                log.warning("Prefill rank %d: %s", self.rank, error)
                problems[ext_id] = error
        self._staged = step
        return problems

    def wait_for_layer_send(self, layer_name: str, timeout: float | None = None) -> None:
        self._index_of(layer_name)
        self._mirror.release_device(layer_name)

    def layer_ready(self, layer_name: str, event: Any | None = None) -> None:
        self._index_of(layer_name)
        super().wait_for_layer_send(layer_name)  # the mirror slot: every reader of its last layer replied
        step = self._staged
        try:
            copied = self._mirror.copy(layer_name, step.main_blocks, step.indexer_blocks, event)
        except Exception as exc:  # noqa: BLE001 - announced as failed: the step's requests fail, not the caller
            log.error("Prefill rank %d: staging layer %r failed: %s", self.rank, layer_name, exc)
            copied = _Failed(exc)
        super().layer_ready(layer_name, copied)

    def take_finished(self) -> dict[str, Outcome]:
        outcomes = super().take_finished()
        self._tables.forget(outcomes)
        return outcomes

    def wait_finished(self, ext_ids: Sequence[str], timeout: float) -> dict[str, Outcome]:
        outcomes = super().wait_finished(ext_ids, timeout)
        self._tables.forget(outcomes)
        return outcomes
