"""What the scheduler tells the workers each step, and what the workers tell it back.

Both are plain frozen dataclasses of tuples and ints: vLLM pickles them to every worker
process, and workers must never mutate what they received (a step's metadata may be read
again after the forward, since vLLM >= 0.32 calls ``start_load_kv`` after it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

try:  # vLLM 0.32: workers report back to the scheduler each step
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorWorkerMetadata,
    )

    WORKER_REPORTS = True
except ImportError:  # pragma: no cover - older vLLM: the rendezvous goes out one step later

    class KVConnectorWorkerMetadata:  # type: ignore[no-redef]
        pass

    WORKER_REPORTS = False

__all__ = ["WORKER_REPORTS", "HoldSpec", "RecvSpec", "SendBlocks", "SendFinish", "SendSpec", "StepMetadata", "WorkerReport"]

Groups = tuple[tuple[int, ...], ...]  # block ids per KV cache group


@dataclass(frozen=True, slots=True)
class RecvSpec:
    """Decode: pull ``ext_id`` into these destination blocks (all groups, prompt order)."""

    ext_id: str
    req_id: str
    blocks: Groups
    first_block: int  # main blocks before it are this engine's own prefix-cache hit
    num_tokens: int


@dataclass(frozen=True, slots=True)
class SendSpec:
    """Prefill: ``ext_id`` goes to ``endpoint`` (``DecodeEndpoint`` text)."""

    ext_id: str
    req_id: str
    endpoint: str
    blocks: Groups
    num_tokens: int
    first_block: int
    written: int = 0  # prompt tokens whose KV was written before the targets came: announced at once


@dataclass(frozen=True, slots=True)
class SendBlocks:
    """Prefill: source blocks allocated to ``ext_id`` in this step."""

    ext_id: str
    blocks: Groups


@dataclass(frozen=True, slots=True)
class SendFinish:
    """Prefill: vLLM finished ``req_id``; report it finished-sending once Decode is done
    with its blocks (``aborted``: stop announcing it first)."""

    ext_id: str
    req_id: str
    aborted: bool


@dataclass(frozen=True, slots=True)
class HoldSpec:
    """Prefill: vLLM finished ``req_id`` (vLLM's P/D convention, :mod:`rd2h.vllm.handoff`); keep
    its blocks for ``ext_id`` until a Decode asks for them or the hold expires."""

    ext_id: str
    req_id: str
    blocks: Groups  # the prompt's blocks, per KV cache group
    num_tokens: int


@dataclass(frozen=True)
class StepMetadata(KVConnectorMetadata):
    recv: tuple[RecvSpec, ...] = ()
    recv_abort: tuple[str, ...] = ()  # ext ids
    send_new: tuple[SendSpec, ...] = ()
    send_blocks: tuple[SendBlocks, ...] = ()
    computed: tuple[tuple[str, int], ...] = ()  # ext id -> prompt tokens cached after this step
    send_finish: tuple[SendFinish, ...] = ()
    send_abort: tuple[str, ...] = ()  # ext ids preempted mid-send: stop, never report them
    idle: bool = False  # the step computes nothing: it only waits for transfers to end
    hold: tuple[HoldSpec, ...] = ()  # finished requests held for a Decode to ask for
    release: tuple[str, ...] = ()  # req ids held for targets that never came: their blocks are free

    @property
    def sends(self) -> bool:
        return bool(self.computed)


@dataclass
class WorkerReport(KVConnectorWorkerMetadata):
    """Per step, from each worker: the ext ids it now expects (Decode). Summed over
    workers, a count equal to the world size means every rank knows the destinations,
    so the rendezvous may be posted (never before: Prefill would be refused)."""

    expected: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> WorkerReport:
        merged = dict(self.expected)
        for ext_id, n in getattr(other, "expected", {}).items():
            merged[ext_id] = merged.get(ext_id, 0) + n
        return WorkerReport(merged)
