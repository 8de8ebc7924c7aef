"""Where one Prefill rank sends each of its layers for one Decode endpoint (pure).

A Decode without pipeline parallel holds every layer: each of the Decode ranks the TP
mapping gives this Prefill rank gets every layer, and the final signal with the Prefill's
last layer. A Decode run with pipeline parallel (``DecodeEndpoint.stages``) holds layers
``[n0 + ... + n(s-1), ... + ns)`` of the model on stage ``s``, whose ranks listen from their own
base port: this rank sends a layer only to the stage that holds it, and each stage gets its
final signal with the last layer sent to it. A stage holding none of this rank's layers is
not contacted at all. Layers are matched by their index in the model (``model_layers``, one
per local layer in announce order), since a Prefill stage holds only some of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rd2h.errors import ConfigError
from rd2h.layout.topology import Topology
from rd2h.wire.endpoint import DecodeEndpoint

__all__ = ["Route", "stage_routes"]


@dataclass(frozen=True, slots=True)
class Route:
    """One Decode rank's address; ``layers``: the local layer indices it gets (None: all of
    them) and ``last``, the one whose readiness carries the final signal (None: the source's)."""

    address: str
    layers: frozenset[int] | None = None
    last: int | None = None


def stage_routes(decode: DecodeEndpoint, p_rank: int, p_tp: int, model_layers: Sequence[int] | None) -> list[Route]:
    """The routes of Prefill rank ``p_rank`` of ``p_tp`` to ``decode``. Raises TopologyError
    for TP sizes that do not divide, ConfigError for a staged Decode without ``model_layers``
    or with layers outside its stages, PortError for a port outside 1..65535."""
    ranks = Topology(p_tp, decode.tp_size).decode_ranks_of(p_rank)
    if not decode.stages:
        return [Route(decode.address(d)) for d in ranks]
    if model_layers is None:
        raise ConfigError(
            f"Decode {decode} runs pipeline parallel: this Prefill must know each layer's index in the model "
            "(model_layers) to send it to the stage that holds it"
        )
    total = sum(decode.stages)
    outside = sorted({m for m in model_layers if not 0 <= m < total})
    if outside:
        raise ConfigError(f"Decode {decode} holds model layers 0..{total - 1}; this Prefill has layers {outside[:5]}")
    routes: list[Route] = []
    start = 0
    for stage, count in enumerate(decode.stages):
        local = frozenset(i for i, m in enumerate(model_layers) if start <= m < start + count)
        start += count
        if local:
            endpoint = decode.stage(stage)
            routes.extend(Route(endpoint.address(d), local, max(local)) for d in ranks)
    return routes
