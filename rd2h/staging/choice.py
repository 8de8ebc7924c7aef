"""When to stage: the KV lives in memory the chosen engine cannot move (the vLLM worker asks).

An engine declares the memory it moves (``TransferEngine.memory_kinds``: device types it
reads from as Prefill and writes to as Decode; host only by default); a tensor's is
``rd2h.tensors.memory_kind``. Where a layer tensor
is on a device type the engine does not move, the worker stages: Prefill through a
:class:`~rd2h.staging.prefill_mirror.PrefillMirror`, Decode through a
:class:`~rd2h.staging.decode_landing.DecodeLanding`. Mirror size: ``RD2H_STAGING_SLOTS``
slots (default 2) of ``RD2H_STAGING_BLOCKS`` blocks (default 2048: what a step of
``max_num_batched_tokens`` up to 16k tokens at block size 16 makes ready, partial blocks
included for up to ~1k requests), capped at the cache's blocks; Decode's landing buffer is
``RD2H_STAGING_LANDING_MB`` MiB (default 256).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from rd2h import plugins
from rd2h.layout.regions import device_type
from rd2h.staging.decode_landing import DecodeLanding
from rd2h.tensors import LayerTensors, memory_kind

__all__ = ["device_types", "moved_by", "WorkerStaging"]


def device_types(layers: Mapping[str, LayerTensors]) -> set[str]:
    """The device types the layers' tensors live on (``"host"`` for host memory)."""
    return {
        device_type(memory_kind(t))
        for tensors in layers.values() for t in (*tensors.main, tensors.indexer, tensors.scale) if t is not None
    }  # fmt: skip


def moved_by(engine: str, role: str) -> set[str]:
    """The device types ``engine`` moves in ``role`` (host only where it does not say)."""
    return set(plugins.engine_class(engine).memory_kinds().for_role(role))


class WorkerStaging:
    """The vLLM worker's choice: staged or not, per role. ``layers``: its tensors; ``layouts``:
    the layouts it built from them; ``engine``: the configured engine's name."""

    def __init__(self, layers: Mapping[str, LayerTensors], layouts: Mapping[str, Any], engine: str) -> None:
        self.layers, self.layouts, self.engine = layers, layouts, engine
        self._types = device_types(layers)

    def needed(self, role: str) -> bool:
        return bool(self._types - moved_by(self.engine, role))

    def sink_options(self) -> dict[str, Any]:
        """``{"landing": ...}`` for ``KVSink`` where Decode's engine cannot write the KV; else ``{}``."""
        if not self.needed("decode"):
            return {}
        mb = int(os.environ.get("RD2H_STAGING_LANDING_MB", "256"))
        return {"landing": DecodeLanding.for_layers(self.layers, capacity_bytes=mb << 20)}

    def source(self, plain: type, **options: Any) -> Any:
        """A ``plain`` source (``KVSource``) over the layouts, or, where Prefill's engine
        cannot read the KV, a staged one over a host mirror (``reuse_slots`` is then on)."""
        if not self.needed("prefill"):
            return plain(self.layouts, **options)
        from rd2h.api import PrefillMirror, StagedKVSource

        cache = min(int(t.main[0].shape[0]) for t in self.layers.values())
        mirror = PrefillMirror(
            self.layers, layouts=self.layouts, slots=int(os.environ.get("RD2H_STAGING_SLOTS", "2")),
            blocks_per_slot=min(cache, int(os.environ.get("RD2H_STAGING_BLOCKS", "2048"))),
        )  # fmt: skip
        options.pop("reuse_slots", None)
        return StagedKVSource(mirror=mirror, **options)
