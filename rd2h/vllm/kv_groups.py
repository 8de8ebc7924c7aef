"""Which of vLLM's KV cache groups the connector pulls, and a refusal for any it does not.

vLLM hands a connector its ``KVCacheConfig``: one ``KVCacheGroupSpec`` per group of layers
sharing a block table, each with a ``kv_cache_spec`` (full attention, MLA, sliding window,
mamba state...) and the layers' names. A request's block ids come per group, all drawn from
one block pool. ``sfa`` mode pulls group 0 as main KV and group 1 as the indexer. ``dense``
mode pulls every group whose kind it transfers: full attention, MLA and sliding window.

vLLM's hybrid allocator (full + sliding-window layers) overlays the groups in one allocation:
the i-th layer of each group views the same bytes (a *storage slot*), each group using the
block ids it owns. So one slot read with every group's block ids moves each of its layers'
KV; the worker registers slots, not layers (:func:`storage_slots`), and a request's source
and destination lists are its groups' lists laid end to end (:func:`gather_blocks`). A
sliding-window group keeps only the blocks its window still reads: vLLM frees the others
(``null_block``, id 0); the blocks pulled are those vLLM allocated on Decode for the tokens
it loads (:func:`pull_ranges`). A Mamba state group (``MambaSpec``, ``mamba_cache_mode``
'none') holds one block per request, the state after the tokens computed: it moves whole,
alone or beside attention groups (:mod:`rd2h.vllm.state_groups`). A group of any other kind
(linear-attention state, chunked local, a Mamba group in a mode not served...) is refused at
startup, naming its kind and layers, and never reaches a request.

Pure: reads vLLM's objects by their attributes and class names, imports no vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rd2h.errors import ConfigError
from rd2h.vllm.config import Mode
from rd2h.vllm.pipeline import layer_index
from rd2h.vllm.state_groups import is_state_spec, state_problem

__all__ = [
    "GroupInfo", "check_groups", "layers_to_pull", "describe_groups", "spec_kind", "pulls_groups",
    "transfer_tokens", "pull_ranges", "gather_blocks", "storage_slots", "NULL_BLOCK", "has_state",
]  # fmt: skip

INDEXER_SUFFIX = ".indexer.k_cache"

# Specs whose blocks hold a token's KV at the position the block table says: what the
# connector pulls (a sliding window only the blocks its window keeps). Exact class names: a
# subclass may allocate differently (RSWASpec, SinkFullAttentionSpec, SlidingWindowMLASpec...)
# and is refused until it is tested.
_PULLABLE = frozenset({"FullAttentionSpec", "MLAAttentionSpec", "SlidingWindowSpec"})
NULL_BLOCK = 0  # vLLM's null_block: the block id of a position a group no longer holds

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
    if is_state_spec(spec):
        return state_problem(spec) is None
    return all(type(one).__name__ in _PULLABLE for one in _inner_specs(spec))


def _window(spec: Any) -> int:
    if type(spec).__name__ != "SlidingWindowSpec":
        return 0
    return int(getattr(spec, "sliding_window", 0) or 0)


@dataclass(frozen=True)
class GroupInfo:
    index: int
    kind: str
    layers: tuple[str, ...]
    block_size: int
    transfers: bool  # False: vLLM rebuilds it after a load (enable_kv_transfer), nothing to pull
    pullable: bool
    window: int = 0  # a sliding window's tokens (0: the group keeps every block)
    retained: int = 0  # tokens kept below the window (vLLM's extra_retained_tokens)
    state: bool = False  # a Mamba state group: one block per request, the state after its tokens
    problem: str = ""  # why a group of a pullable kind is not pulled in this configuration


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
                window=_window(spec), retained=int(getattr(spec, "extra_retained_tokens", 0) or 0),
                state=is_state_spec(spec), problem=(state_problem(spec) or "") if is_state_spec(spec) else "",
            )
        )  # fmt: skip
    return infos


def _short(layers: Sequence[str], limit: int = 4) -> str:
    shown = ", ".join(layers[:limit])
    return f"{shown} and {len(layers) - limit} more" if len(layers) > limit else shown


def _pulled(infos: list[GroupInfo], mode: Mode) -> set[int]:
    """Indices of the groups whose block ids the connector sends: in ``dense`` mode every
    group but a sparse indexer's (those of a kind it does not transfer are refused by
    check_groups); in ``sfa`` mode group 0 (main KV) and group 1 when it is the indexer's."""
    if mode is Mode.DENSE:
        return {info.index for info in infos if not _indexer(info)}
    pulled = {0} if infos else set()
    if len(infos) > 1 and _indexer(infos[1]):
        pulled.add(1)
    return pulled


def _indexer(info: GroupInfo) -> bool:
    return bool(info.layers) and all(n.endswith(INDEXER_SUFFIX) for n in info.layers)


def has_state(infos: Sequence[GroupInfo]) -> bool:
    """A Mamba state group is among them: each request then moves whole, Prefill computing
    all prompt tokens but the last (:mod:`rd2h.vllm.state_groups`)."""
    return any(info.state for info in infos)


def pulls_groups(infos: list[GroupInfo], mode: Mode) -> list[GroupInfo]:
    """The groups a request's block ids are pulled for in ``dense`` mode with several groups
    (vLLM's hybrid allocator: the scheduler side knows only their count) or a Mamba state
    group, in vLLM's order, leaving out those vLLM rebuilds itself; [] otherwise (one
    attention group, or ``sfa``)."""
    if mode is not Mode.DENSE or (len(infos) < 2 and not has_state(infos)):
        return []
    return [info for info in infos if info.transfers]


def transfer_tokens(num_prompt_tokens: int) -> int:
    """The prompt tokens whose KV moves with several groups: all but the last, which Decode
    computes (vLLM recomputes it after a load anyway). Decode's vLLM then keeps, in a
    sliding-window group, the window of that last token: loading every token would let it
    free the block holding the window's first token (it frees for the *next* token)."""
    return max(0, num_prompt_tokens - 1)


def _skipped_tokens(info: GroupInfo, tokens: int) -> int:
    """vLLM's ``SlidingWindowManager.get_num_skipped_tokens``: tokens before the window of the
    next token, whose blocks it frees."""
    if not info.window:
        return 0
    return max(0, tokens - info.window + 1 - info.retained)


def pull_ranges(groups: Sequence[GroupInfo], tokens: int, first_token: int) -> list[tuple[int, int]]:
    """Per group, the block positions ``[start, end)`` that move for a request whose first
    ``tokens`` tokens are pulled, Decode holding the first ``first_token`` of them already (its
    prefix-cache hit): from the first position the group keeps (a window frees the ones before)
    or the hit, to the last block the tokens reach. A Mamba state group moves its one block
    (the state after those tokens) whenever any token moves. Both sides compute the same ranges."""
    ranges = []
    for info in groups:
        if info.state:
            ranges.append((0, 1 if tokens > 0 else 0))
            continue
        size = info.block_size
        end = -(-tokens // size)
        start = max(_skipped_tokens(info, tokens) // size, first_token // size)
        ranges.append((min(start, end), end))
    return ranges


def gather_blocks(
    groups: Sequence[GroupInfo], blocks: Sequence[Sequence[int]], tokens: int, first_token: int, *, decode: bool
) -> list[int]:
    """One request's block ids of every pulled group, laid end to end in group order: what
    a storage slot is read with (Prefill) or written into (Decode). Raises ValueError where
    vLLM's allocation is not what the ranges say: a block to pull that the group does not
    hold (``null_block`` or missing) and, on Decode (``decode``), a position before a window
    that still holds a block (vLLM would read it; nothing writes it)."""
    if len(blocks) < len(groups):
        raise ValueError(f"block ids for {len(blocks)} KV cache groups, {len(groups)} pulled")
    flat: list[int] = []
    for info, (start, end) in zip(groups, pull_ranges(groups, tokens, first_token)):
        ids = blocks[info.index]
        where = f"group {info.index} ({info.kind})"
        if len(ids) < end:
            raise ValueError(f"{where}: {len(ids)} blocks for {tokens} tokens of {info.block_size}")
        held = ids[start:end]
        if NULL_BLOCK in held:
            raise ValueError(f"{where}: position {start + list(held).index(NULL_BLOCK)} to pull holds no block")
        kept = _skipped_tokens(info, tokens) // info.block_size
        if decode and any(b != NULL_BLOCK for b in ids[:kept]):
            raise ValueError(f"{where}: blocks before the window (positions < {kept}) are allocated")
        flat.extend(int(b) for b in held)
    return flat


def _layer_index(name: str) -> int | None:
    """vLLM's layer index of ``name`` (:func:`rd2h.vllm.pipeline.layer_index`); None where the
    name does not say (such a slot sorts by registration order alone)."""
    try:
        return layer_index(name)
    except ConfigError:
        return None


def storage_slots(storage: Mapping[str, int], groups: Sequence[GroupInfo]) -> dict[str, tuple[str, ...]]:
    """``{slot name: member layers}``: the pulled layers grouped by the storage they view
    (``storage``: layer name -> its cache's address), in the order the forward finishes them
    (by the highest layer index among a slot's members, vLLM's ``layers.N`` naming), each named
    after its first member. A slot's KV is complete in a step once each member was saved."""
    order = {name: i for i, name in enumerate(storage)}
    members: dict[int, list[str]] = {}
    for info in groups:
        for name in info.layers:
            if name in storage:
                members.setdefault(storage[name], []).append(name)

    def finished_at(names: list[str]) -> tuple[int, int]:
        indices = [_layer_index(n) for n in names]
        last = max((i for i in indices if i is not None), default=-1)
        return (last, max(order[n] for n in names))

    return {names[0]: tuple(names) for names in sorted(members.values(), key=finished_at)}


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
        if info.state and (info.problem or mode is not Mode.DENSE):
            why = info.problem or f"rd2h {mode.value} mode (a Mamba state is pulled in 'dense' mode only)"
            problems.append(f"group {info.index} ({info.kind}, {len(info.layers)} layers: {_short(info.layers)}) "
                            f"cannot be transferred with {why}")  # fmt: skip
        elif info.index not in pulled:
            problems.append(f"group {info.index} ({info.kind}, {len(info.layers)} layers: {_short(info.layers)}) "
                            f"has block ids of its own that rd2h {mode.value} mode does not pull")  # fmt: skip
        elif not (info.pullable and (not info.window or (mode is Mode.DENSE and len(infos) > 1))) and not (
            mode is Mode.SFA and info.index == 1
        ):  # a window is pulled by the several-groups path only (one group: the block ids as they are)
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
