"""What the transfer-engine conformance suites share: the reading side's destination, the
descriptors and the bytes they must produce, a watchdog for calls that may hang, and whether
a device of a type is here for the device cases (``rd2h.testing.engine_device_cases``).

Backend authors use these through ``EngineConformance``; ``Reader`` is also theirs to reuse.
"""

from __future__ import annotations

import mmap
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest

from rd2h.errors import PeerGoneError
from rd2h.interfaces import Region, TransferEngine
from rd2h.testing.peer import GAP, PeerProcess

__all__ = ["SENTINEL", "Descriptor", "Reader", "device_missing", "device_tensor"]

SENTINEL = 0x5A  # what destination bytes hold before a read
Descriptor = tuple[int, int, int, int]  # (destination offset, peer region, offset in it, length)


class Reader:
    """The reading engine and its registered destination, followed by an unregistered guard."""

    def __init__(self, engine: TransferEngine, size: int) -> None:
        self.engine = engine
        self._memory = mmap.mmap(-1, size + GAP)
        whole = np.frombuffer(self._memory, dtype=np.uint8)
        self.dest, self.guard = whole[:size], whole[size:]
        self.addr = whole.ctypes.data
        self.keep: list[Any] = []  # device memory registered later: alive as long as the engine
        self.metadata = engine.register([Region(self.addr, size)])
        self.reset()

    def reset(self) -> None:
        self.dest[:] = SENTINEL  # also faults in every page
        self.guard[:] = SENTINEL

    def close(self) -> None:
        self.engine.close()
        self.keep.clear()
        del self.dest, self.guard
        try:
            self._memory.close()
        except BufferError:  # a test still holds a view; the mapping goes with it
            pass


def _arrays(reader: Reader, peer: PeerProcess, descs: Sequence[Descriptor]) -> tuple[np.ndarray, ...]:
    d = np.array(descs, dtype=np.int64).reshape(-1, 4)
    starts = np.array([a for a, _ in peer.regions], dtype=np.int64)
    return reader.addr + d[:, 0], starts[d[:, 1]] + d[:, 2], d[:, 3].copy()


def _image(reader: Reader, peer: PeerProcess, descs: Sequence[Descriptor], lo: int = 0, hi: int | None = None) -> np.ndarray:
    """What ``reader.dest[lo:hi]`` must hold after reading ``descs``."""
    hi = len(reader.dest) if hi is None else hi
    img = np.full(hi - lo, SENTINEL, dtype=np.uint8)
    for off, region, src, n in descs:
        img[off - lo : off - lo + n] = peer.expected(region)[src : src + n]
    return img


def _assert_bytes(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    if not np.array_equal(actual, expected):
        bad = np.flatnonzero(actual != expected)
        raise AssertionError(
            f"{what}: {len(bad)} bytes differ, first at offset {bad[0]} "
            f"(got {actual[bad[0]]:#04x}, expected {expected[bad[0]]:#04x})"
        )


def _prefer_peer_gone(exc: BaseException, when: str) -> None:
    if not isinstance(exc, PeerGoneError):
        warnings.warn(
            f"{when}: the engine raised {type(exc).__name__}; PeerGoneError would let callers "
            "tell a dead peer from other failures",
            stacklevel=2,
        )


def _within(seconds: float, fn: Callable[[], object]) -> tuple[BaseException | None, float]:
    """Run ``fn`` in a watchdog thread; its exception (or None) and how long it took.

    Fails the test if ``fn`` has not returned after ``seconds``.
    """
    box: list[BaseException | None] = [None]

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box[0] = exc

    start = time.monotonic()
    t = threading.Thread(target=run, daemon=True, name="rd2h-conformance-watchdog")
    t.start()
    t.join(seconds)
    if t.is_alive():
        pytest.fail(f"the engine call did not return within {seconds} s (hung?)")
    return box[0], time.monotonic() - start


def device_missing(device_type: str) -> str:
    """Why a device of ``device_type`` (``"cuda"``, ``"npu"``) cannot be used here; "" when
    torch can allocate on its device 0. Never raises."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if device_type == "npu":
        try:
            import torch_npu  # noqa: F401 - registers torch.npu
        except ImportError:
            return "torch_npu is not installed (no Ascend NPU support in torch)"
    backend = getattr(torch, device_type, None)
    if backend is None or not hasattr(backend, "is_available"):
        return f"torch knows no {device_type!r} device type"
    try:
        if not backend.is_available():
            return f"no {device_type} device (torch.{device_type}.is_available() is False)"
        torch.empty(1, dtype=torch.uint8, device=f"{device_type}:0")
    except Exception as exc:  # noqa: BLE001 - a reason to skip, shown in the report
        return f"torch cannot allocate on {device_type}:0 ({type(exc).__name__}: {exc})"
    return ""


def device_tensor(data: np.ndarray, kind: str) -> Any:
    """A torch tensor on device ``kind`` (``"cuda:0"``) holding ``data``'s bytes."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(data)).to(kind)
