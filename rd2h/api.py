"""The standalone API: pull KV layers from Prefill to Decode without vLLM.

Decode side (one per Decode TP rank)::

    with KVSink({"layer.0": LayerTensors(main=[k0, v0], indexer=idx0)}, rank=0, tp_size=1) as sink:
        sink.expect("req-1", main_blocks=[7, 3, 9])
        ...hand sink.endpoint to Prefill...
        sink.wait(["req-1"], timeout=30)

Prefill side (one per Prefill TP rank)::

    with KVSource({"layer.0": LayerTensors(main=[k0, v0], indexer=idx0)}, block_size=16) as source:
        source.add_request("req-1", endpoint, main_block_ids=[0, 1, 2], num_tokens=40)
        source.send_all({"req-1": 40})             # KV already written
        source.wait_finished(["req-1"], timeout=30)

Tensors are torch tensors (cpu, cuda or npu, as the engine allows) or numpy arrays;
dimension 0 indexes blocks and each tensor must be contiguous.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rd2h import plugins
from rd2h.errors import ConfigError
from rd2h.layout import LayerLayout, TensorLayout
from rd2h.sink import Sink
from rd2h.source import DecodeEndpoint, SendResult, Source
from rd2h.topology import base_port, decode_ports
from rd2h.tracking import TerminalState

__all__ = [
    "LayerTensors",
    "KVSink",
    "KVSource",
    "DecodeEndpoint",
    "SendResult",
    "TerminalState",
    "tensor_layout",
    "layer_layout",
    "record_event",
    "host_buffer",
]

log = logging.getLogger("rd2h.api")

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


@contextlib.contextmanager
def _closed_on_error(resource: Any) -> Iterator[None]:
    """Close ``resource`` if the block raises: a failed constructor leaks no port or engine."""
    try:
        yield
    except BaseException:
        resource.close()
        raise


def _layouts(layers: Mapping[str, LayerTensors | LayerLayout]) -> dict[str, LayerLayout]:
    return {name: t if isinstance(t, LayerLayout) else layer_layout(t) for name, t in layers.items()}


class KVSink(Sink):
    """Decode side of one TP rank, built from tensors and backend names, started at once.

    Binds ``tcp://host:rank_port`` (``kv_port + dp_rank * tp_size + rank``) now: raises
    PortInUseError if it is taken, PortError if a port leaves 1..65535,
    BackendNotFoundError / BackendUnavailableError for an engine or channel that cannot
    be loaded. ``endpoint`` is what Prefill needs to reach this Decode instance.
    """

    def __init__(
        self,
        layers: Mapping[str, LayerTensors | LayerLayout],
        *,
        rank: int = 0,
        tp_size: int = 1,
        host: str = "127.0.0.1",
        kv_port: int = 5600,
        dp_rank: int = 0,
        engine: str = "local",
        engine_options: Mapping[str, Any] | None = None,
        channel: str = "zmq",
        channel_options: Mapping[str, Any] | None = None,
        accept_legacy: bool = False,
    ) -> None:
        ports = decode_ports(kv_port, dp_rank, tp_size)  # validates the highest port too
        if not 0 <= rank < tp_size:
            raise ConfigError(f"rank {rank} outside 0..{tp_size - 1}")
        self.endpoint = DecodeEndpoint(host, base_port(kv_port, dp_rank, tp_size), tp_size)
        transfer = plugins.load_engine(engine, "decode", **dict(engine_options or {}))
        with _closed_on_error(transfer):
            listener = plugins.load_channel(channel, **dict(channel_options or {})).listen(
                f"tcp://{host}:{ports[rank]}"
            )
            with _closed_on_error(listener):
                super().__init__(
                    rank=rank, tp_size=tp_size, engine=transfer, listener=listener,
                    layers=_layouts(layers), accept_legacy=accept_legacy,
                )
        self.start()


class KVSource(Source):
    """Prefill side of one TP rank, built from tensors and backend names, started at once."""

    def __init__(
        self,
        layers: Mapping[str, LayerTensors | LayerLayout],
        *,
        block_size: int,
        rank: int = 0,
        tp_size: int = 1,
        engine: str = "local",
        engine_options: Mapping[str, Any] | None = None,
        channel: str = "zmq",
        channel_options: Mapping[str, Any] | None = None,
        last_layer: str | None = None,
        reply_timeout: float = 30.0,
    ) -> None:
        transfer = plugins.load_engine(engine, "prefill", **dict(engine_options or {}))
        with _closed_on_error(transfer):
            dialer = plugins.load_channel(channel, **dict(channel_options or {})).dialer()
            with _closed_on_error(dialer):
                super().__init__(
                    rank=rank, tp_size=tp_size, engine=transfer, dialer=dialer, layers=_layouts(layers),
                    block_size=block_size, last_layer=last_layer, reply_timeout=reply_timeout,
                )
        self.start()
