"""vLLM's layer caches as rd2h layers (pure: tensors in, :class:`LayerTensors` out)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rd2h.errors import ConfigError
from rd2h.tensors import LayerTensors
from rd2h.vllm.config import Mode

__all__ = ["block_first", "split_layers"]

_INDEXER_SUFFIX = ".indexer.k_cache"


def block_first(tensor: Any, num_blocks: int) -> list[Any]:
    """The main tensors of one layer cache, each indexed by block on dimension 0:
    CPU/MLA caches are block-first already; a ``[2, num_blocks, ...]`` K/V pair is split."""
    shape = tuple(tensor.shape)
    if shape[0] == num_blocks:
        return [tensor]
    if len(shape) > 1 and shape[0] == 2 and shape[1] == num_blocks:
        return [tensor[0], tensor[1]]
    raise ConfigError(f"cannot find the block dimension ({num_blocks} blocks) of a KV cache of shape {shape}")


def split_layers(
    kv_caches: Mapping[str, Any], num_blocks: Mapping[str, int], mode: Mode
) -> dict[str, LayerTensors]:
    """rd2h layers from vLLM's ``{layer name: cache tensor}``.

    A layer whose cache is another layer's storage (vLLM shares caches between layers,
    e.g. cross-layer KV sharing) is skipped: its bytes move with the owner. In ``sfa``
    mode an indexer cache becomes the indexer of the attention layer it belongs to.
    Raises ConfigError for a cache whose block dimension cannot be found, or (sfa) an
    indexer with no attention layer.
    """
    seen: set[tuple[int, tuple[int, ...]]] = set()
    main: dict[str, list[Any]] = {}
    indexers: dict[str, Any] = {}
    for name, tensor in kv_caches.items():
        key = (int(tensor.data_ptr()), tuple(tensor.shape))
        if key in seen:
            continue
        seen.add(key)
        tensors = block_first(tensor, num_blocks[name])
        if mode is Mode.SFA and name.endswith(_INDEXER_SUFFIX):
            indexers[name[: -len(_INDEXER_SUFFIX)]] = tensors[0]
        else:
            main[name] = tensors
    layers: dict[str, LayerTensors] = {}
    for name, tensors in main.items():
        owner = next((prefix for prefix in indexers if name.startswith(prefix + ".")), None)
        layers[name] = LayerTensors(main=tensors, indexer=indexers.pop(owner) if owner else None)
    if indexers:
        raise ConfigError(f"indexer caches without an attention layer: {sorted(indexers)}")
    return layers
