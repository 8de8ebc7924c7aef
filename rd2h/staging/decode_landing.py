"""Decode host staging: device destinations written host-to-device after the read.

An engine that writes host memory only cannot read into a device destination. A
:class:`DecodeLanding` wraps the Decode engine (:meth:`DecodeLanding.wrap`): a batched read
whose destinations lie in a staged (device) tensor reads those bytes into a pinned host
landing buffer instead, then copies them host-to-device on a copy stream, scattered by
index; destinations in host memory (the ``sfa`` main pool) are read into directly, in the
same batched read. The read returns once the device copy is done, so the Sink's READ_DONE
means the bytes are where ``expect`` said. The landing buffer is bounded
(``capacity_bytes``, two halves): a read bigger than a half goes in rounds, the next
round's read overlapping the previous round's device copy.

Nothing in the Sink changes: it checks every destination against the device tensors it was
given, as always; the wrapped engine registers host destinations and the landing buffer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from rd2h.device import DONE, CopyDevice, byte_rows, device_of
from rd2h.engine_support import kinds_in_use
from rd2h.errors import ConfigError, RegionError, TransferError
from rd2h.interfaces import MemoryKinds, Session, TransferEngine
from rd2h.layout.regions import Region, device_type
from rd2h.tensors import LayerTensors, memory_kind, tensor_layout

__all__ = ["DecodeLanding", "LandingEngine"]

_PAGE = 4096


def _exclusive_cumsum(counts: np.ndarray) -> np.ndarray:
    out = np.zeros(len(counts), np.int64)
    np.cumsum(counts[:-1], out=out[1:])
    return out


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``concat(arange(s, s + c) for s, c in zip(starts, counts))``, without a loop."""
    total = int(counts.sum())
    return np.repeat(starts - _exclusive_cumsum(counts), counts) + np.arange(total, dtype=np.int64)


class DecodeLanding:
    """The staged destination tensors of a Decode rank and its host landing buffer.

    ``staged``: the torch tensors to write through the landing buffer (a device's; in the
    host stand-in, any). ``capacity_bytes``: the landing buffer (pinned), in two halves; a
    half must hold a page. ``device``: the copy adapter (default: the first tensor's).
    Raises ConfigError for overlapping tensors, a tensor whose blocks are not contiguous, or
    a landing buffer under two pages.
    """

    def __init__(self, staged: Iterable[Any], *, capacity_bytes: int = 64 << 20, device: CopyDevice | None = None) -> None:
        tensors = sorted(staged, key=lambda t: t.data_ptr())
        if not tensors:
            raise ConfigError("nothing to stage: give the device tensors")
        if capacity_bytes < 2 * _PAGE:
            raise ConfigError(f"a landing buffer needs at least {2 * _PAGE} bytes, got {capacity_bytes}")
        self.device = device if device is not None else device_of(tensors[0])
        self._tensors = tensors
        self._starts = np.array([t.data_ptr() for t in tensors], np.int64)
        self._ends = self._starts + np.array([tensor_layout(t).nbytes for t in tensors], np.int64)
        if (self._starts[1:] < self._ends[:-1]).any():
            raise ConfigError("staged tensors overlap")
        self.half = capacity_bytes // 2 // _PAGE * _PAGE
        self._landing = [self.device.pinned(self.half) for _ in range(2)]
        # per half: the event of the device copy still reading it, and the bytes that copy moves
        self._used: list[tuple[Any, int] | None] = [None, None]
        self._units: dict[tuple[int, int], Any] = {}  # (tensor, unit bytes) -> its rows of that size
        self._stream = self.device.stream()
        # Counted once a round's device copy is seen complete (read waits for each before it
        # returns), not when it is queued: no wait of their own.
        self.landed_bytes = 0  # copied host-to-device so far (the staged path ran: worker stats)

    @classmethod
    def for_layers(cls, layers: Mapping[str, LayerTensors], *, force: bool = False, **options: Any) -> DecodeLanding | None:
        """A landing for every tensor of ``layers`` that is not in host memory; None if all
        are, unless ``force``: then (``RD2H_STAGING=always`` on a CPU) a landing for all of
        them, through the host stand-in."""
        every = [t for tensors in layers.values() for t in tensors.all_tensors()]
        staged = [t for t in every if memory_kind(t) != "host"] or (every if force else [])
        return cls(staged, **options) if staged else None

    @property
    def nbytes(self) -> int:
        return 2 * self.half

    def wrap(self, engine: TransferEngine) -> LandingEngine:
        """``engine`` writing the staged tensors through this landing buffer. The wrapper
        moves what ``engine`` does (``memory_kinds_in_use``), plus writes to the staged
        tensors' device types."""
        return LandingEngine(engine, self)

    @property
    def device_types(self) -> frozenset[str]:
        """The device types of the staged tensors (what the wrapped engine now writes to)."""
        return frozenset(device_type(memory_kind(t)) for t in self._tensors)

    def regions(self, regions: Sequence[Region]) -> list[Region]:
        """``regions`` less the staged tensors' ranges, plus the landing buffer."""
        out: list[Region] = []
        for region in regions:
            pieces = [(region.addr, region.addr + region.length)]
            for start, end in zip(self._starts.tolist(), self._ends.tolist()):
                pieces = [p for a, b in pieces for p in ((a, min(b, start)), (max(a, end), b)) if p[0] < p[1]]
            out += [dataclasses.replace(region, addr=a, length=b - a) for a, b in pieces]
        return out + [Region(buf.data_ptr(), self.half) for buf in self._landing]

    def read(self, inner: TransferEngine, session: Session, local: Any, remote: Any, lengths: Any) -> None:
        local = np.asarray(local, np.int64)
        remote, lengths = np.asarray(remote, np.int64), np.asarray(lengths, np.int64)
        which = np.searchsorted(self._starts, local, side="right") - 1
        safe = np.maximum(which, 0)
        inside = (which >= 0) & (local < self._ends[safe])
        if not inside.any():
            inner.read_batch(session, local, remote, lengths)
            return
        if (inside & (local + lengths > self._ends[safe])).any():
            raise RegionError("a destination runs past the end of a staged tensor")
        staged = np.flatnonzero(inside)
        staged = staged[np.argsort(which[staged], kind="stable")]  # one tensor's bytes together in the landing
        s_local, s_remote, s_len, s_tensor = local[staged], remote[staged], lengths[staged], which[staged]
        if (s_len > self.half).any():  # cut what a half cannot hold
            counts = -(-s_len // self.half)
            rep = np.repeat(np.arange(len(s_len)), counts)
            k = np.arange(len(rep), dtype=np.int64) - np.repeat(_exclusive_cumsum(counts), counts)
            s_local, s_remote = s_local[rep] + k * self.half, s_remote[rep] + k * self.half
            s_len, s_tensor = np.minimum(self.half, s_len[rep] - k * self.half), s_tensor[rep]
        direct = np.flatnonzero(~inside)
        ends = np.cumsum(s_len)
        start, turn = 0, 0
        while start < len(s_len):
            base = int(ends[start - 1]) if start else 0
            stop = max(int(np.searchsorted(ends, base + self.half, side="right")), start + 1)
            half = turn % 2
            self._settle(half)  # its last device copy must have read it
            buf = self._landing[half]
            offsets = ends[start:stop] - s_len[start:stop] - base
            dst = buf.data_ptr() + offsets
            if turn == 0 and len(direct):
                inner.read_batch(
                    session, np.concatenate((local[direct], dst)), np.concatenate((remote[direct], s_remote[start:stop])),
                    np.concatenate((lengths[direct], s_len[start:stop])),
                )  # fmt: skip
            else:
                inner.read_batch(session, dst, s_remote[start:stop], s_len[start:stop])
            try:
                self._scatter(buf, offsets, s_local[start:stop], s_len[start:stop], s_tensor[start:stop])
            except Exception as exc:  # noqa: BLE001 - a device error fails the read, not the loop
                raise TransferError(f"host-to-device copy failed: {type(exc).__name__}: {exc}") from exc
            self._used[half] = (self.device.record(self._stream), int(s_len[start:stop].sum()))
            start, turn = stop, turn + 1
        self._settle(0)
        self._settle(1)

    def _settle(self, half: int) -> None:
        """Wait for the device copy reading ``half`` (if any) and count it."""
        used = self._used[half]
        if used is None:
            return
        event, nbytes = used
        self._used[half] = None  # a copy that failed fails this read, once: it is not counted
        if event is not DONE:
            event.synchronize()
        self.landed_bytes += nbytes

    def _scatter(self, buf: Any, offsets: np.ndarray, local: np.ndarray, lengths: np.ndarray, tensor: np.ndarray) -> None:
        """Copy each tensor's run of landed bytes to its place, one indexed copy per tensor."""
        cuts = np.flatnonzero(np.diff(tensor)) + 1
        for a, b in zip(np.concatenate(([0], cuts)).tolist(), np.concatenate((cuts, [len(tensor)])).tolist()):
            j = int(tensor[a])
            rel = local[a:b] - self._starts[j]
            unit = int(np.gcd.reduce(np.concatenate((rel, lengths[a:b]))))
            rows = self._units.get((j, unit))
            if rows is None:
                rows = self._units[j, unit] = byte_rows(self._tensors[j], unit)
            lo, hi = int(offsets[a]), int(offsets[b - 1] + lengths[b - 1])
            ids = _ranges(rel // unit, lengths[a:b] // unit)
            self.device.scatter_from_host(self._stream, buf[lo:hi].view(-1, unit), rows, ids)


class LandingEngine(TransferEngine):
    """A Decode engine whose reads into staged tensors go through a :class:`DecodeLanding`.

    Everything else is the wrapped engine's: its name, capabilities, sessions and errors;
    it moves what that engine moves as configured, plus writes to the staged tensors'
    device types (``memory_kinds_in_use``). ``close`` closes it."""

    def __init__(self, inner: TransferEngine, landing: DecodeLanding) -> None:
        self.inner, self.landing = inner, landing
        self.name = inner.name  # type: ignore[misc]
        self.capabilities = inner.capabilities  # type: ignore[misc]

    @property
    def session_id(self) -> str:
        return self.inner.session_id

    def register(self, regions: Sequence[Region]) -> bytes:
        return self.inner.register(self.landing.regions(regions))

    def connect(self, peer_metadata: bytes) -> Session:
        return self.inner.connect(peer_metadata)

    def connect_legacy(self, p_session: str) -> Session:
        return self.inner.connect_legacy(p_session)

    def read_batch(self, session: Session, local_addrs: Any, remote_addrs: Any, lengths: Any) -> None:
        self.landing.read(self.inner, session, local_addrs, remote_addrs, lengths)

    def memory_kinds_in_use(self) -> MemoryKinds:
        inner = kinds_in_use(self.inner)
        return MemoryKinds(inner.reads_from, inner.writes_to | self.landing.device_types)

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str) -> Any:  # anything else an engine offers (e.g. its own figures)
        return getattr(self.inner, name)
