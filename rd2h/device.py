"""One small stream/event adapter over the accelerators torch supports, for host staging.

Host staging (:mod:`rd2h.staging`) moves KV blocks between an accelerator and host memory
on a copy stream of its own, ordered after the compute that wrote them by an event. CUDA
(``torch.cuda``) and Ascend (``torch.npu``, from torch_npu) expose the same stream and event
API, so one class serves both: :class:`TorchDevice`. :class:`HostStandIn` runs the same
staging code where the "device" side is host tensors: every copy is synchronous and every
event is complete, so CI tests the staging path byte for byte on a CPU.

Every copy here is vectorized: blocks are gathered or scattered by an index tensor in one
call per tensor, never a Python loop per block. torch is imported when an adapter is built,
never at import time.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rd2h.errors import ConfigError

__all__ = ["CopyDevice", "TorchDevice", "HostStandIn", "device_of", "byte_rows"]


class _Done:
    """The event of a synchronous copy: already complete."""

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


DONE = _Done()


class CopyDevice:
    """What staging needs from an accelerator: a copy stream, events, pinned host memory
    and two vectorized copies. Subclasses: :class:`TorchDevice`, :class:`HostStandIn`."""

    name = ""

    def pinned(self, nbytes: int) -> Any:
        """A zeroed uint8 host tensor of ``nbytes`` the device copies to and from at full speed."""
        raise NotImplementedError

    def stream(self) -> Any:
        """A new copy stream."""
        raise NotImplementedError

    def after(self, stream: Any, event: Any | None) -> None:
        """Order ``stream``'s later work after ``event`` (None: nothing to wait for). Does not block."""
        raise NotImplementedError

    def record(self, stream: Any) -> Any:
        """An event that completes when the work queued on ``stream`` so far is done."""
        raise NotImplementedError

    def current_after(self, event: Any | None) -> None:
        """Order the caller's current (compute) stream after ``event``. Does not block."""
        raise NotImplementedError

    def gather_to_host(self, stream: Any, src_rows: Any, ids: np.ndarray, dst_rows: Any) -> None:
        """On ``stream``: ``dst_rows[:len(ids)] = src_rows[ids]`` (device rows to host rows)."""
        raise NotImplementedError

    def scatter_from_host(self, stream: Any, src_rows: Any, dst_rows: Any, ids: np.ndarray) -> None:
        """On ``stream``: ``dst_rows[ids] = src_rows`` (host rows to device rows)."""
        raise NotImplementedError


class TorchDevice(CopyDevice):
    """CUDA or Ascend through ``torch.cuda`` / ``torch.npu``: a gather on the device into
    scratch memory, then one device-to-host copy into pinned memory (and the reverse);
    both on the copy stream, so the compute stream never waits for them."""

    def __init__(self, module: Any, device: Any) -> None:
        import torch

        self._torch, self._mod, self.device = torch, module, device
        self.name = str(device)

    def pinned(self, nbytes: int) -> Any:
        return self._torch.zeros(max(int(nbytes), 1), dtype=self._torch.uint8, pin_memory=True)

    def stream(self) -> Any:
        return self._mod.Stream(device=self.device)

    def after(self, stream: Any, event: Any | None) -> None:
        if event is not None:
            stream.wait_event(event)

    def record(self, stream: Any) -> Any:
        event = self._mod.Event(blocking=True)  # a waiting thread sleeps: none of ours may spin
        event.record(stream)
        return event

    def current_after(self, event: Any | None) -> None:
        if event is not None:
            self._mod.current_stream(self.device).wait_event(event)

    def _index(self, ids: np.ndarray) -> Any:
        # from pageable memory: the copy is done when this returns, so ``ids`` may be reused
        return self._torch.from_numpy(np.ascontiguousarray(ids, np.int64)).to(self.device)

    def gather_to_host(self, stream: Any, src_rows: Any, ids: np.ndarray, dst_rows: Any) -> None:
        n = len(ids)
        if n == 0:
            return
        with self._mod.stream(stream):  # scratch from the copy stream's pool: reused only in its order
            scratch = self._torch.index_select(src_rows, 0, self._index(ids))
            # one copy into pinned rows (contiguous where a slot's layers have equal blocks)
            dst_rows[:n].copy_(scratch, non_blocking=True)

    def scatter_from_host(self, stream: Any, src_rows: Any, dst_rows: Any, ids: np.ndarray) -> None:
        if len(ids) == 0:
            return
        with self._mod.stream(stream):
            scratch = src_rows.to(self.device, non_blocking=True)
            dst_rows.index_copy_(0, self._index(ids), scratch)


class HostStandIn(CopyDevice):
    """The device side is host memory: the same staging code, synchronous copies, every
    event complete. What CI runs; also what a CPU-only build of a device deployment runs."""

    name = "host stand-in"

    def pinned(self, nbytes: int) -> Any:
        import torch

        from rd2h.tensors import host_buffer

        return torch.from_numpy(host_buffer(max(int(nbytes), 1)))  # page-aligned, pre-faulted

    def stream(self) -> Any:
        return None

    def after(self, stream: Any, event: Any | None) -> None:
        if event is not None:
            event.synchronize()

    def record(self, stream: Any) -> Any:
        return DONE

    def current_after(self, event: Any | None) -> None:
        if event is not None:
            event.synchronize()

    def gather_to_host(self, stream: Any, src_rows: Any, ids: np.ndarray, dst_rows: Any) -> None:
        import torch

        n = len(ids)
        if n:
            torch.index_select(src_rows, 0, torch.from_numpy(np.ascontiguousarray(ids, np.int64)), out=dst_rows[:n])

    def scatter_from_host(self, stream: Any, src_rows: Any, dst_rows: Any, ids: np.ndarray) -> None:
        import torch

        if len(ids):
            dst_rows.index_copy_(0, torch.from_numpy(np.ascontiguousarray(ids, np.int64)), src_rows)


def device_of(tensor: Any, *, stand_in: bool = False) -> CopyDevice:
    """The adapter for the device ``tensor`` lives on: CUDA, Ascend NPU, or (a CPU tensor,
    or ``stand_in``) the host stand-in. Raises ConfigError for another device type, or an
    NPU tensor without torch_npu."""
    kind = getattr(getattr(tensor, "device", None), "type", "cpu")
    if stand_in or kind == "cpu":
        return HostStandIn()
    import torch

    if kind == "cuda":
        return TorchDevice(torch.cuda, tensor.device)
    if kind == "npu":
        try:
            import torch_npu  # noqa: F401 - registers torch.npu
        except ImportError as exc:
            raise ConfigError("an NPU tensor needs torch_npu: pip install torch-npu") from exc
        return TorchDevice(torch.npu, tensor.device)  # type: ignore[attr-defined]
    raise ConfigError(f"host staging supports cuda and npu tensors, not {kind!r}")


def byte_rows(tensor: Any, row_bytes: int | None = None) -> Any:
    """A uint8 view of a torch ``tensor`` whose dimension 0 indexes blocks, one row per
    block (``[num_blocks, block_bytes]``, keeping the tensor's block stride), or, with
    ``row_bytes``, its bytes from the first block cut into rows of that many bytes (the
    whole rows only). A view, never a copy: writing it writes the tensor. Raises
    ConfigError for a tensor whose blocks are not contiguous (``rd2h.tensors.tensor_layout``)."""
    import torch

    from rd2h.tensors import tensor_layout

    layout = tensor_layout(tensor)
    raw = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    storage = tensor.untyped_storage()
    raw.set_(storage, 0, (storage.nbytes(),), (1,))
    offset = tensor.storage_offset() * tensor.element_size()
    if row_bytes is None:
        return raw.as_strided((layout.num_blocks, layout.block_bytes), (layout.stride, 1), offset)
    return raw.as_strided((layout.nbytes // row_bytes, row_bytes), (row_bytes, 1), offset)

