"""The memory-kind cases of the transfer-engine conformance suite (mixed into
``EngineConformance``; see ``rd2h.testing.engine_suite`` for the hooks).

Two kinds of case:

- on every machine: the engine declares ``memory_kinds()`` well formed, and refuses at
  registration a region of a device type it does not declare, with a ``TransferError``
  naming the kind. The region is host memory labelled with that kind: the refusal must come
  from the capability check, before any native call could touch the memory;
- where a device is: for every device type the engine moves as configured for the suite
  (``memory_kinds_in_use``, and ``memory_kinds_for`` the peer's options), a read from a peer whose
  regions are on that device (``reads_from``) and a read into destinations on it
  (``writes_to``), every byte compared. Without such a device, or without torch to allocate
  there, these skip with the reason.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import pytest

from rd2h.engine_support import kinds_for_options, kinds_in_use
from rd2h.errors import TransferError
from rd2h.interfaces import MemoryKinds, Region, TransferEngine
from rd2h.layout.regions import device_type
from rd2h.testing.engine_kit import SENTINEL, Reader, _assert_bytes, _image, _within, device_missing, device_tensor
from rd2h.testing.peer import PeerProcess

__all__ = ["DeviceCases", "DEVICE_TYPES"]

DEVICE_TYPES = ("cuda", "npu")  # the device types the device cases know how to allocate on
FAKE = "rd2hfake"  # a device type no engine declares


class DeviceCases:
    """Memory-kind cases; the attributes and helpers come from ``EngineConformance``."""

    engine_name: ClassVar[str]
    reader_role: ClassVar[str]
    failure_bound_s: ClassVar[float]
    block_len: ClassVar[int]

    # -- on every machine ------------------------------------------------------------------

    def test_declares_memory_kinds(self, reader: Reader) -> None:
        kinds = type(reader.engine).memory_kinds()
        assert isinstance(kinds, MemoryKinds), f"memory_kinds() returned {kinds!r}"
        for side in (kinds.reads_from, kinds.writes_to):
            assert all(isinstance(k, str) and ":" not in k for k in side), f"device types, not kinds: {side}"
        assert kinds == type(reader.engine).memory_kinds(), "memory_kinds() must answer the same every time"

    @pytest.mark.parametrize("kind", [*DEVICE_TYPES, FAKE])
    def test_refuses_memory_it_does_not_move(self, reader: Reader, kind: str) -> None:
        kinds = kinds_in_use(reader.engine).for_role(self.reader_role)  # as configured for the suite
        if kind in kinds:
            pytest.skip(f"{self.engine_name} as configured moves {kind} memory as {self.reader_role}")
        labelled = Region(reader.addr, 4096, f"{kind}:0")  # host memory: refused before anything touches it
        exc, _ = _within(self.failure_bound_s, lambda: reader.engine.register([labelled]))
        assert isinstance(exc, TransferError), f"registering {kind}:0 memory should raise TransferError, got {exc!r}"
        assert f"{kind}:0" in str(exc), f"the refusal should name the kind: {exc}"
        reader.engine.register([Region(reader.addr, 4096)])  # the engine goes on registering host memory

    # -- where a device is -----------------------------------------------------------------

    def _need_device(self, engine: TransferEngine, kind: str, side: str) -> None:
        """Skip unless the engine as configured for the suite moves ``kind`` memory on ``side``
        (``memory_kinds_in_use``; for ``reads_from`` the peer's options count too: the peer
        registers that memory) and such a device is here."""
        kinds = [kinds_in_use(engine)]
        if side == "reads_from":
            peer_options = self.engine_options_for(self.peer_role)  # type: ignore[attr-defined]
            kinds.append(kinds_for_options(type(engine), peer_options))
        moved = frozenset.intersection(*(getattr(k, side) for k in kinds))
        name = f"{self.engine_name} as configured"
        if kind not in moved:
            pytest.skip(f"{name} does not move {kind} memory in {side} ({sorted(moved)})")
        missing = device_missing(kind)
        if missing:
            pytest.skip(f"{name} moves {kind} memory in {side}, but it cannot be tried here: {missing}")

    @pytest.mark.parametrize("kind", DEVICE_TYPES)
    def test_reads_a_peer_whose_regions_are_on_a_device(self, reader: Reader, kind: str) -> None:
        self._need_device(reader.engine, kind, "reads_from")
        with self.start_peer(seed=5, memory=f"{kind}:0") as peer:  # type: ignore[attr-defined]
            session = reader.engine.connect(peer.metadata)
            try:
                count = min(len(reader.dest), sum(peer.sizes) // 2) // self.block_len
                descs = self.blocks(peer, count, seed=80)  # type: ignore[attr-defined]
                end = count * self.block_len
                descs += [(end, 0, 0, 512), (end + 512, 1, peer.sizes[1] - 512, 512)]  # the regions' edges
                self.read(reader, session, peer, descs)  # type: ignore[attr-defined]
                what = f"{count} blocks and two region edges from {kind}:0 memory"
                self.check(reader, peer, descs, what)  # type: ignore[attr-defined]
            finally:
                session.close()

    @pytest.mark.parametrize("kind", DEVICE_TYPES)
    def test_writes_destinations_on_a_device(self, reader: Reader, peer: PeerProcess, kind: str) -> None:
        self._need_device(reader.engine, kind, "writes_to")
        from rd2h.tensors import memory_kind

        size = len(reader.dest) // 2
        dest: Any = device_tensor(np.full(size, SENTINEL, np.uint8), f"{kind}:0")
        assert memory_kind(dest) == f"{kind}:0" and device_type(memory_kind(dest)) == kind
        reader.keep.append(dest)  # registered for the engine's life: never freed before it
        reader.engine.register([Region(dest.data_ptr(), size, memory_kind(dest))])
        session = reader.engine.connect(peer.metadata)
        try:
            descs = self.blocks(peer, size // self.block_len // 2, seed=90)  # type: ignore[attr-defined]
            base = np.array([dest.data_ptr()], dtype=np.int64)
            d = np.array(descs, dtype=np.int64).reshape(-1, 4)
            starts = np.array([a for a, _ in peer.regions], dtype=np.int64)
            reader.engine.read_batch(session, base + d[:, 0], starts[d[:, 1]] + d[:, 2], d[:, 3].copy())
            got = dest.cpu().numpy()
            _assert_bytes(got, _image(reader, peer, descs, 0, size), f"{len(descs)} blocks into {kind}:0 memory")
        finally:
            session.close()
