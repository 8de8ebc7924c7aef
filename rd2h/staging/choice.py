"""When to stage: the KV lives in memory the configured engine cannot move (the vLLM worker asks).

An engine declares the memory it moves as configured (``TransferEngine.memory_kinds_for``
the options it will be built with: device types it reads from as Prefill and writes to as
Decode; host only by default; MemFabric on its host transport moves host memory only); a
tensor's is ``rd2h.tensors.memory_kind``. ``RD2H_STAGING`` says what to do with that:

- ``auto`` (the default): stage where a layer tensor is on a device type the engine does
  not move;
- ``always``: stage whatever the tensors are (KV in host memory goes through the host
  stand-in: how CI runs the staged path inside vLLM on a CPU);
- ``never``: never stage; where ``auto`` would, the worker's registration raises
  ConfigError naming the memory kind and the engine, instead of a read failing later.

Staged, Prefill goes through a :class:`~rd2h.staging.prefill_mirror.PrefillMirror`, Decode
through a :class:`~rd2h.staging.decode_landing.DecodeLanding`. Mirror size:
``RD2H_STAGING_SLOTS`` slots (default 2) of ``RD2H_STAGING_BLOCKS`` blocks (default 2048:
what a step of ``max_num_batched_tokens`` up to 16k tokens at block size 16 makes ready,
partial blocks included for up to ~1k requests), capped at the cache's blocks; Decode's
landing buffer is ``RD2H_STAGING_LANDING_MB`` MiB (default 256).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from rd2h import plugins
from rd2h.engine_support import kinds_for_options
from rd2h.errors import ConfigError
from rd2h.layout.regions import device_type
from rd2h.staging.decode_landing import DecodeLanding
from rd2h.tensors import LayerTensors, memory_kind

__all__ = ["MODES", "device_types", "moved_by", "staging_mode", "WorkerStaging"]

log = logging.getLogger("rd2h.staging")
MODES = ("auto", "always", "never")
_SIDE = {"prefill": "reads from", "decode": "writes to"}


def staging_mode(environ: Mapping[str, str] | None = None) -> str:
    """``RD2H_STAGING`` (``auto`` where unset). Raises ConfigError for another value."""
    value = (os.environ if environ is None else environ).get("RD2H_STAGING", "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ConfigError(f"RD2H_STAGING must be one of {', '.join(MODES)}, got {value!r:.40}")
    return value


def _tensors(layers: Mapping[str, LayerTensors]) -> list[Any]:
    return [t for tensors in layers.values() for t in tensors.all_tensors()]


def device_types(layers: Mapping[str, LayerTensors]) -> set[str]:
    """The device types the layers' tensors live on (``"host"`` for host memory)."""
    return {device_type(memory_kind(t)) for t in _tensors(layers)}


def moved_by(engine: str, role: str, options: Mapping[str, Any] | None = None) -> set[str]:
    """The device types ``engine`` built with ``options`` moves in ``role`` (host only where
    it does not say)."""
    return set(kinds_for_options(plugins.engine_class(engine), options).for_role(role))


class WorkerStaging:
    """The vLLM worker's choice: staged or not, per role. ``layers``: its tensors; ``layouts``:
    the layouts it built from them; ``engine`` and ``engine_options``: the configured engine;
    ``mode``: ``RD2H_STAGING``'s (read from the environment where None). Raises ConfigError
    for a bad mode. What it built is kept (``mirror``, ``landing``) for :meth:`counters`."""

    def __init__(
        self,
        layers: Mapping[str, LayerTensors],
        layouts: Mapping[str, Any],
        engine: str,
        engine_options: Mapping[str, Any] | None = None,
        mode: str | None = None,
    ) -> None:
        self.layers, self.layouts, self.engine = layers, layouts, engine
        self.engine_options = dict(engine_options or {})
        self.mode = staging_mode() if mode is None else staging_mode({"RD2H_STAGING": mode})
        self._types = device_types(layers)
        self.mirror: Any = None
        self.landing: DecodeLanding | None = None

    def needed(self, role: str) -> bool:
        """Whether ``role``'s side stages. Raises ConfigError where it would and the mode is
        ``never``: the message names the memory kind, the engine and what it moves."""
        if self.mode == "always":
            return True
        moved = moved_by(self.engine, role, self.engine_options)
        missing = self._types - moved
        if missing and self.mode == "never":
            kinds = sorted({k for k in map(memory_kind, _tensors(self.layers)) if device_type(k) in missing})
            raise ConfigError(
                f"RD2H_STAGING=never: the KV is in {', '.join(kinds)} memory, and the {self.engine} engine as "
                f"configured {_SIDE[role]} {', '.join(sorted(moved)) or 'no'} memory only; set RD2H_STAGING=auto "
                "to stage it through host memory, or configure an engine that moves it"
            )
        return bool(missing)

    def sink_options(self) -> dict[str, Any]:
        """``{"landing": ...}`` for ``KVSink`` where Decode stages; else ``{}``."""
        if not self.needed("decode"):
            return {}
        mb = int(os.environ.get("RD2H_STAGING_LANDING_MB", "256"))
        self.landing = DecodeLanding.for_layers(self.layers, force=self.mode == "always", capacity_bytes=mb << 20)
        if self.landing is not None:
            log.info(
                "Decode: host staging on (RD2H_STAGING=%s, %s engine): a %d MiB landing buffer for %s memory",
                self.mode, self.engine, self.landing.nbytes >> 20, ", ".join(sorted(self.landing.device_types)),
            )  # fmt: skip
        return {"landing": self.landing}

    def source(self, plain: type, **options: Any) -> Any:
        """A ``plain`` source (``KVSource``) over the layouts, or, where Prefill stages, a
        staged one over a host mirror (``reuse_slots`` is then on)."""
        if not self.needed("prefill"):
            return plain(self.layouts, **options)
        from rd2h.api import PrefillMirror, StagedKVSource

        cache = min(int(t.main[0].shape[0]) for t in self.layers.values())
        self.mirror = PrefillMirror(
            self.layers, layouts=self.layouts, slots=int(os.environ.get("RD2H_STAGING_SLOTS", "2")),
            blocks_per_slot=min(cache, int(os.environ.get("RD2H_STAGING_BLOCKS", "2048"))),
        )  # fmt: skip
        log.info(
            "Prefill: host staging on (RD2H_STAGING=%s, %s engine): a %d MiB mirror of %s memory (%s)",
            self.mode, self.engine, self.mirror.nbytes >> 20, ", ".join(sorted(self._types)), self.mirror.device.name,
        )  # fmt: skip
        options.pop("reuse_slots", None)
        return StagedKVSource(mirror=self.mirror, **options)

    def counters(self) -> tuple[int, int]:
        """``(staged_bytes, landed_bytes)`` so far: bytes Prefill's mirror copied
        device-to-host and Decode's landing copied host-to-device, counted as each copy is
        seen complete (0 where not staged)."""
        return (
            0 if self.mirror is None else self.mirror.copied_bytes,
            0 if self.landing is None else self.landing.landed_bytes,
        )
