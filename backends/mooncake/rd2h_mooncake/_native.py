"""Everything that touches the mooncake wheel: finding it, its environment knobs, importing it.

Mooncake reads its timeouts and queue limits from environment variables when an engine
starts, so they are process-wide: the first engine of a process sets them and a later
engine asking for other values is refused (``ConfigError``) instead of silently running
with the first one's.
"""

from __future__ import annotations

import ctypes.util
import importlib.metadata
import importlib.util
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

from rd2h.errors import BackendUnavailableError, ConfigError

__all__ = ["Knobs", "environment", "device_types", "import_engine", "apply", "INSTALL_HINT"]

INSTALL_HINT = "pip install 'rd2h[mooncake]' (the wheel mooncake-transfer-engine-non-cuda)"


@dataclass(frozen=True, slots=True)
class Knobs:
    """Mooncake's own bounds, as engine options; each maps to one environment variable."""

    transfer_timeout_s: int  # MC_TRANSFER_TIMEOUT: a batch not done by then fails
    progress_timeout_s: int  # MC_TCP_PROGRESS_TIMEOUT_SEC: a TCP connection silent that long is dropped
    max_queued_per_peer: int  # MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER: more entries than this fail at once

    def env(self) -> dict[str, str]:
        return {
            "MC_TRANSFER_TIMEOUT": str(self.transfer_timeout_s),
            "MC_TCP_PROGRESS_TIMEOUT_SEC": str(self.progress_timeout_s),
            "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": str(self.max_queued_per_peer),
        }


_lock = threading.Lock()
_applied: Knobs | None = None


def environment() -> tuple[bool, str]:
    """Whether mooncake can start here; imports and starts nothing."""
    if importlib.util.find_spec("mooncake") is None:
        return False, f"mooncake is not installed ({INSTALL_HINT})"
    # engine.so links libibverbs even for TCP; without it the import fails with a loader error
    if ctypes.util.find_library("ibverbs") is None:
        return False, "mooncake's engine needs libibverbs.so.1 even for TCP: apt-get install libibverbs1 librdmacm1"
    return True, ""


# Mooncake's wheels by build, as published on PyPI: the CUDA builds register a GPU buffer
# under its location and copy to and from it; the others move host memory only through rd2h.
# (The -npu and -musa builds are device builds too, but of transports this engine does not
# drive and has not been tried with: they are declared host only until someone does.)
CUDA_BUILDS = (
    "mooncake-transfer-engine", "mooncake-transfer-engine-cuda13",
    "mooncake-transfer-engine-efa", "mooncake-transfer-engine-efa-cuda13",
)  # fmt: skip
HOST_BUILDS = ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine-efa-non-cuda")


def device_types(installed: Callable[[str], bool] | None = None) -> frozenset[str]:
    """The device types the installed mooncake wheel moves besides host memory: ``{"cuda"}``
    for a CUDA build, nothing for a non-CUDA one, nothing when both kinds are installed (one
    overwrote the other's files, and which one won cannot be told without importing it).
    ``installed(name)`` says whether a distribution is installed (a test passes its own)."""
    has = installed or _installed
    if any(has(name) for name in CUDA_BUILDS) and not any(has(name) for name in HOST_BUILDS):
        return frozenset({"cuda"})
    return frozenset()


def _installed(name: str) -> bool:
    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def import_engine() -> ModuleType:
    try:
        import mooncake.engine as engine
    except ImportError as exc:
        raise BackendUnavailableError(f"mooncake cannot be imported ({exc}); {INSTALL_HINT}") from exc
    except OSError as exc:  # its shared libraries failed to load
        raise BackendUnavailableError(f"mooncake cannot load its libraries: {exc}") from exc
    return engine


def apply(knobs: Knobs) -> None:
    """Put ``knobs`` in the environment before the process's first engine starts.

    Raises ``ConfigError`` when an engine of this process already runs with other values.
    """
    global _applied
    with _lock:
        if _applied is not None and _applied != knobs:
            raise ConfigError(
                f"mooncake reads its timeouts and queue limit once per process: this process runs with "
                f"{_applied}, and an engine asked for {knobs}; use the same values in every engine of a process"
            )
        os.environ.update(knobs.env())
        _applied = knobs


