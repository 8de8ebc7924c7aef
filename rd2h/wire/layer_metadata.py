"""The ``layer_metadata`` map of ``mf_meta``: where each layer's source tensors live (pure).

Prefill encodes its :class:`~rd2h.layout.layers.LayerLayout` per layer into one msgpack map; Decode
decodes and validates it before any read. Keys are append-only: a key this build does not
know is ignored, and a key an older peer does not send takes its legacy default.
``docs/protocol.md`` section 4.1 is the reference for peers in other languages.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgpack

from rd2h.errors import IncompatiblePeerError, RemoteProtocolError
from rd2h.layout.layers import LayerLayout, LayoutTag, TensorLayout
from rd2h.layout.regions import HOST, check_memory_kind
from rd2h.wire.fields import INT_END as _INT_END
from rd2h.wire.fields import check_int as _check_int
from rd2h.wire.fields import check_str as _check_str
from rd2h.wire.fields import kind as _kind
from rd2h.wire.fields import unpack as _unpack

__all__ = [
    "LAYOUT_VERSION",
    "LEGACY_LAYOUT_VERSION",
    "READ_LAYOUT_VERSIONS",
    "encode_layer_metadata",
    "decode_layer_metadata",
]

LAYOUT_VERSION = 4  # v2 adds num_blocks and has_scale; v3 block_stride and tag; v4 memory_kind
LEGACY_LAYOUT_VERSION = 1
READ_LAYOUT_VERSIONS = (LEGACY_LAYOUT_VERSION, 2, 3, LAYOUT_VERSION)  # what decode_layer_metadata reads

_TENSOR_LISTS = ("base_addrs", "block_len", "block_size_scale", "num_blocks", "tensor_group_idx")


def _check_tensor(
    base_addr: int, block_len: int, scale: int, num_blocks: int | None, block_stride: int | None, where: str
) -> int:
    """Check one tensor's numbers; return its block count (``None``: unknown, legacy peer).

    A legacy peer does not send block counts. Its tensors are then taken to run to the end
    of the int64 address space: range checks against that count never reject a real block
    id, and Decode's registered-region checks remain the bound that protects memory.
    """
    _check_int(base_addr, f"base_addrs[{where}]")
    _check_int(block_len, f"block_len[{where}]", 1)
    _check_int(scale, f"block_size_scale[{where}]", 1)
    block_bytes = block_len * scale
    stride = block_bytes
    if block_stride is not None:
        _check_int(block_stride, f"block_stride[{where}]", 1)
        if block_stride < block_bytes:
            raise ValueError(f"block_stride[{where}]: {block_stride} is smaller than a block ({block_bytes} bytes)")
        stride = block_stride
    # whole blocks whose last byte lies below 2**63 (the last block needs no padding after it)
    room = 0 if base_addr + block_bytes >= _INT_END else (_INT_END - 1 - base_addr - block_bytes) // stride + 1
    if num_blocks is None:
        if room == 0:
            raise ValueError(f"tensor {where}: not one block fits below the int64 address limit")
        return room
    _check_int(num_blocks, f"num_blocks[{where}]")
    if num_blocks > room:
        raise ValueError(f"tensor {where} ends past the int64 address space")
    return num_blocks


def _encode_tag(tag: LayoutTag) -> dict[str, object]:
    return {"dtype": tag.dtype, "block_shape": list(tag.block_shape), "block_tokens": tag.block_tokens, "name": tag.name}


def _decode_tag(tag: object) -> LayoutTag:
    if type(tag) is not dict:
        raise TypeError(f"tag: expected a map, got {_kind(tag)}")
    for key in ("dtype", "block_shape", "block_tokens"):
        if key not in tag:
            raise ValueError(f"tag.{key}: missing")
    dtype, shape, tokens, name = tag["dtype"], tag["block_shape"], tag["block_tokens"], tag.get("name", "")
    _check_str(dtype, "tag.dtype", allow_empty=True)
    _check_str(name, "tag.name", allow_empty=True)
    if type(shape) is not tuple:
        raise TypeError(f"tag.block_shape: expected an array, got {_kind(shape)}")
    for i, n in enumerate(shape):
        _check_int(n, f"tag.block_shape[{i}]")
    _check_int(tokens, "tag.block_tokens")
    return LayoutTag(dtype, shape, tokens, name)


def encode_layer_metadata(layers: Mapping[str, LayerLayout]) -> bytes:
    """Encode layouts as the ``layer_metadata`` map of mf_meta (layout version 4).

    Tensor order per layer: the main tensors, the indexer, the scale. ``block_stride`` is
    sent only for a layer with a strided tensor, ``tag`` only for a layer that has one,
    ``memory_kind`` (one kind per tensor) only for a layer with a tensor not in host memory.
    Raises TypeError or ValueError on a layout that could not be decoded again (a scale
    without an indexer, no main tensor, a non-positive length).
    """
    if not isinstance(layers, Mapping):
        raise TypeError(f"layers: expected a mapping of layer name to LayerLayout, got {_kind(layers)}")
    out: dict[str, dict[str, Any]] = {}
    for name, layer in layers.items():
        _check_str(name, "layer name")
        if type(layer) is not LayerLayout:
            raise TypeError(f"layer {name!r}: expected a LayerLayout, got {_kind(layer)}")
        if not layer.main:
            raise ValueError(f"layer {name!r}: needs at least one main tensor")
        if layer.scale is not None and layer.indexer is None:
            raise ValueError(f"layer {name!r}: a scale tensor needs an indexer tensor")
        tensors = list(layer.main)
        extra = [t for t in (layer.indexer, layer.scale) if t is not None]
        for i, t in enumerate(tensors + extra):
            if type(t) is not TensorLayout:
                raise TypeError(f"layer {name!r}: tensor {i} is a {_kind(t)}, not a TensorLayout")
            try:
                _check_tensor(t.base_addr, t.block_len, t.block_size_scale, t.num_blocks, t.block_stride, str(i))
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"layer {name!r}: {exc}") from None
        tensors += extra
        entry: dict[str, Any] = {
            "base_addrs": [t.base_addr for t in tensors],
            "block_len": [t.block_len for t in tensors],
            "block_size_scale": [t.block_size_scale for t in tensors],
            "num_blocks": [t.num_blocks for t in tensors],
            "tensor_group_idx": [0] * len(layer.main) + [1] * len(extra),
            "main_tensor_count": len(layer.main),
            "has_indexer": layer.indexer is not None,
            "has_scale": layer.scale is not None,
        }
        if any(t.block_stride is not None for t in tensors):
            entry["block_stride"] = [t.block_stride for t in tensors]  # nil: dense
        if any(t.kind != HOST for t in tensors):
            entry["memory_kind"] = [t.kind for t in tensors]
        if layer.tag is not None:
            if type(layer.tag) is not LayoutTag:
                raise TypeError(f"layer {name!r}: tag is a {_kind(layer.tag)}, not a LayoutTag")
            entry["tag"] = _encode_tag(layer.tag)
        out[name] = entry
    return msgpack.packb(out)


def _decode_layer(entry: object, strict: bool) -> LayerLayout:
    """One layer's map -> LayerLayout; raises TypeError/ValueError naming the key."""
    if type(entry) is not dict:
        raise TypeError(f"expected a map, got {_kind(entry)}")

    def get(key: str, default: object = None) -> Any:
        if key in entry:
            return entry[key]
        if default is None:
            raise ValueError(f"{key}: missing")
        return default

    main_count = get("main_tensor_count")
    _check_int(main_count, "main_tensor_count", 1, 2**31)
    has_indexer = get("has_indexer")
    has_scale = get("has_scale", None if strict else False)
    for key, flag in (("has_indexer", has_indexer), ("has_scale", has_scale)):
        if type(flag) is not bool:
            raise TypeError(f"{key}: expected a boolean, got {_kind(flag)}")
    if has_scale and not has_indexer:
        raise ValueError("has_scale: a scale tensor needs an indexer tensor (has_indexer is false)")
    count = main_count + has_indexer + has_scale
    lists = {}
    for key in (*_TENSOR_LISTS, "block_stride"):
        if key == "block_stride" and key not in entry:
            values: object = (None,) * count  # an older peer, or every tensor dense
        elif key == "num_blocks" and not strict and key not in entry:
            values = (None,) * count  # legacy peer: counts not sent, see _check_tensor
        else:
            values = get(key)
        if type(values) is not tuple:
            raise TypeError(f"{key}: expected an array, got {_kind(values)}")
        if len(values) != count:
            raise ValueError(
                f"{key}: has {len(values)} entries, main_tensor_count + has_indexer + has_scale = {count}"
            )
        lists[key] = values
    for i, group in enumerate(lists["tensor_group_idx"]):
        _check_int(group, f"tensor_group_idx[{i}]")
    kinds = _decode_kinds(entry.get("memory_kind"), count)
    tensors = []
    for i in range(count):
        base, length, scale, blocks, stride = (lists[k][i] for k in (*_TENSOR_LISTS[:4], "block_stride"))
        blocks = _check_tensor(base, length, scale, blocks, stride, str(i))
        tensors.append(TensorLayout(base, length, blocks, scale, kinds[i], block_stride=stride))
    indexer = tensors[main_count] if has_indexer else None
    scale_t = tensors[main_count + 1] if has_scale else None
    tag = _decode_tag(entry["tag"]) if "tag" in entry else None
    return LayerLayout(tuple(tensors[:main_count]), indexer, scale_t, tag)


def _decode_kinds(kinds: object, count: int) -> tuple[str, ...]:
    """The memory kind of each of ``count`` tensors; every one host when the key is absent
    (a peer before layout 4, or every tensor in host memory)."""
    if kinds is None:
        return (HOST,) * count
    if type(kinds) is not tuple:
        raise TypeError(f"memory_kind: expected an array, got {_kind(kinds)}")
    if len(kinds) != count:
        raise ValueError(f"memory_kind: has {len(kinds)} entries, main_tensor_count + has_indexer + has_scale = {count}")
    for i, kind in enumerate(kinds):
        check_memory_kind(kind, f"memory_kind[{i}]")
    return kinds


def decode_layer_metadata(data: bytes, *, layout_version: int | None = None) -> dict[str, LayerLayout]:
    """Decode and validate an mf_meta ``layer_metadata`` map.

    With ``layout_version=None`` every form is read: a key missing from a legacy map takes
    its legacy default (``has_scale`` false; without ``num_blocks`` each tensor is taken to
    run to the end of the int64 address space). From layout 2 on those keys are required;
    with 1 they are optional. ``block_stride`` and ``tag`` (layout 3) and ``memory_kind``
    (layout 4) are optional in every version: absent, tensors are dense, the layer states no
    tag and every tensor is host memory. A malformed kind is refused like any malformed key
    (a well-formed kind the reading engine cannot move is the engine's refusal, not the
    codec's: ``rd2h.engine_support.check_peer_kinds``). Unknown keys are ignored
    (append-only evolution). Raises RemoteProtocolError naming the layer and key,
    IncompatiblePeerError for a layout version this build does not know.
    """
    if layout_version is not None and layout_version not in READ_LAYOUT_VERSIONS:
        raise IncompatiblePeerError(
            f"cache layout version {layout_version} is unknown to this build (it reads "
            f"{', '.join(map(str, READ_LAYOUT_VERSIONS))}): run the same rd2h version on both sides"
        )
    obj = _unpack(data, "layer_metadata")
    if type(obj) is not dict:
        raise RemoteProtocolError(f"layer_metadata: expected a map, got {_kind(obj)}")
    strict = layout_version is not None and layout_version > LEGACY_LAYOUT_VERSION
    layers: dict[str, LayerLayout] = {}
    for name, entry in obj.items():
        if type(name) is not str or not name:
            raise RemoteProtocolError("layer_metadata: layer names must be non-empty strings")
        try:
            layers[name] = _decode_layer(entry, strict)
        except (TypeError, ValueError) as exc:
            raise RemoteProtocolError(f"layer_metadata[{name[:80]!r}]: {exc}") from exc
    return layers
