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
from rd2h.layout.layers import LayerLayout, LayoutTag, TensorLayout
from rd2h.layout.regions import HOST, check_memory_kind

__all__ = [
    "LayerTensors", "memory_kind", "tensor_layout", "layout_tag", "layer_layout", "record_event", "host_buffer",
]  # fmt: skip

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

    def all_tensors(self) -> list[Any]:
        """Every tensor of the layer: the main ones, then the indexer and the scale where set."""
        return [t for t in (*self.main, self.indexer, self.scale) if t is not None]


def memory_kind(tensor: Any) -> str:
    """What memory ``tensor`` lives in: ``"host"`` for a numpy array or a CPU torch tensor,
    ``"<device type>:<index>"`` from a torch tensor's device otherwise (``"cuda:0"``,
    ``"npu:3"``).

    Raises ConfigError for something that is neither, or a device without an index.
    """
    if hasattr(tensor, "data_ptr") and hasattr(tensor, "device"):  # torch
        device = tensor.device
        kind, index = str(getattr(device, "type", "")), getattr(device, "index", None)
        if kind == "cpu":
            return HOST
        if type(index) is not int:
            raise ConfigError(f"a tensor on device {device} has no device index: rd2h cannot tell which memory it is")
        try:
            return check_memory_kind(f"{kind}:{index}", f"the device of a tensor ({device})")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    if hasattr(tensor, "ctypes") and hasattr(tensor, "__array_interface__"):  # numpy
        return HOST
    raise ConfigError(f"expected a torch tensor or numpy array, got {type(tensor).__name__}")


def tensor_layout(tensor: Any, block_size_scale: int = 1) -> TensorLayout:
    """The layout of a tensor whose dimension 0 indexes blocks.

    Each block (``tensor[i]``) must be contiguous; the blocks need not be adjacent: where
    ``stride(0)`` exceeds a block's bytes (padded pages, or block-outermost views of one big
    allocation) the layout gets that ``block_stride`` and only the blocks' bytes move.
    Accepts torch tensors (``data_ptr``) and numpy arrays (``ctypes.data``); the layout's
    ``kind`` is the tensor's :func:`memory_kind`. Raises ConfigError for an empty tensor, a block that is not contiguous, blocks that overlap or
    run backwards, or a block whose bytes do not split into ``block_size_scale`` rows.
    """
    if hasattr(tensor, "data_ptr"):  # torch
        addr, itemsize, kind = tensor.data_ptr(), tensor.element_size(), memory_kind(tensor)
        strides = tuple(s * itemsize for s in tensor.stride())
    elif hasattr(tensor, "ctypes"):  # numpy
        addr, itemsize, kind = tensor.ctypes.data, tensor.itemsize, HOST
        strides = tuple(tensor.strides)
    else:
        raise ConfigError(f"expected a torch tensor or numpy array, got {type(tensor).__name__}")
    shape = tuple(int(n) for n in tensor.shape)
    block_elems = int(np.prod(shape[1:], dtype=np.int64))
    if not shape or shape[0] == 0 or block_elems == 0:
        raise ConfigError(f"tensor of shape {shape} has no blocks")
    if not _dense(shape[1:], strides[1:], itemsize):
        raise ConfigError(
            f"each block of a tensor of shape {shape} and byte strides {strides} must be "
            "contiguous: dimension 0 indexes blocks and only it may step over padding"
        )
    num_blocks, block_bytes = shape[0], block_elems * itemsize
    step = strides[0] if num_blocks > 1 else block_bytes  # one block: its stride means nothing
    if step < block_bytes:
        raise ConfigError(
            f"blocks of a tensor of shape {shape} overlap or run backwards: stride(0) is {step} bytes, "
            f"a block is {block_bytes}"
        )
    if block_bytes % block_size_scale:
        raise ConfigError(f"a block of {block_bytes} bytes does not split into {block_size_scale} rows")
    if addr % _ALIGNMENT:
        log.warning(
            "tensor at %#x is not %d-byte aligned: transfers into or out of it run at about half "
            "speed; allocate it with rd2h.api.host_buffer (or torch)", addr, _ALIGNMENT,
        )
    return TensorLayout(
        addr, block_bytes // block_size_scale, num_blocks, block_size_scale, kind, block_stride=step
    )


def _dense(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> bool:
    """Whether a C-order array of ``shape`` with these byte strides has no gaps
    (dimensions of size 1 may have any stride, as torch and numpy both allow)."""
    expected = itemsize
    for n, stride in zip(reversed(shape), reversed(strides)):
        if n != 1 and stride != expected:
            return False
        expected *= n
    return True


def layout_tag(tensor: Any, *, block_tokens: int = 0, name: str = "") -> LayoutTag | None:
    """What a torch tensor's blocks hold: its dtype name (``"bfloat16"``), the shape of one
    block (``shape[1:]``), and ``block_tokens`` and the layout ``name`` as given (0 and ""
    are not stated). None for anything else: a numpy array is usually raw bytes standing
    for another layout, and a tag from it would refuse a good peer."""
    if not hasattr(tensor, "data_ptr"):
        return None
    dtype = str(tensor.dtype).removeprefix("torch.")
    return LayoutTag(dtype, tuple(int(n) for n in tensor.shape[1:]), block_tokens, name)


def host_buffer(shape: int | tuple[int, ...], dtype: Any = np.uint8, *, shared: bool = False) -> np.ndarray:
    """A zeroed, page-aligned host array with every page already faulted in.

    For destinations and sources on the host: page alignment keeps copies at full speed
    (numpy's own arrays are only 16-byte aligned), and pre-faulting keeps first-touch page
    faults out of the first transfer. The memory lives as long as the array.

    Private memory, on transparent huge pages where the kernel offers them (``MADV_HUGEPAGE``,
    2 MiB aligned), unless ``shared``: a ``fork``ed child then sees the same bytes, on 4 KiB
    shmem pages. Huge pages are the biggest lever on copy speed found here: a 1-thread
    ``process_vm_readv`` out of them runs 1.5-1.7x faster than out of shared memory
    (``docs/performance.md``).
    """
    dtype = np.dtype(dtype)
    count = int(np.prod(shape))
    nbytes = max(count * dtype.itemsize, 1)
    if shared:
        array = np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)
    else:
        array = _huge_page_array(nbytes)
    array[:: mmap.PAGESIZE] = 0  # a write per page: faulted in, still zero
    return array[: count * dtype.itemsize].view(dtype).reshape(shape)


_HUGE_PAGE = 2 << 20


def _huge_page_array(nbytes: int) -> np.ndarray:
    """Private anonymous memory of ``nbytes``, starting on a 2 MiB boundary when it is at
    least that big (the kernel aligns only mappings whose size is a multiple of 2 MiB), and
    advised to use huge pages before any page is touched."""
    extra = _HUGE_PAGE if nbytes >= _HUGE_PAGE else 0
    memory = mmap.mmap(-1, nbytes + extra, flags=mmap.MAP_PRIVATE)
    whole = np.frombuffer(memory, dtype=np.uint8)
    start = -whole.ctypes.data % _HUGE_PAGE if extra else 0
    if extra and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            memory.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
        except OSError:  # a kernel without THP: 4 KiB pages, still private
            pass
    return whole[start : start + nbytes]


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


def layer_layout(
    tensors: LayerTensors, *, block_tokens: int = 0, layout_name: str = "", tag: bool = True
) -> LayerLayout:
    """The :class:`LayerLayout` of a layer's tensors.

    Tagged (``layout_tag``) from the first main tensor when it is a torch tensor, with
    ``block_tokens`` and ``layout_name`` when given; ``tag=False`` leaves it untagged, e.g. for
    a byte pool that holds the peer's layout as raw bytes. Raises what ``tensor_layout`` raises.
    """
    main = tuple(tensors.main)
    return LayerLayout(
        tuple(tensor_layout(t) for t in main),
        None if tensors.indexer is None else tensor_layout(tensors.indexer),
        None if tensors.scale is None else tensor_layout(tensors.scale),
        tag=layout_tag(main[0], block_tokens=block_tokens, name=layout_name) if tag and main else None,
    )
