"""Layouts of torch tensors and numpy arrays, and host memory to hold them.

Used by the standalone API (``rd2h.api`` re-exports everything here) and by anyone who
builds ``LayerLayout`` objects from tensors. torch is never imported here except for a
device event: a tensor is recognised by its methods.
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rd2h.errors import ConfigError
from rd2h.layout import LayerLayout, TensorLayout

__all__ = ["LayerTensors", "tensor_layout", "layer_layout", "record_event", "host_buffer"]

log = logging.getLogger("rd2h.tensors")

# Copies into or out of memory that is not 64-byte aligned run at about half speed (measured
# with process_vm_readv here: 2.3-2.5 GB/s at a 16-byte offset, 4-5 GB/s at 0 or 64). numpy
# aligns large arrays to 16 bytes only; torch to 64.
_ALIGNMENT = 64


@dataclass(frozen=True)
class LayerTensors:
    """The tensors of one layer: main K/V (one or more), optional indexer and LIC8 scale."""

    main: Sequence[Any]
    indexer: Any | None = None
    scale: Any | None = None


def tensor_layout(tensor: Any, block_size_scale: int = 1) -> TensorLayout:
    """The layout of a contiguous tensor whose dimension 0 indexes blocks.

    Accepts torch tensors (``data_ptr``) and numpy arrays (``ctypes.data``); raises
    ConfigError for a non-contiguous or empty tensor.
    """
    if hasattr(tensor, "data_ptr"):  # torch
        if not tensor.is_contiguous():
            raise ConfigError("tensor must be contiguous (call .contiguous() once at allocation)")
        addr, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        device = tensor.device.type
    elif hasattr(tensor, "ctypes"):  # numpy
        if not tensor.flags.c_contiguous:
            raise ConfigError("array must be C-contiguous")
        addr, nbytes, device = tensor.ctypes.data, tensor.nbytes, "cpu"
    else:
        raise ConfigError(f"expected a torch tensor or numpy array, got {type(tensor).__name__}")
    if tensor.ndim < 1 or tensor.shape[0] == 0 or nbytes == 0:
        raise ConfigError(f"tensor of shape {tuple(tensor.shape)} has no blocks")
    if addr % _ALIGNMENT:
        log.warning(
            "tensor at %#x is not %d-byte aligned: transfers into or out of it run at about half "
            "speed; allocate it with rd2h.api.host_buffer (or torch)", addr, _ALIGNMENT,
        )
    num_blocks = int(tensor.shape[0])
    block_rows = num_blocks * block_size_scale
    return TensorLayout(addr, nbytes // block_rows, num_blocks, block_size_scale, device)


def host_buffer(shape: int | tuple[int, ...], dtype: Any = np.uint8) -> np.ndarray:
    """A zeroed, page-aligned host array with every page already faulted in.

    For destinations and sources on the host: page alignment keeps copies at full speed
    (numpy's own arrays are only 16-byte aligned), and pre-faulting keeps first-touch page
    faults out of the first transfer. The memory lives as long as the array.
    """
    dtype = np.dtype(dtype)
    count = int(np.prod(shape))
    nbytes = max(count * dtype.itemsize, 1)
    array = np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)
    array[:: mmap.PAGESIZE] = 0  # a write per page: faulted in, still zero
    return array[: count * dtype.itemsize].view(dtype).reshape(shape)


def record_event(tensor: Any) -> Any | None:
    """An event recorded on the tensor's device stream now, for ``layer_ready``.

    CUDA: ``torch.cuda.Event``; Ascend NPU: ``torch.npu.Event`` (torch_npu is imported only
    then); CPU tensors and numpy arrays are written synchronously, so ``None`` (complete).
    """
    device = getattr(getattr(tensor, "device", None), "type", "cpu")
    if device == "cuda":
        import torch

        event = torch.cuda.Event()
    elif device == "npu":
        try:
            import torch_npu  # noqa: F401 - registers torch.npu
        except ImportError as exc:
            raise ConfigError("an NPU tensor needs torch_npu: pip install torch-npu") from exc
        import torch

        event = torch.npu.Event()
    else:
        return None
    event.record()
    return event


def layer_layout(tensors: LayerTensors) -> LayerLayout:
    """The :class:`LayerLayout` of a layer's tensors."""
    return LayerLayout(
        tuple(tensor_layout(t) for t in tensors.main),
        None if tensors.indexer is None else tensor_layout(tensors.indexer),
        None if tensors.scale is None else tensor_layout(tensors.scale),
    )
