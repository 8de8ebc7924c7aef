"""Which of vLLM's KV cache groups the connector pulls, and a refusal for any it does not.

vLLM hands a connector its ``KVCacheConfig``: one ``KVCacheGroupSpec`` per group of layers
sharing a block table, each with a ``kv_cache_spec`` (full attention, MLA, sliding window,
mamba state...) and the layers' names. A request's block ids come per group. The connector
pulls group 0's block ids into every layer it registered (``dense``), plus group 1 as the
indexer in ``sfa`` mode. With vLLM's hybrid allocator the other groups' layers share their
tensors with group 0's layers and use other block ids: registering them under group 0's ids
would read the wrong blocks, and skipping them (as a shared tensor) would leave them unpulled
with no error. So a group the connector does not pull is refused at startup, naming its kind
and layers, and never reaches a request.

Pure: reads vLLM's objects by their attributes and class names, imports no vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from rd2h.errors import ConfigError
from rd2h.vllm.config import Mode

__all__ = ["GroupInfo", "check_groups", "layers_to_pull", "describe_groups", "spec_kind"]

INDEXER_SUFFIX = ".indexer.k_cache"

# Specs whose blocks hold a token's KV at the position the block table says, every block of
# the prompt allocated: what the connector pulls. Exact class names: a subclass may allocate
# differently (RSWASpec, SinkFullAttentionSpec...) and is refused until it is tested.
_PULLABLE = frozenset({"FullAttentionSpec", "MLAAttentionSpec"})

# The name users know a spec by, most specific class first (its MRO is searched in order).
_KIND_NAMES = {
    "MambaSpec": "mamba / linear-attention state",
    "SlidingWindowMLASpec": "sliding window (MLA)",
    "SlidingWindowSpec": "sliding window",
    "RSWASpec": "sliding window (RSWA)",
    "ChunkedLocalAttentionSpec": "chunked local attention",
    "CircularBufferSpec": "circular-buffer attention",
    "CrossAttentionSpec": "cross attention (encoder-decoder)",
    "EncoderOnlyAttentionSpec": "encoder-only attention",
    "SinkFullAttentionSpec": "full attention with sink tokens",
    "HiddenStateCacheSpec": "hidden-state cache",
    "HiSparseHotSpec": "HiSparse hot cache",
    "HiSparseResidentSpec": "HiSparse resident cache",
    "MLAAttentionSpec": "MLA",
    "FullAttentionSpec": "full attention",
}


def _class_names(spec: Any) -> list[str]:
    return [cls.__name__ for cls in type(spec).__mro__]


def _inner_specs(spec: Any) -> list[Any]:
    """``UniformTypeKVCacheSpecs`` wraps one spec per layer (same type, e.g. head sizes that
    differ); anything else is its own only spec."""
    inner = getattr(spec, "kv_cache_specs", None)
    return list(inner.values()) if isinstance(inner, dict) and inner else [spec]


def spec_kind(spec: Any) -> str:
    """A readable kind: ``sliding window (4096 tokens)``, ``mamba / linear-attention state``..."""
    kinds = []
    for one in _inner_specs(spec):
        names = _class_names(one)
        kind = next((_KIND_NAMES[n] for n in names if n in _KIND_NAMES), names[0])
        window = getattr(one, "sliding_window", None) or getattr(one, "attention_chunk_size", None)
        if window and "full attention" not in kind and kind != "MLA":
            kind += f" ({window} tokens)"
        kinds.append(kind)
    return ", ".join(sorted(set(kinds)))


def _pullable(spec: Any) -> bool:
    return all(type(one).__name__ in _PULLABLE for one in _inner_specs(spec))


@dataclass(frozen=True)
class GroupInfo:
    index: int
    kind: str
    layers: tuple[str, ...]
    block_size: int
    transfers: bool  # False: vLLM rebuilds it after a load (enable_kv_transfer), nothing to pull
    pullable: bool


def describe_groups(kv_cache_config: Any) -> list[GroupInfo]:
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    infos = []
    for index, group in enumerate(groups):
        spec = group.kv_cache_spec
        infos.append(
            GroupInfo(
                index=index, kind=spec_kind(spec), layers=tuple(group.layer_names),
                block_size=int(getattr(spec, "block_size", 0) or 0),
                transfers=bool(getattr(group, "enable_kv_transfer", True)), pullable=_pullable(spec),
            )
        )  # fmt: skip
    return infos


def _short(layers: Sequence[str], limit: int = 4) -> str:
    shown = ", ".join(layers[:limit])
    return f"{shown} and {len(layers) - limit} more" if len(layers) > limit else shown


def _pulled(infos: list[GroupInfo], mode: Mode) -> set[int]:
    """Indices of the groups whose block ids the connector sends: group 0 (main KV), and in
    ``sfa`` mode group 1 when it is the indexer's."""
    pulled = {0} if infos else set()
    if mode is Mode.SFA and len(infos) > 1 and all(n.endswith(INDEXER_SUFFIX) for n in infos[1].layers):
        pulled.add(1)
    return pulled


def check_groups(kv_cache_config: Any, mode: Mode) -> list[GroupInfo]:
    """Raises ConfigError naming every group whose layers hold KV the connector would not
    pull (its kind, index and layers) or would pull wrongly (a kind not tested). Returns the
    groups. A config without groups (older vLLM, attention-free model) passes: the worker
    then checks what it registers against nothing and pulls every layer with group 0."""
    infos = describe_groups(kv_cache_config)
    pulled = _pulled(infos, mode)
    problems = []
    for info in infos:
        if not info.transfers:
            continue
        if info.index not in pulled:
            problems.append(f"group {info.index} ({info.kind}, {len(info.layers)} layers: {_short(info.layers)}) "
                            f"has block ids of its own that rd2h {mode.value} mode does not pull")  # fmt: skip
        elif not info.pullable and not (mode is Mode.SFA and info.index == 1):
            problems.append(f"group {info.index} ({info.kind}, {len(info.layers)} layers: {_short(info.layers)}) "
                            "is a KV cache kind rd2h does not transfer")  # fmt: skip
    if problems:
        hint = ""
        if any(i.kind.startswith(("sliding window", "chunked local")) for i in infos) and any(
            i.pullable for i in infos
        ):
            hint = (" A model mixing full and sliding-window (or chunked local) layers runs with every layer as full "
                    "attention under vLLM's --disable-hybrid-kv-cache-manager (all its KV is then pulled).")  # fmt: skip
        raise ConfigError(
            f"rd2h cannot transfer this model's KV cache: {len(problems)} of {len(infos)} KV cache groups would not be "
            "pulled: " + "; ".join(problems) + "." + hint + " See docs/vllm.md, 'Support matrix'."
        )
    return infos


def layers_to_pull(infos: list[GroupInfo], registered: Iterable[str], mode: Mode) -> list[str]:
    """The registered layers the connector pulls, in vLLM's order: every one belongs to a
    group it pulls (read with that group's block ids); a layer of a group vLLM rebuilds
    itself (``enable_kv_transfer`` False) is left out. Raises ConfigError naming the layers
    that belong to no group (they would be read with another group's block ids)."""
    names = list(registered)
    if not infos:
        return names
    pulled = _pulled(infos, mode)
    known = {name for info in infos if info.index in pulled and info.transfers for name in info.layers}
    skipped = {name for info in infos if not info.transfers for name in info.layers} - known
    stray = sorted(n for n in names if n not in known and n not in skipped)
    if stray:
        raise ConfigError(
            f"rd2h: {len(stray)} registered KV cache layers belong to no KV cache group it pulls "
            f"({_short(stray)}): they would be read with another group's block ids"
        )
    return [n for n in names if n in known]
