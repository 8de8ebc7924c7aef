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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rd2h import plugins
from rd2h.errors import ConfigError
from rd2h.layout import LayerLayout, TensorLayout
from rd2h.sink import Destinations, Sink
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
]


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
    elif hasattr(tensor, "ctypes"):  # numpy
        if not tensor.flags.c_contiguous:
            raise ConfigError("array must be C-contiguous")
        addr, nbytes = tensor.ctypes.data, tensor.nbytes
    else:
        raise ConfigError(f"expected a torch tensor or numpy array, got {type(tensor).__name__}")
    if tensor.ndim < 1 or tensor.shape[0] == 0 or nbytes == 0:
        raise ConfigError(f"tensor of shape {tuple(tensor.shape)} has no blocks")
    num_blocks = int(tensor.shape[0])
    block_rows = num_blocks * block_size_scale
    return TensorLayout(addr, nbytes // block_rows, num_blocks, block_size_scale)


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


def _layouts(layers: Mapping[str, LayerTensors | LayerLayout]) -> dict[str, LayerLayout]:
    return {name: t if isinstance(t, LayerLayout) else layer_layout(t) for name, t in layers.items()}


class KVSink:
    """Decode side of one TP rank: binds ``tcp://host:rank_port`` and pulls what Prefill announces.

    Raises PortInUseError at once if the port is taken, BackendNotFoundError /
    BackendUnavailableError for an engine or channel that cannot be loaded.
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
        self.endpoint = DecodeEndpoint(host, base_port(kv_port, dp_rank, tp_size), tp_size)
        layouts = _layouts(layers)
        transfer = plugins.load_engine(engine, "decode", **dict(engine_options or {}))
        try:
            listener = plugins.load_channel(channel, **dict(channel_options or {})).listen(
                f"tcp://{host}:{ports[rank]}"
            )
        except BaseException:
            transfer.close()
            raise
        self._sink = Sink(
            rank=rank, tp_size=tp_size, engine=transfer, listener=listener,
            layers=layouts, accept_legacy=accept_legacy,
        ).start()

    @property
    def address(self) -> str:
        return self._sink.address

    @property
    def runtime(self) -> Sink:
        """The underlying runtime (statistics, counters)."""
        return self._sink

    def expect(self, ext_id: str, main_blocks: Sequence[int], indexer_blocks: Sequence[int] | None = None) -> None:
        """``ext_id`` lands in these destination blocks (in prompt order)."""
        self._sink.expect(ext_id, Destinations.of(main_blocks, indexer_blocks))

    def abort(self, ext_id: str) -> None:
        self._sink.abort(ext_id)

    def wait(self, ext_ids: Sequence[str], timeout: float) -> dict[str, TerminalState]:
        """Block until each request is terminal on this rank; raise TimeoutError otherwise."""
        return self._sink.wait_terminal(ext_ids, timeout)

    def take_terminal(self) -> dict[str, TerminalState]:
        return self._sink.take_terminal()

    def reason(self, ext_id: str) -> str | None:
        """Why a FAILED request failed."""
        return self._sink.reason(ext_id)

    def close(self) -> None:
        self._sink.close()

    def __enter__(self) -> KVSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class KVSource:
    """Prefill side of one TP rank: exposes its cache and announces each layer."""

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
        layouts = _layouts(layers)
        transfer = plugins.load_engine(engine, "prefill", **dict(engine_options or {}))
        try:
            dialer = plugins.load_channel(channel, **dict(channel_options or {})).dialer()
        except BaseException:
            transfer.close()
            raise
        self._source = Source(
            rank=rank, tp_size=tp_size, engine=transfer, dialer=dialer, layers=layouts,
            block_size=block_size, last_layer=last_layer, reply_timeout=reply_timeout,
        ).start()
        self.layer_names = tuple(layouts)

    @property
    def runtime(self) -> Source:
        return self._source

    def add_request(
        self,
        ext_id: str,
        decode: DecodeEndpoint,
        *,
        main_block_ids: Sequence[int],
        indexer_block_ids: Sequence[int] | None = None,
        num_tokens: int,
    ) -> None:
        self._source.add_request(
            ext_id, decode, main_block_ids=main_block_ids, indexer_block_ids=indexer_block_ids, num_tokens=num_tokens
        )

    def schedule(self, computed_tokens: Mapping[str, int]) -> None:
        self._source.schedule(computed_tokens)

    def wait_for_layer_send(self, layer_name: str, timeout: float | None = None) -> None:
        self._source.wait_for_layer_send(layer_name, timeout)

    def layer_ready(self, layer_name: str, event: Any | None = None) -> None:
        self._source.layer_ready(layer_name, event)

    def send_all(self, computed_tokens: Mapping[str, int]) -> None:
        """One step whose KV is already written for every layer: announce all layers."""
        self._source.schedule(computed_tokens)
        for name in self.layer_names:
            self._source.wait_for_layer_send(name)
            self._source.layer_ready(name)

    def wait_finished(self, ext_ids: Sequence[str], timeout: float) -> dict[str, SendResult]:
        return self._source.wait_finished(ext_ids, timeout)

    def take_finished(self) -> dict[str, SendResult]:
        return self._source.take_finished()

    def close(self) -> None:
        self._source.close()

    def __enter__(self) -> KVSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
