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
dimension 0 indexes blocks and each block must be one dense page (a contiguous tensor, or a
strided view whose blocks are contiguous: see ``rd2h.tensors.tensor_layout``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from rd2h import plugins
from rd2h.clock import Clock, monotonic
from rd2h.decode.peer_limits import PeerLimits
from rd2h.decode.sink import MainSplit, Sink
from rd2h.errors import ConfigError
from rd2h.layout.layers import LayerLayout
from rd2h.layout.topology import base_port, decode_ports
from rd2h.outcome import Outcome, TerminalState
from rd2h.prefill.source import DecodeEndpoint, Source
from rd2h.staging.decode_landing import DecodeLanding
from rd2h.staging.prefill_mirror import PrefillMirror, StagedSource
from rd2h.tensors import LayerTensors, host_buffer, layer_layout, memory_kind, record_event, tensor_layout

__all__ = [
    "LayerTensors",
    "KVSink",
    "KVSource",
    "DecodeEndpoint",
    "TerminalState",
    "Outcome",
    "MainSplit",
    "PeerLimits",
    "memory_kind",
    "tensor_layout",
    "layer_layout",
    "record_event",
    "host_buffer",
    "PrefillMirror",
    "StagedKVSource",
    "DecodeLanding",
]

log = logging.getLogger("rd2h.api")

_WILDCARDS = ("0.0.0.0", "::", "*", "")

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
    be loaded. ``endpoint`` is what Prefill needs to reach this Decode instance: it names
    ``advertise_host`` (default ``host``), so a sink may bind ``0.0.0.0`` and advertise the
    address peers route to. ``main_split``, ``request_timeout``, ``peer_limits``: see
    :class:`~rd2h.decode.sink.Sink`. The zmq channel refuses a host other than loopback without
    CurveZMQ keys in ``channel_options`` unless they say ``allow_insecure=True``
    (docs/security.md). ``landing``: device destinations the engine cannot write are read
    into its host buffer and copied to the device (:class:`DecodeLanding`).
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
        advertise_host: str | None = None,
        main_split: MainSplit | str = MainSplit.SHARED,
        request_timeout: float | None = 300.0,
        peer_limits: PeerLimits | None = None,
        landing: DecodeLanding | None = None,
    ) -> None:
        ports = decode_ports(kv_port, dp_rank, tp_size)  # validates the highest port too
        if not 0 <= rank < tp_size:
            raise ConfigError(f"rank {rank} outside 0..{tp_size - 1}")
        advertised = host if advertise_host is None else advertise_host
        if advertised in _WILDCARDS:
            raise ConfigError(
                f"host {host!r} binds every interface but names none a peer can reach: "
                "give advertise_host, the address Prefill should dial"
            )
        self.endpoint = DecodeEndpoint(advertised, base_port(kv_port, dp_rank, tp_size), tp_size)
        transfer = plugins.load_engine(engine, "decode", **dict(engine_options or {}))
        if landing is not None:  # device destinations through host staging (rd2h.staging)
            transfer = landing.wrap(transfer)
        with _closed_on_error(transfer):
            listener = plugins.load_channel(channel, **dict(channel_options or {})).listen(
                f"tcp://{host}:{ports[rank]}"
            )
            with _closed_on_error(listener):
                super().__init__(
                    rank=rank, tp_size=tp_size, engine=transfer, listener=listener,
                    layers=_layouts(layers), accept_legacy=accept_legacy,
                    main_split=main_split, request_timeout=request_timeout, peer_limits=peer_limits,
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
        indexer_block_size: int | None = None,
        inline_announce: bool = True,
        reuse_slots: bool = True,
        clock: Clock = monotonic,
        endpoint_idle_seconds: float = 300.0,
        max_endpoints: int = 256,
        pp_rank: int = 0,
        pp_size: int = 1,
        model_layers: Sequence[int] | None = None,
    ) -> None:
        transfer = plugins.load_engine(engine, "prefill", **dict(engine_options or {}))
        with _closed_on_error(transfer):
            dialer = plugins.load_channel(channel, **dict(channel_options or {})).dialer()
            with _closed_on_error(dialer):
                super().__init__(
                    rank=rank, tp_size=tp_size, engine=transfer, dialer=dialer, layers=_layouts(layers),
                    block_size=block_size, last_layer=last_layer, reply_timeout=reply_timeout,
                    indexer_block_size=indexer_block_size, inline_announce=inline_announce,
                    reuse_slots=reuse_slots, clock=clock, endpoint_idle_seconds=endpoint_idle_seconds,
                    max_endpoints=max_endpoints, pp_rank=pp_rank, pp_size=pp_size, model_layers=model_layers,
                )
        self.start()


class StagedKVSource(StagedSource, KVSource):
    """A :class:`KVSource` over device tensors an engine cannot read: built with
    ``mirror=PrefillMirror(layers, blocks_per_slot=...)`` in place of ``layers``, otherwise
    the same options; the engine registers the mirror (:mod:`rd2h.staging.prefill_mirror`)."""
