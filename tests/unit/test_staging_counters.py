"""Host staging's byte counters (``vllm:rd2h_staged_bytes_total`` /
``vllm:rd2h_landed_bytes_total``) count a copy once it is seen complete, not when it is
queued: a copy whose event has not completed, or that failed, is not in them.

The device is the host stand-in whose events stay pending until someone synchronizes them
(an accelerator's copy stream, as far as the counters can tell); the copies themselves run
as the stand-in runs them, byte for byte."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import pytest
import torch

from rd2h.device import HostStandIn
from rd2h.staging.decode_landing import DecodeLanding
from rd2h.staging.prefill_mirror import PrefillMirror
from rd2h.tensors import LayerTensors


class PendingEvent:
    """Complete once synchronized; ``fail`` makes that raise instead (a failed copy)."""

    def __init__(self, fail: bool = False) -> None:
        self.done, self.fail = False, fail

    def synchronize(self) -> None:
        if self.fail:
            raise RuntimeError("copy failed on the device")
        self.done = True

    def query(self) -> bool:
        return self.done


class PendingDevice(HostStandIn):
    """The stand-in whose events complete only when synchronized."""

    def __init__(self, fail: bool = False) -> None:
        self.events: list[PendingEvent] = []
        self.fail = fail

    def record(self, stream: Any) -> Any:
        self.events.append(PendingEvent(self.fail))
        return self.events[-1]


def layers(n: int = 2, blocks: int = 8) -> dict[str, LayerTensors]:
    return {f"layer.{i}": LayerTensors(main=[torch.arange(blocks * 64, dtype=torch.uint8).reshape(blocks, 4, 16)])
            for i in range(n)}  # fmt: skip


def test_a_staged_copy_counts_when_its_event_completes_not_when_it_is_queued() -> None:
    device = PendingDevice()
    mirror = PrefillMirror(layers(), blocks_per_slot=4, device=device)
    event = mirror.copy("layer.0", np.array([1, 5, 2]), np.array([], np.int64), None)
    assert event is not None and not event.query()
    assert mirror.copied_bytes == 0  # queued only
    event.synchronize()  # what the Prefill runtime does before it announces the layer
    assert mirror.copied_bytes == 3 * 64
    event.synchronize()  # waited for again: counted once
    assert mirror.copied_bytes == 3 * 64


def test_a_staged_copy_that_fails_is_not_counted() -> None:
    mirror = PrefillMirror(layers(), blocks_per_slot=4, device=PendingDevice(fail=True))
    event = mirror.copy("layer.1", np.array([0]), np.array([], np.int64), None)
    assert event is not None
    with pytest.raises(RuntimeError):
        event.synchronize()
    assert mirror.copied_bytes == 0


def test_a_copy_done_at_once_counts_at_once() -> None:
    mirror = PrefillMirror(layers(), blocks_per_slot=4, device=HostStandIn())
    assert mirror.copy("layer.0", np.array([7, 0]), np.array([], np.int64), None) is None
    assert mirror.copied_bytes == 2 * 64


class Copier:
    """The inner engine: reads by copying from this process's memory; before each batch, notes
    how many bytes the landing counted and how many its completed device copies had moved."""

    def __init__(self, landing: DecodeLanding, sizes: list[int]) -> None:
        self.landing, self.sizes = landing, sizes  # bytes of each round's device copy, in order
        self.seen: list[tuple[int, int]] = []

    def read_batch(self, session: object, local_addrs: Any, remote_addrs: Any, lengths: Any) -> None:
        events = self.landing.device.events
        completed = sum(n for e, n in zip(events, self.sizes) if e.done)
        self.seen.append((self.landing.landed_bytes, completed))
        for dst, src, n in zip(*(np.asarray(a).tolist() for a in (local_addrs, remote_addrs, lengths))):
            ctypes.memmove(dst, src, n)


def test_landed_bytes_count_the_device_copies_that_completed_as_the_read_goes() -> None:
    half = 4096
    dst = torch.zeros(8 * half, dtype=torch.uint8)
    src = torch.randint(0, 255, (8 * half,), dtype=torch.uint8)
    landing = DecodeLanding([dst], capacity_bytes=2 * half, device=PendingDevice())
    engine = Copier(landing, [half] * 4)
    offsets = np.arange(4, dtype=np.int64) * half  # four rounds of one half each
    local, remote = dst.data_ptr() + offsets, src.data_ptr() + offsets
    landing.read(engine, object(), local, remote, np.full(4, half, np.int64))  # type: ignore[arg-type]
    assert torch.equal(dst[: 4 * half], src[: 4 * half])
    # before each round's read: the counter holds exactly what the completed copies moved,
    # and the round before is still in flight (queued, not counted)
    assert engine.seen == [(0, 0), (0, 0), (half, half), (2 * half, 2 * half)]
    assert landing.landed_bytes == 4 * half  # all waited for before the read returns
