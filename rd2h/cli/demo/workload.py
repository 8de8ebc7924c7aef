"""The demo's workload, derived from a seed so every process rebuilds it alike (pure).

A DeepSeek-V3.2-like SFA layer: MLA main tensors (latent ``kv_c`` and rope ``k_pe``), an
indexer key cache and its LIC8 scale. Every byte written on Prefill is a function of
(layer, tensor, request, block position), so Decode checks what arrived without any data
being shipped beside the transfer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from rd2h.errors import ConfigError
from rd2h.layout.topology import Topology, decode_ports

__all__ = ["TensorSpec", "DemoConfig", "RequestPlan", "Workload", "pattern"]


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    bytes_per_token: int


# Per-token bytes of one DeepSeek-V3.2 layer on one rank.
MAIN_TENSORS = (TensorSpec("kv_c", 512 * 2), TensorSpec("k_pe", 64 * 2))  # bf16 latent + rope
INDEXER = TensorSpec("indexer", 128)  # fp8 indexer keys
SCALE = TensorSpec("scale", 4)  # LIC8 scale, one fp32 per token


@dataclass(frozen=True)
class DemoConfig:
    prefill_tp: int = 4
    decode_tp: int = 2
    layers: int = 16
    requests: int = 8
    max_tokens: int = 2048  # prompt lengths are drawn from [max_tokens // 4, max_tokens]
    block_size: int = 64
    chunk_tokens: int = 1024  # chunked prefill: tokens computed per step
    slots: int = 2  # physical Prefill buffers reused across logical layers
    engine: str = "local"
    engine_options: dict[str, object] = field(default_factory=dict)
    host: str = "127.0.0.1"  # where Decode binds and Prefill dials
    kv_port: int = 5600
    seed: int = 0
    timeout: float = 60.0
    compute_ms: float = 0.0  # simulated device compute per layer and step (the CPU stays free)
    # Rank placement, to run the two sides as two hosts (e.g. network namespaces joined by a
    # veth pair): the named network namespace (`ip netns`) each side's ranks enter, and engine
    # options for one side only, over `engine_options` (an engine's own address, say).
    prefill_netns: str = ""
    decode_netns: str = ""
    prefill_engine_options: dict[str, object] = field(default_factory=dict)
    decode_engine_options: dict[str, object] = field(default_factory=dict)
    channel: str = "zmq"  # the control channel's name (rd2h.control_channels)
    channel_options: dict[str, object] = field(default_factory=dict)  # e.g. CURVE keys off loopback

    def __post_init__(self) -> None:
        Topology(self.prefill_tp, self.decode_tp)  # raises TopologyError
        decode_ports(self.kv_port, 0, self.decode_tp)  # raises PortError
        for name in ("layers", "requests", "max_tokens", "block_size", "chunk_tokens", "slots"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.compute_ms >= 0:
            raise ConfigError(f"compute_ms must be >= 0, got {self.compute_ms}")
        if self.slots > self.layers:
            raise ConfigError(f"slots ({self.slots}) cannot exceed layers ({self.layers})")

    def options_for(self, role: str, cpus: int = 0) -> dict[str, object]:
        """The engine options of ``role``'s ranks.

        Given the ``cpus`` this host offers, a Decode rank of the local engine that was not told
        its ``threads`` gets its share of them (every rank counted, at least one): its read
        threads then do not fight Prefill's compute (on 2 cores, one read thread gave 1.5x
        the read rate of two, interleaved: docs/performance.md).
        """
        side = self.prefill_engine_options if role == "prefill" else self.decode_engine_options
        options = {**self.engine_options, **side}
        if role == "decode" and self.engine == "local" and cpus > 0 and "threads" not in options:
            options["threads"] = max(1, cpus // (self.prefill_tp + self.decode_tp))
        return options

    def layer_name(self, layer: int) -> str:
        return f"model.layers.{layer}.attn"

    def block_bytes(self, spec: TensorSpec) -> int:
        return spec.bytes_per_token * self.block_size


@dataclass(frozen=True, slots=True)
class RequestPlan:
    ext_id: str
    index: int
    num_tokens: int
    src_blocks: np.ndarray  # Prefill block ids, in prompt order
    dst_blocks: np.ndarray  # Decode block ids, in prompt order

    @property
    def num_blocks(self) -> int:
        return len(self.src_blocks)


@dataclass(frozen=True, slots=True)
class Workload:
    config: DemoConfig
    requests: tuple[RequestPlan, ...]
    src_pool_blocks: int  # blocks per Prefill slot tensor
    dst_pool_blocks: int  # blocks per Decode tensor (more than needed: some stay untouched)

    @classmethod
    def build(cls, config: DemoConfig) -> Workload:
        rng = np.random.default_rng(config.seed)
        lengths = rng.integers(max(1, config.max_tokens // 4), config.max_tokens + 1, config.requests)
        counts = -(-lengths // config.block_size)
        total = int(counts.sum())
        src_perm = rng.permutation(total)
        dst_pool = total + max(4, total // 4)
        dst_perm = rng.permutation(dst_pool)[:total]
        requests, offset = [], 0
        for i, (tokens, n) in enumerate(zip(lengths.tolist(), counts.tolist())):
            requests.append(
                RequestPlan(f"req-{i}", i, tokens, src_perm[offset : offset + n], dst_perm[offset : offset + n])
            )
            offset += n
        return cls(config, tuple(requests), total, dst_pool)

    def steps(self) -> list[dict[str, int]]:
        """Chunked prefill: per step, the prompt tokens each unfinished request has cached."""
        chunk, steps, done = self.config.chunk_tokens, [], 0
        longest = max(r.num_tokens for r in self.requests)
        while done < longest:
            before, done = done, min(done + chunk, longest)
            steps.append({r.ext_id: min(done, r.num_tokens) for r in self.requests if r.num_tokens > before})
        return steps

    def main_bytes(self) -> int:
        """Main K/V bytes that cross to Decode (each block once, whatever the TP)."""
        per_block = sum(self.config.block_bytes(t) for t in MAIN_TENSORS)
        return per_block * self.src_pool_blocks * self.config.layers

    def indexer_bytes(self) -> int:
        """Indexer + scale bytes: every Decode rank receives a complete copy."""
        per_block = self.config.block_bytes(INDEXER) + self.config.block_bytes(SCALE)
        return per_block * self.src_pool_blocks * self.config.layers * self.config.decode_tp


def pattern(layer: int, tensor: int, request: int, positions: np.ndarray, block_bytes: int) -> np.ndarray:
    """The bytes of blocks at ``positions`` of a request: shape ``(len(positions), block_bytes)``."""
    words = block_bytes // 4
    # the seed wraps modulo 2**32 as the words do: past ~4,300 layers it no longer fits a uint32
    seed = np.uint32((layer * 1_000_003 + tensor * 7_919 + request * 104_729) & 0xFFFFFFFF)
    seeds = seed + positions.astype(np.uint32) * np.uint32(2_654_435_761)
    rows = seeds[:, None] + np.arange(words, dtype=np.uint32)[None, :]
    return rows.view(np.uint8).reshape(len(positions), block_bytes)
