"""Pipeline parallel: which model layers each stage holds, and which layer a vLLM layer is (pure).

vLLM splits a model's layers into ``pipeline_parallel_size`` contiguous stages: evenly, the
remainder going to the stages before the last, or as ``VLLM_PP_LAYER_PARTITION`` says
(``vllm.distributed.utils.get_pp_indices``). Each stage's workers hold only that stage's layers
in their KV cache, and Prefill and Decode may split differently (other stage counts, another
partition). A Decode's rendezvous names its split (:class:`StageSplit` counts, in
``DecodeEndpoint.stages``) and a Prefill rank knows each of its layers' index in the model
(:func:`layer_index`): it sends a layer to the Decode stage holding it
(:mod:`rd2h.prefill.stage_routes`), and a Decode rank completes a request once the Prefill
stages' finals cover its layers (:mod:`rd2h.decode.receive_tracker`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from rd2h.errors import ConfigError

__all__ = ["StageSplit", "layer_index"]

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


def layer_index(name: str) -> int:
    """The model layer a vLLM attention layer name belongs to (``model.layers.3.self_attn.attn``
    -> 3), as vLLM reads it (its ``extract_layer_index`` for one attention module per layer).
    Raises ConfigError for a name with no or several integer parts."""
    found = _INT.findall(name) if isinstance(name, str) else []
    if len(found) != 1:
        raise ConfigError(f"cannot tell which layer {name!r} belongs to (want one integer part in its name)")
    return int(found[0])

