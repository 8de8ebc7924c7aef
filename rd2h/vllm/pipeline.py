"""Pipeline parallel: which layers each stage holds, and where a stage's layers come from (pure).

vLLM splits a model's layers into ``pipeline_parallel_size`` contiguous stages: evenly, the
remainder going to the stages before the last, or as ``VLLM_PP_LAYER_PARTITION`` says
(``vllm.distributed.utils.get_pp_indices``). Each stage's workers hold only that stage's
layers in their KV cache, and Prefill and Decode may split differently (other stage
counts, another partition). So a Decode stage pulls each of its layers from the Prefill
stage that computed it, and a Prefill stage announces each of its layers only to the
Decode stage that holds it: :func:`pulls` and :func:`sends` are the two views of one table.

Ports carry the stage: vLLM orders a DP engine's ranks DP x PP x TP, and so do rd2h's
control ports (:func:`stage_base_port`); with one stage they are the ports rd2h binds today.

What runs today does not need this table: a Prefill stage announces the layers it holds to
a Decode without pipeline parallel, which holds them all, and Decode completes a request from
the stages' final signals (:mod:`rd2h.decode.receive_tracker`). This module is the arithmetic
for pipeline parallel on Decode, which rd2h refuses at startup (:mod:`rd2h.vllm.parallel`)
until a Prefill routes each layer to the Decode stage holding it (:func:`sends`) and a Decode
stage binds ports of its own (:func:`stage_base_port`); its tests hold it to vLLM's objects.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from rd2h.errors import ConfigError
from rd2h.layout.topology import base_port

__all__ = ["StageSplit", "pulls", "sends", "stage_base_port", "layer_index"]

_INT = re.compile(r"(?:^|\.)(\d+)(?=\.|$)")


@dataclass(frozen=True, slots=True)
class StageSplit:
    """A model's layers over pipeline stages: ``counts[s]`` layers in stage ``s``, in order.

    Raises ConfigError for no stage or a stage without layers (vLLM gives every stage one).
    """

    counts: tuple[int, ...]

    def __post_init__(self) -> None:
        counts = tuple(self.counts)
        if not counts or any(type(c) is not int or c < 1 for c in counts):
            raise ConfigError(f"a pipeline split needs one or more stages of at least one layer each, got {counts!r}")
        object.__setattr__(self, "counts", counts)

    @classmethod
    def of(cls, num_layers: int, pp_size: int, partition: str | None = None) -> StageSplit:
        """vLLM's split of ``num_layers`` over ``pp_size`` stages; ``partition`` is the engine's
        ``VLLM_PP_LAYER_PARTITION`` (``"3,5"``), None for vLLM's even split. Raises
        ConfigError where vLLM would refuse (a partition of another length or sum), or where
        a stage would get no layer."""
        if type(num_layers) is not int or type(pp_size) is not int or pp_size < 1 or num_layers < pp_size:
            raise ConfigError(f"cannot split {num_layers!r} layers over {pp_size!r} pipeline stages")
        if partition is not None:
            try:
                counts = tuple(int(part) for part in partition.split(","))
            except ValueError:
                raise ConfigError(f"VLLM_PP_LAYER_PARTITION {partition!r} is not a list of layer counts") from None
            if len(counts) != pp_size or sum(counts) != num_layers:
                raise ConfigError(
                    f"VLLM_PP_LAYER_PARTITION {partition!r} does not split {num_layers} layers over {pp_size} stages"
                )
            return cls(counts)
        each, left = divmod(num_layers, pp_size)
        counts_list = [each] * pp_size
        for i in range(2, left + 2):  # the remainder goes to the stages before the last
            counts_list[-i] += 1
        return cls(tuple(counts_list))

    @property
    def pp_size(self) -> int:
        return len(self.counts)

    @property
    def num_layers(self) -> int:
        return sum(self.counts)

    def layers(self, stage: int) -> range:
        """The layer indices stage ``stage`` holds. Raises ConfigError for a stage out of range."""
        if type(stage) is not int or not 0 <= stage < self.pp_size:
            raise ConfigError(f"pipeline stage {stage!r} outside 0..{self.pp_size - 1}")
        start = sum(self.counts[:stage])
        return range(start, start + self.counts[stage])

    def stage_of(self, layer: int) -> int:
        """The stage holding layer ``layer``. Raises ConfigError for a layer out of range."""
        if type(layer) is not int or not 0 <= layer < self.num_layers:
            raise ConfigError(f"layer {layer!r} outside 0..{self.num_layers - 1}")
        end = 0
        for stage, count in enumerate(self.counts):
            end += count
            if layer < end:
                return stage
        raise AssertionError("unreachable")  # pragma: no cover


def _overlaps(mine: range, theirs: StageSplit) -> dict[int, range]:
    found: dict[int, range] = {}
    for stage in range(theirs.pp_size):
        other = theirs.layers(stage)
        lo, hi = max(mine.start, other.start), min(mine.stop, other.stop)
        if lo < hi:
            found[stage] = range(lo, hi)
    return found


def _same_model(prefill: StageSplit, decode: StageSplit) -> None:
    if prefill.num_layers != decode.num_layers:
        raise ConfigError(
            f"Prefill's stages hold {prefill.num_layers} layers and Decode's {decode.num_layers}: not the same model"
        )


def pulls(prefill: StageSplit, decode: StageSplit, decode_stage: int) -> dict[int, range]:
    """Prefill stage -> the layers Decode stage ``decode_stage`` pulls from it (only stages
    that computed some of its layers; the ranges tile the Decode stage's layers). Raises
    ConfigError for splits of different models or a stage out of range."""
    _same_model(prefill, decode)
    return _overlaps(decode.layers(decode_stage), prefill)


def sends(prefill: StageSplit, decode: StageSplit, prefill_stage: int) -> dict[int, range]:
    """Decode stage -> the layers Prefill stage ``prefill_stage`` announces to it (only stages
    that hold some of its layers; the ranges tile the Prefill stage's layers). Raises
    ConfigError as :func:`pulls` does."""
    _same_model(prefill, decode)
    return _overlaps(prefill.layers(prefill_stage), decode)


def stage_base_port(kv_port: int, dp_index: int, tp_size: int, pp_size: int, pp_rank: int) -> int:
    """The first control port of one pipeline stage of one DP engine:
    ``kv_port + (dp_index * pp_size + pp_rank) * tp_size``; its TP rank ``r`` binds ``+ r``.
    With ``pp_size`` 1 this is :func:`~rd2h.layout.topology.base_port`. Raises ConfigError
    for a stage out of range, PortError (from ``base_port``) outside 1..65535."""
    if type(pp_size) is not int or pp_size < 1 or type(pp_rank) is not int or not 0 <= pp_rank < pp_size:
        raise ConfigError(f"pipeline stage {pp_rank!r} outside 0..{pp_size!r} - 1")
    return base_port(kv_port, dp_index * pp_size + pp_rank, tp_size)


def layer_index(name: str) -> int:
    """The model layer a vLLM attention layer name belongs to (``model.layers.3.self_attn.attn``
    -> 3), as vLLM reads it (its ``extract_layer_index`` for one attention module per layer).
    Raises ConfigError for a name with no or several integer parts."""
    found = _INT.findall(name) if isinstance(name, str) else []
    if len(found) != 1:
        raise ConfigError(f"cannot tell which layer {name!r} belongs to (want one integer part in its name)")
    return int(found[0])


def layers_of(names: Sequence[str]) -> dict[str, int]:
    """``{name: layer_index(name)}`` for every name."""
    return {name: layer_index(name) for name in names}
