"""The parallel layouts the connector serves, read from vLLM's ``ParallelConfig`` (pure).

- Pipeline parallel on a Prefill: each stage's workers hold and announce only the layers
  that stage computed, and their ``mf_meta`` names the stage (``pp_rank``/``pp_size``, read
  from vLLM's pipeline group by :func:`pipeline_stage`). A Prefill's ranks bind no port (its
  DEALERs dial Decode), so stages cannot collide; Decode completes a request once the stages'
  final signals cover every layer it holds. Refused with ``handoff_port`` (vLLM's P/D
  convention), whose ports carry no stage.
- Pipeline parallel on a Decode: each stage binds ports of its own (``kv_port + (dp_rank * pp
  + stage) * tp + rank``, :func:`port_rank`), the rendezvous names how many layers each stage
  holds (:func:`decode_stages`), and a Prefill rank sends each layer only to the stage holding
  it (:mod:`rd2h.prefill.stage_routes`, the arithmetic in :mod:`rd2h.vllm.pipeline`).
- Pipeline parallel is served for one full-attention or MLA KV cache group in ``dense`` mode,
  alone: with several groups (the hybrid allocator's shared storage slots, which two stages
  may split), in ``sfa`` mode or with speculative decoding it is refused at startup, as
  docs/vllm.md's support matrix says, until a test serves it. (Under vLLM's MultiConnector a
  child sees only its own transfer config, so composition cannot be told here: not tested.)
- Data parallel: each DP rank is an engine of its own with its own ports
  (``kv_port + dp_rank * tp + rank`` without PP) and its own rendezvous. vLLM resets
  ``data_parallel_rank`` to 0 in every rank of a dense (non-MoE) model run with DP
  (``ParallelConfig.reconfigure_for_independent_dp_rank``); only ``data_parallel_index``
  keeps the global rank, so the ports are taken from it: with ``data_parallel_rank`` every
  DP rank of one host would bind the same ports.
"""

from __future__ import annotations

from typing import Any

from rd2h.errors import ConfigError

__all__ = ["check_parallel", "decode_stages", "dp_rank_of", "model_layers", "pipeline_stage", "port_rank"]


def dp_rank_of(parallel: Any) -> int:
    """The engine's global data-parallel rank (what its ports and rendezvous carry)."""
    index = getattr(parallel, "data_parallel_index", None)
    if index is None:  # a vLLM without data_parallel_index never resets the rank
        index = getattr(parallel, "data_parallel_rank", 0)
    return int(index or 0)


def check_parallel(
    parallel: Any,
    *,
    consumer: bool = True,
    handoff: bool = False,
    groups: int = 1,
    mode: str = "dense",
    speculative: bool = False,
) -> None:
    """Raises ConfigError for a layout the connector would serve wrongly: pipeline parallel on a
    Prefill with ``handoff`` (vLLM's P/D convention), whose hand-off ports carry no stage; and
    pipeline parallel beside what it has not been built or tested with: several KV cache
    ``groups``, ``sfa`` ``mode``, a ``speculative`` decoding config.

    Pipeline parallel is otherwise served on either side (``consumer``: a Decode): a Prefill
    stage announces the layers it computed, each to the Decode stage holding it (the
    rendezvous names Decode's stages, :func:`decode_stages`), and a Decode stage binds ports of
    its own (:func:`port_rank`).
    """
    pp = int(getattr(parallel, "pipeline_parallel_size", 1) or 1)
    if pp > 1 and handoff:
        raise ConfigError(
            f"rd2h's handoff_port (vLLM's P/D convention) does not support pipeline parallel yet "
            f"(pipeline_parallel_size={pp}): the hand-off ports carry no stage, so the stages of one TP rank would "
            "bind the same port. Run this Prefill behind rd2h proxy (no handoff_port), or with "
            "--pipeline-parallel-size 1; see docs/vllm.md, 'Support matrix'."
        )
    beside = [
        what
        for what, present in (
            (f"{groups} KV cache groups (hybrid allocator: a storage slot two stages split is not handled)", groups > 1),
            (f"mode {mode!r} (pipeline parallel is served in 'dense' mode only)", mode != "dense"),
            ("speculative decoding (not tested with pipeline parallel)", speculative),
        )
        if present
    ]
    if pp > 1 and beside:
        raise ConfigError(
            f"rd2h serves pipeline parallel (pipeline_parallel_size={pp}) for one full-attention or MLA KV cache "
            f"group in 'dense' mode alone; this engine has {'; '.join(beside)}. Run it with "
            "--pipeline-parallel-size 1; see docs/vllm.md, 'Support matrix'."
        )


def port_rank(parallel: Any, pp_rank: int = 0) -> int:
    """What rd2h's ports are laid out by (``kv_port + port_rank * tp + tp_rank``): the global DP
    rank times the pipeline stages, plus this worker's stage, as vLLM orders ranks (DP x PP x TP).
    Without pipeline parallel it is the global DP rank."""
    pp = int(getattr(parallel, "pipeline_parallel_size", 1) or 1)
    return dp_rank_of(parallel) * pp + pp_rank


def decode_stages(vllm_config: Any) -> tuple[int, ...]:
    """The model layers each of this engine's pipeline stages holds, as vLLM splits them
    (``VLLM_PP_LAYER_PARTITION`` included); empty without pipeline parallel. A Decode's
    rendezvous names them, so that Prefill sends each layer to the stage that holds it."""
    import os

    from rd2h.vllm.pipeline import StageSplit

    pp = int(getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1) or 1)
    if pp == 1:
        return ()
    layers = int(vllm_config.model_config.get_total_num_hidden_layers())
    return StageSplit.of(layers, pp, os.environ.get("VLLM_PP_LAYER_PARTITION")).counts


def pipeline_stage() -> dict[str, int]:
    """This worker's pipeline stage as KVSource's ``pp_rank``/``pp_size``, read from vLLM's
    pipeline group; empty without pipeline parallel (or outside an initialised vLLM worker)."""
    try:
        from vllm.distributed.parallel_state import get_pp_group

        group = get_pp_group()
    except (ImportError, AssertionError):  # no vLLM, or its groups are not initialised here
        return {}
    size = int(group.world_size)
    return {"pp_rank": int(group.rank_in_group), "pp_size": size} if size > 1 else {}


def model_layers(names: Any) -> list[int] | None:
    """Each layer's index in the model, read from vLLM's layer names (``model.layers.3...``); None
    where a name does not say (a Prefill then refuses only requests for a Decode with stages)."""
    from rd2h.vllm.pipeline import layer_index

    try:
        return [layer_index(name) for name in names]
    except ConfigError:
        return None
