"""Wire messages of rd2h and their codec (pure: bytes in, typed messages out; no I/O).

Every message but one is a single msgpack array: a tag (msgpack bin, e.g. ``b"read_done"``)
followed by positional fields. The exception is the reply to ``mf_meta``: the raw three-byte
frame ``b"ACK"``, which is not msgpack. ``docs/protocol.md`` is the reference for peers
written in other languages.

Evolution is append-only: a newer peer may add trailing fields, which this decoder ignores,
and a field missing from the end of a message takes the default its field table gives
(the legacy value). A field is never removed, reordered or given a new meaning.

Decoding is strict: any input either decodes to a message whose every field is valid or
raises :class:`~rd2h.errors.RemoteProtocolError`, whose text names the message and the
field. Constructing a message locally with bad fields raises ``TypeError``/``ValueError``;
those are programming errors, not peer errors.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

import msgpack
import numpy as np
import numpy.typing as npt

from rd2h.errors import IncompatiblePeerError, RemoteProtocolError
from rd2h.layout import LayerLayout, TensorLayout

__all__ = [
    "PROTOCOL_VERSION",
    "LAYOUT_VERSION",
    "LEGACY_PROTOCOL_VERSION",
    "LEGACY_LAYOUT_VERSION",
    "META_REQUIRED",
    "ACK_FRAME",
    "MfMeta",
    "Ack",
    "ReadRequest",
    "ReadReadyBatch",
    "ReadDone",
    "ReadFailed",
    "Request",
    "Reply",
    "Message",
    "check_compatible",
    "encode_layer_metadata",
    "decode_layer_metadata",
    "encode",
    "pack_read_reqs",
    "encode_readiness",
    "decode",
    "decode_request",
    "decode_reply",
]

PROTOCOL_VERSION = 2
LAYOUT_VERSION = 2  # v2 adds num_blocks and has_scale to the layer metadata
LEGACY_PROTOCOL_VERSION = 1  # the reference implementation's 3-field mf_meta
LEGACY_LAYOUT_VERSION = 1
META_REQUIRED = "rd2h: mf_meta required before readiness"
ACK_FRAME = b"ACK"

_MF_META = b"mf_meta"
_READ_READY_BATCH = b"read_ready_batch"
_READ_DONE = b"read_done"
_READ_FAILED = b"read_failed"

# Every integer on the wire must fit a signed 64-bit slot: addresses and block ids end up in
# numpy int64 arrays on the way to the transfer engine.
_INT_END = 2**63
_VERSION_END = 2**32
# Index of the most significant byte of each 8-byte slot of array("Q"): see _as_block_ids.
_TOP_BYTE = 7 if sys.byteorder == "little" else 0


# -- field checks (local construction raises TypeError/ValueError naming the field) --------


def _kind(value: object) -> str:
    return type(value).__name__


def _check_int(value: object, field: str, lo: int = 0, end: int = _INT_END) -> None:
    if type(value) is not int:  # bool is rejected on purpose
        raise TypeError(f"{field}: expected an integer, got {_kind(value)}")
    if not lo <= value < end:
        raise ValueError(f"{field}: {value} is outside {lo}..{end - 1}")


def _check_str(value: object, field: str, *, allow_empty: bool = False) -> None:
    if type(value) is not str:
        raise TypeError(f"{field}: expected a string, got {_kind(value)}")
    if not value and not allow_empty:
        raise ValueError(f"{field}: must not be empty")


def _as_bytes(value: object, field: str) -> bytes:
    if type(value) is bytes:
        return value
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"{field}: expected bytes, got {_kind(value)}")


def _as_str_tuple(value: object, field: str) -> tuple[str, ...]:
    if type(value) is not tuple:
        if type(value) is not list:
            raise TypeError(f"{field}: expected a tuple or list of strings, got {_kind(value)}")
        value = tuple(value)
    for i, item in enumerate(value):
        _check_str(item, f"{field}[{i}]")
    return value  # type: ignore[return-value]


def _as_block_ids(value: object, field: str) -> tuple[tuple[int, ...], array]:
    """Return the ids as a tuple of ints in 0..2**63-1, checked without a Python loop.

    array("Q") rejects negative and non-integer items in C; a value of 2**63 or more is
    the only thing it lets through, and such a value is exactly one whose top byte has its
    high bit set, which ``bytes.isascii`` finds in one pass. Booleans are the one non-int
    this lets through (read as 0/1): telling them apart needs a per-item type test that
    would double the cost of decoding a readiness message.
    """
    if type(value) is not tuple:
        if isinstance(value, (list, range)):
            value = tuple(value)
        elif isinstance(value, array) or getattr(value, "ndim", None) == 1:
            value = tuple(value.tolist())  # numpy: Python ints, which msgpack can pack
        else:
            raise TypeError(f"{field}: expected a tuple, list or 1-D array of block ids, got {_kind(value)}")
    try:
        packed = array("Q", value)  # type: ignore[arg-type]
    except OverflowError:
        raise ValueError(f"{field}: block ids must lie in 0..{_INT_END - 1}") from None
    except TypeError:
        raise TypeError(f"{field}: block ids must be integers") from None
    if not packed.tobytes()[_TOP_BYTE::8].isascii():
        raise ValueError(f"{field}: block ids must lie in 0..{_INT_END - 1}")
    return value, packed  # type: ignore[return-value]


def _int64_view(packed: array) -> npt.NDArray[np.int64]:
    if not len(packed):
        return np.empty(0, dtype=np.int64)
    view = np.frombuffer(packed, dtype=np.int64)  # every id was checked to be < 2**63
    view.flags.writeable = False
    return view


def _set(obj: object, name: str, value: object) -> None:
    object.__setattr__(obj, name, value)  # normalising a field of a frozen dataclass


# -- messages ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MfMeta:
    """Prefill -> Decode, once per connection before any readiness: who I am, where my cache is.

    ``layer_metadata`` is the msgpack map built by :func:`encode_layer_metadata`;
    ``engine_metadata`` is opaque to rd2h, produced by the transfer engine's ``register`` and
    consumed by its ``connect``. The version fields default to this build's versions; on the
    wire, a message without them is a legacy (version 1) peer.
    """

    p_session: str
    layer_metadata: bytes
    protocol_version: int = PROTOCOL_VERSION
    layout_version: int = LAYOUT_VERSION
    engine_metadata: bytes = b""

    def __post_init__(self) -> None:
        _check_str(self.p_session, "p_session", allow_empty=True)
        _set(self, "layer_metadata", _as_bytes(self.layer_metadata, "layer_metadata"))
        _check_int(self.protocol_version, "protocol_version", 1, _VERSION_END)
        _check_int(self.layout_version, "layout_version", 1, _VERSION_END)
        _set(self, "engine_metadata", _as_bytes(self.engine_metadata, "engine_metadata"))

    @classmethod
    def from_layers(
        cls, p_session: str, layers: Mapping[str, LayerLayout], *, engine_metadata: bytes = b""
    ) -> MfMeta:
        """Build this build's mf_meta from layouts. Raises TypeError/ValueError on bad layouts."""
        return cls(p_session, encode_layer_metadata(layers), engine_metadata=engine_metadata)

    def layers(self) -> dict[str, LayerLayout]:
        """Decode ``layer_metadata``.

        Raises RemoteProtocolError if it is malformed, IncompatiblePeerError if its layout
        version is unknown to this build.
        """
        return decode_layer_metadata(self.layer_metadata, layout_version=self.layout_version)


@dataclass(frozen=True, slots=True)
class Ack:
    """Decode -> Prefill: the mf_meta was stored. On the wire the raw frame ``b"ACK"``."""


@dataclass(frozen=True, slots=True)
class ReadRequest:
    """One request in a readiness: its Prefill block ids and where its destinations start.

    ``main_start_block``/``indexer_start_block`` are offsets into the request's destination
    lists on Decode (chunked Prefill sends later chunks with a non-zero start). Lists and
    numpy arrays of ids are accepted and stored as tuples of ints.
    """

    ext_req_id: str
    main_block_ids: tuple[int, ...]
    indexer_block_ids: tuple[int, ...]
    main_start_block: int = 0
    indexer_start_block: int = 0
    # the ids as packed uint64, kept from validation so Decode gets int64 arrays without a copy
    _main_packed: array = field(init=False, repr=False, compare=False, default=None)  # type: ignore[assignment]
    _indexer_packed: array = field(init=False, repr=False, compare=False, default=None)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        _check_str(self.ext_req_id, "ext_req_id")
        main = self.main_block_ids
        indexer = self.indexer_block_ids
        main_ids, main_packed = _as_block_ids(main, "main_block_ids")
        _set(self, "main_block_ids", main_ids)
        _set(self, "_main_packed", main_packed)
        if indexer is main:  # the legacy form shares one list; check it once
            _set(self, "indexer_block_ids", main_ids)
            _set(self, "_indexer_packed", main_packed)
        else:
            index_ids, index_packed = _as_block_ids(indexer, "indexer_block_ids")
            _set(self, "indexer_block_ids", index_ids)
            _set(self, "_indexer_packed", index_packed)
        _check_int(self.main_start_block, "main_start_block")
        _check_int(self.indexer_start_block, "indexer_start_block")

    def main_ids(self) -> npt.NDArray[np.int64]:
        """``main_block_ids`` as a read-only int64 array (a view, no copy)."""
        return _int64_view(self._main_packed)

    def indexer_ids(self) -> npt.NDArray[np.int64]:
        """``indexer_block_ids`` as a read-only int64 array (a view, no copy)."""
        return _int64_view(self._indexer_packed)


@dataclass(frozen=True, slots=True)
class ReadReadyBatch:
    """Prefill -> Decode: layer ``layer_idx`` is ready for these requests; read them.

    ``done_ext_ids`` are the requests whose final chunk reached the last cache-bearing layer.
    ``group_member_idx``/``tp_ratio`` place the sender in its contributor group (unequal TP).
    """

    layer_idx: int
    layer_name: str
    read_reqs: tuple[ReadRequest, ...]
    done_ext_ids: tuple[str, ...] = ()
    group_member_idx: int = 0
    tp_ratio: int = 1

    def __post_init__(self) -> None:
        _check_int(self.layer_idx, "layer_idx")
        _check_str(self.layer_name, "layer_name")
        reqs = self.read_reqs
        if type(reqs) is not tuple:
            if type(reqs) is not list:
                raise TypeError(f"read_reqs: expected a tuple or list of ReadRequest, got {_kind(reqs)}")
            reqs = tuple(reqs)
            _set(self, "read_reqs", reqs)
        for i, req in enumerate(reqs):
            if type(req) is not ReadRequest:
                raise TypeError(f"read_reqs[{i}]: expected a ReadRequest, got {_kind(req)}")
        _set(self, "done_ext_ids", _as_str_tuple(self.done_ext_ids, "done_ext_ids"))
        _check_int(self.tp_ratio, "tp_ratio", 1)
        _check_int(self.group_member_idx, "group_member_idx", 0, self.tp_ratio)


@dataclass(frozen=True, slots=True)
class ReadDone:
    """Decode -> Prefill: every request of the readiness for ``layer_idx`` was read."""

    layer_idx: int

    def __post_init__(self) -> None:
        _check_int(self.layer_idx, "layer_idx")


@dataclass(frozen=True, slots=True)
class ReadFailed:
    """Decode -> Prefill: the readiness for ``layer_idx`` was not (wholly) read.

    An empty ``failed_ext_ids`` (also what a legacy 3-field message means) says every request
    of that readiness failed. A non-empty one names the requests that failed; the others
    were read and are complete for this layer. Either way the reply releases the storage
    slot on Prefill. ``error`` equal to :data:`META_REQUIRED` means Decode has no mf_meta for
    this connection (it restarted): Prefill re-sends mf_meta before its next readiness.
    """

    layer_idx: int
    error: str
    failed_ext_ids: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _check_int(self.layer_idx, "layer_idx")
        _check_str(self.error, "error", allow_empty=True)
        _set(self, "failed_ext_ids", _as_str_tuple(self.failed_ext_ids, "failed_ext_ids"))

    @classmethod
    def meta_required(cls, layer_idx: int) -> ReadFailed:
        """The reply to a readiness that arrived before any mf_meta on its connection."""
        return cls(layer_idx, META_REQUIRED)

    @property
    def needs_meta(self) -> bool:
        """True when Decode asks for mf_meta again (it lost it, e.g. by restarting)."""
        return self.error == META_REQUIRED

    @property
    def all_failed(self) -> bool:
        """True when every request of the readiness failed."""
        return not self.failed_ext_ids

    def failed(self, ext_req_id: str) -> bool:
        """Whether request ``ext_req_id`` (one of the readiness) failed for this layer."""
        return not self.failed_ext_ids or ext_req_id in self.failed_ext_ids


Request = MfMeta | ReadReadyBatch  # what Decode receives
Reply = Ack | ReadDone | ReadFailed  # what Prefill receives
Message = Request | Reply


def check_compatible(meta: MfMeta, *, accept_legacy: bool = False) -> None:
    """Refuse a peer whose protocol or cache-layout version differs from this build's.

    A legacy peer (protocol 1, layout 1: the reference implementation) is accepted only with
    ``accept_legacy=True``. Raises IncompatiblePeerError saying both versions and what to do.
    """
    theirs = (meta.protocol_version, meta.layout_version)
    if theirs == (PROTOCOL_VERSION, LAYOUT_VERSION):
        return
    peer = f"peer {meta.p_session[:80]!r} speaks protocol {theirs[0]}, cache layout {theirs[1]}"
    ours = f"this build speaks protocol {PROTOCOL_VERSION}, cache layout {LAYOUT_VERSION}"
    if theirs == (LEGACY_PROTOCOL_VERSION, LEGACY_LAYOUT_VERSION):
        if accept_legacy:
            return
        raise IncompatiblePeerError(
            f"{peer} (a legacy build); {ours}. Mixing legacy and unequal-TP contributor builds "
            "can duplicate writes, so the handshake is refused. Upgrade the peer to rd2h, or "
            "accept legacy peers (accept_legacy=True) only where Prefill and Decode TP sizes "
            "are equal."
        )
    raise IncompatiblePeerError(
        f"{peer}; {ours}. The handshake is refused rather than risk reading a layout "
        "differently on the two sides: run the same rd2h version on Prefill and Decode."
    )


# -- layer metadata ---------------------------------------------------------------------------

_TENSOR_LISTS = ("base_addrs", "block_len", "block_size_scale", "num_blocks", "tensor_group_idx")


def _check_tensor(base_addr: int, block_len: int, scale: int, num_blocks: int | None, where: str) -> int:
    """Check one tensor's numbers; return its block count (``None``: unknown, legacy peer).

    A legacy peer does not send block counts. Its tensors are then taken to run to the end
    of the int64 address space: range checks against that count never reject a real block
    id, and Decode's registered-region checks remain the bound that protects memory.
    """
    _check_int(base_addr, f"base_addrs[{where}]")
    _check_int(block_len, f"block_len[{where}]", 1)
    _check_int(scale, f"block_size_scale[{where}]", 1)
    stride = block_len * scale
    room = (_INT_END - 1 - base_addr) // stride  # whole blocks that end below 2**63
    if num_blocks is None:
        if room == 0:
            raise ValueError(f"tensor {where}: not one block fits below the int64 address limit")
        return room
    _check_int(num_blocks, f"num_blocks[{where}]")
    if num_blocks > room:
        raise ValueError(f"tensor {where} ends past the int64 address space")
    return num_blocks


def encode_layer_metadata(layers: Mapping[str, LayerLayout]) -> bytes:
    """Encode layouts as the ``layer_metadata`` map of mf_meta (layout version 2).

    Tensor order per layer: the main tensors, the indexer, the scale. Raises TypeError or
    ValueError on a layout that could not be decoded again (a scale without an indexer,
    no main tensor, a non-positive length).
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
                _check_tensor(t.base_addr, t.block_len, t.block_size_scale, t.num_blocks, str(i))
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"layer {name!r}: {exc}") from None
        tensors += extra
        out[name] = {
            "base_addrs": [t.base_addr for t in tensors],
            "block_len": [t.block_len for t in tensors],
            "block_size_scale": [t.block_size_scale for t in tensors],
            "num_blocks": [t.num_blocks for t in tensors],
            "tensor_group_idx": [0] * len(layer.main) + [1] * len(extra),
            "main_tensor_count": len(layer.main),
            "has_indexer": layer.indexer is not None,
            "has_scale": layer.scale is not None,
        }
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
    for key in _TENSOR_LISTS:
        if key == "num_blocks" and not strict and key not in entry:
            values: object = (None,) * count  # legacy peer: counts not sent, see _check_tensor
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
    tensors = []
    for i in range(count):
        base, length, scale, blocks = (lists[k][i] for k in _TENSOR_LISTS[:4])
        blocks = _check_tensor(base, length, scale, blocks, str(i))
        tensors.append(TensorLayout(base, length, blocks, scale))
    indexer = tensors[main_count] if has_indexer else None
    scale_t = tensors[main_count + 1] if has_scale else None
    return LayerLayout(tuple(tensors[:main_count]), indexer, scale_t)


def decode_layer_metadata(data: bytes, *, layout_version: int | None = None) -> dict[str, LayerLayout]:
    """Decode and validate an mf_meta ``layer_metadata`` map.

    With ``layout_version=None`` both forms are read: a key missing from a legacy map takes
    its legacy default (``has_scale`` false; without ``num_blocks`` each tensor is taken to
    run to the end of the int64 address space). With 2 those keys are
    required; with 1 they are optional. Unknown keys are ignored (append-only evolution).
    Raises RemoteProtocolError naming the layer and key, IncompatiblePeerError for a layout
    version this build does not know.
    """
    if layout_version is not None and layout_version not in (LEGACY_LAYOUT_VERSION, LAYOUT_VERSION):
        raise IncompatiblePeerError(
            f"cache layout version {layout_version} is unknown to this build (it reads "
            f"{LEGACY_LAYOUT_VERSION} and {LAYOUT_VERSION}): run the same rd2h version on both sides"
        )
    obj = _unpack(data, "layer_metadata")
    if type(obj) is not dict:
        raise RemoteProtocolError(f"layer_metadata: expected a map, got {_kind(obj)}")
    strict = layout_version == LAYOUT_VERSION
    layers: dict[str, LayerLayout] = {}
    for name, entry in obj.items():
        if type(name) is not str or not name:
            raise RemoteProtocolError("layer_metadata: layer names must be non-empty strings")
        try:
            layers[name] = _decode_layer(entry, strict)
        except (TypeError, ValueError) as exc:
            raise RemoteProtocolError(f"layer_metadata[{name[:80]!r}]: {exc}") from exc
    return layers


# -- codec ------------------------------------------------------------------------------------


def _to_builtin(obj: object) -> object:
    # Called by msgpack only for types it does not know: numpy integers inside id tuples.
    if hasattr(obj, "__index__"):
        return obj.__index__()  # type: ignore[attr-defined]
    raise TypeError(f"cannot encode {_kind(obj)}")


def encode(msg: Message) -> bytes:
    """The wire bytes of ``msg``: one msgpack array, or ``b"ACK"`` for :class:`Ack`.

    Raises TypeError if ``msg`` is not an rd2h message.
    """
    kind = type(msg)
    if kind is ReadReadyBatch:
        fields: object = (
            _READ_READY_BATCH,
            msg.layer_idx,
            msg.layer_name,
            [
                (r.ext_req_id, r.main_block_ids, r.indexer_block_ids, r.main_start_block, r.indexer_start_block)
                for r in msg.read_reqs
            ],
            msg.done_ext_ids,
            msg.group_member_idx,
            msg.tp_ratio,
        )
    elif kind is ReadDone:
        fields = (_READ_DONE, msg.layer_idx)
    elif kind is ReadFailed:
        fields = (_READ_FAILED, msg.layer_idx, msg.error, msg.failed_ext_ids)
    elif kind is MfMeta:
        fields = (
            _MF_META,
            msg.p_session,
            msg.layer_metadata,
            msg.protocol_version,
            msg.layout_version,
            msg.engine_metadata,
        )
    elif kind is Ack:
        return ACK_FRAME
    else:
        raise TypeError(f"not an rd2h message: {kind.__name__}")
    return msgpack.packb(fields, default=_to_builtin)


def pack_read_reqs(read_reqs: Sequence[ReadRequest]) -> bytes:
    """The ``read_reqs`` field of a readiness, encoded once for :func:`encode_readiness`.

    Prefill announces the same requests for every layer of a step; packing their block ids
    once per step instead of once per layer keeps the sender off a per-id cost per layer.
    """
    for i, req in enumerate(read_reqs):
        if type(req) is not ReadRequest:
            raise TypeError(f"read_reqs[{i}]: expected a ReadRequest, got {_kind(req)}")
    return msgpack.packb(
        [(r.ext_req_id, r.main_block_ids, r.indexer_block_ids, r.main_start_block, r.indexer_start_block)
         for r in read_reqs]
    )


def encode_readiness(
    layer_idx: int,
    layer_name: str,
    packed_reqs: bytes,
    done_ext_ids: Sequence[str] = (),
    group_member_idx: int = 0,
    tp_ratio: int = 1,
) -> bytes:
    """The same bytes as ``encode(ReadReadyBatch(...))``, from ``pack_read_reqs`` output."""
    _check_int(layer_idx, "layer_idx")
    _check_str(layer_name, "layer_name")
    done = _as_str_tuple(done_ext_ids, "done_ext_ids")
    _check_int(tp_ratio, "tp_ratio", 1)
    _check_int(group_member_idx, "group_member_idx", 0, tp_ratio)
    head = msgpack.packb((_READ_READY_BATCH, layer_idx, layer_name))[1:]  # drop its array header
    tail = msgpack.packb((done, group_member_idx, tp_ratio))[1:]
    return b"\x97" + head + packed_reqs + tail  # 0x97: an array of 7 fields


def _reject_ext(code: int, data: bytes) -> object:
    raise ValueError(f"msgpack extension type {code} is not used by rd2h")


def _unpack(data: object, what: str) -> Any:
    """msgpack -> Python with arrays as tuples and every size capped by the input's size."""
    if isinstance(data, memoryview):
        size = data.nbytes
    elif isinstance(data, (bytes, bytearray)):
        size = len(data)
    else:
        raise RemoteProtocolError(f"{what}: expected bytes, got {_kind(data)}")
    try:
        return msgpack.unpackb(
            data,
            use_list=False,
            raw=False,
            strict_map_key=True,
            max_str_len=size,
            max_bin_len=size,
            max_array_len=size,
            max_map_len=size // 2,
            max_ext_len=0,
            ext_hook=_reject_ext,
        )
    except Exception as exc:  # msgpack raises many kinds; all mean "not a valid frame"
        raise RemoteProtocolError(f"{what}: not one well-formed msgpack value ({_kind(exc)}: {exc})") from exc


def _decode_mf_meta(f: tuple[Any, ...]) -> MfMeta:
    n = len(f)
    if n < 3:
        raise ValueError(f"needs at least 3 fields, got {n}")
    meta = MfMeta(
        f[1],
        f[2],
        f[3] if n > 3 else LEGACY_PROTOCOL_VERSION,
        f[4] if n > 4 else LEGACY_LAYOUT_VERSION,
        f[5] if n > 5 else b"",
    )
    # Validate the nested map now for the layout versions this build reads; for any other the
    # bytes stay opaque and check_compatible refuses the peer with the better message.
    if meta.layout_version in (LEGACY_LAYOUT_VERSION, LAYOUT_VERSION):
        try:
            meta.layers()
        except RemoteProtocolError as exc:
            raise ValueError(str(exc)) from exc
    return meta


def _decode_read_request(entry: object, i: int) -> ReadRequest:
    if type(entry) is not tuple:
        raise TypeError(f"read_reqs[{i}]: expected an array, got {_kind(entry)}")
    n = len(entry)
    try:
        if n >= 5:
            return ReadRequest(entry[0], entry[1], entry[2], entry[3], entry[4])
        if n >= 3:
            return ReadRequest(entry[0], entry[1], entry[2], entry[3] if n == 4 else 0)
        if n == 2:  # legacy: one id list for main and indexer
            return ReadRequest(entry[0], entry[1], entry[1])
    except (TypeError, ValueError) as exc:
        raise ValueError(f"read_reqs[{i}].{exc}") from None
    raise ValueError(f"read_reqs[{i}]: needs at least 2 fields, got {n}")


def _decode_read_ready_batch(f: tuple[Any, ...]) -> ReadReadyBatch:
    n = len(f)
    if n < 5:
        raise ValueError(f"needs at least 5 fields, got {n}")
    entries = f[3]
    if type(entries) is not tuple:
        raise TypeError(f"read_reqs: expected an array, got {_kind(entries)}")
    reqs = tuple([_decode_read_request(e, i) for i, e in enumerate(entries)])
    return ReadReadyBatch(f[1], f[2], reqs, f[4], *f[5:7])


def _decode_read_done(f: tuple[Any, ...]) -> ReadDone:
    if len(f) < 2:
        raise ValueError(f"needs at least 2 fields, got {len(f)}")
    return ReadDone(f[1])


def _decode_read_failed(f: tuple[Any, ...]) -> ReadFailed:
    n = len(f)
    if n < 3:
        raise ValueError(f"needs at least 3 fields, got {n}")
    return ReadFailed(f[1], f[2], f[3] if n > 3 else ())


_REQUEST_DECODERS: dict[bytes, Callable[[tuple[Any, ...]], Any]] = {
    _MF_META: _decode_mf_meta,
    _READ_READY_BATCH: _decode_read_ready_batch,
}
_REPLY_DECODERS: dict[bytes, Callable[[tuple[Any, ...]], Any]] = {
    _READ_DONE: _decode_read_done,
    _READ_FAILED: _decode_read_failed,
}
_ALL_DECODERS = {**_REQUEST_DECODERS, **_REPLY_DECODERS}


def _is_ack(data: object) -> bool:
    return isinstance(data, (bytes, bytearray, memoryview)) and len(data) == 3 and bytes(data) == ACK_FRAME


def _decode(data: object, decoders: Mapping[bytes, Callable[[tuple[Any, ...]], Any]], expected: str) -> Any:
    obj = _unpack(data, "message")
    if type(obj) is not tuple or not obj:
        raise RemoteProtocolError(f"message: expected a non-empty array, got {_kind(obj)}")
    tag = obj[0]
    if type(tag) is str:  # peers whose msgpack packs byte strings as str: accepted on input
        tag = tag.encode("utf-8", "surrogatepass")
    elif type(tag) is not bytes:
        raise RemoteProtocolError(f"message: the tag must be a byte string, got {_kind(tag)}")
    decoder = decoders.get(tag)
    if decoder is None:
        known = "unknown" if tag not in _ALL_DECODERS else "unexpected"
        raise RemoteProtocolError(f"message: {known} tag {tag[:40]!r}, expected {expected}")
    name = tag.decode("ascii")
    try:
        return decoder(obj)
    except (TypeError, ValueError) as exc:
        raise RemoteProtocolError(f"{name}: {exc}") from exc


def decode_request(data: bytes) -> Request:
    """Decode what Decode receives from Prefill: :class:`MfMeta` or :class:`ReadReadyBatch`.

    Raises RemoteProtocolError for anything else, naming the message and field.
    """
    if _is_ack(data):
        raise RemoteProtocolError("message: ACK is a reply; Decode does not expect one")
    return _decode(data, _REQUEST_DECODERS, "mf_meta or read_ready_batch")  # type: ignore[no-any-return]


def decode_reply(data: bytes) -> Reply:
    """Decode what Prefill receives from Decode: :class:`Ack`, :class:`ReadDone` or :class:`ReadFailed`.

    Raises RemoteProtocolError for anything else, naming the message and field.
    """
    if _is_ack(data):  # not msgpack: b"A" would read as the integer 65
        return Ack()
    return _decode(data, _REPLY_DECODERS, "ACK, read_done or read_failed")  # type: ignore[no-any-return]


def decode(data: bytes) -> Message:
    """Decode any rd2h message. Raises RemoteProtocolError, naming the message and field."""
    if _is_ack(data):
        return Ack()
    return _decode(data, _ALL_DECODERS, "an rd2h message tag")  # type: ignore[no-any-return]
