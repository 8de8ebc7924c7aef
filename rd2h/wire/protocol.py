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

``mf_meta`` has several wire forms; :mod:`rd2h.wire.mf_meta` holds them, :class:`MfMeta` and the
compatibility rule, and this module frames them with the other messages.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

import msgpack
import numpy as np
import numpy.typing as npt

from rd2h.errors import LayerFailedError, RD2HError, RemoteError, RemoteProtocolError, from_wire, wire_kind
from rd2h.wire.fields import as_block_ids as _as_block_ids
from rd2h.wire.fields import as_str_tuple as _as_str_tuple
from rd2h.wire.fields import check_int as _check_int
from rd2h.wire.fields import check_str as _check_str
from rd2h.wire.fields import int64_view as _int64_view
from rd2h.wire.fields import kind as _kind
from rd2h.wire.fields import unpack as _unpack
from rd2h.wire.mf_meta import (
    LEGACY_PROTOCOL_VERSION,
    PROTOCOL_VERSION,
    REFERENCE_PROTOCOL_VERSION,
    MetaForm,
    MfMeta,
    check_compatible,
    decode_mf_meta,
    mf_meta_fields,
)

__all__ = [
    "PROTOCOL_VERSION",
    "LEGACY_PROTOCOL_VERSION",
    "REFERENCE_PROTOCOL_VERSION",
    "META_REQUIRED",
    "ACK_FRAME",
    "MetaForm",
    "MfMeta",
    "Ack",
    "ReadRequest",
    "ReadReadyBatch",
    "ReadDone",
    "ReadFailed",
    "Settled",
    "read_ok",
    "Request",
    "Reply",
    "Message",
    "check_compatible",
    "encode",
    "pack_read_reqs",
    "encode_readiness",
    "decode",
    "decode_request",
    "decode_reply",
]

META_REQUIRED = "rd2h: mf_meta required before readiness"
ACK_FRAME = b"ACK"

_MF_META = b"mf_meta"
_READ_READY_BATCH = b"read_ready_batch"
_READ_DONE = b"read_done"
_READ_FAILED = b"read_failed"
_SETTLED = b"settled"

def _set(obj: object, name: str, value: object) -> None:
    object.__setattr__(obj, name, value)  # normalising a field of a frozen dataclass


# -- messages ---------------------------------------------------------------------------------


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
    # the read_reqs as they came on the wire (set by ReadinessDecoder): every layer of a step
    # repeats them byte for byte, so Decode keys what it derives from them on these bytes
    reqs_bytes: bytes = field(default=b"", repr=False, compare=False)

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

    ``error_kind`` is the class name of the rd2h error behind the failure
    (:func:`rd2h.errors.wire_kind`); :meth:`exception` rebuilds it on Prefill. A legacy peer
    sends none.
    """

    layer_idx: int
    error: str
    failed_ext_ids: tuple[str, ...] = ()
    error_kind: str = ""

    def __post_init__(self) -> None:
        _check_int(self.layer_idx, "layer_idx")
        _check_str(self.error, "error", allow_empty=True)
        _set(self, "failed_ext_ids", _as_str_tuple(self.failed_ext_ids, "failed_ext_ids"))
        _check_str(self.error_kind, "error_kind", allow_empty=True)

    @classmethod
    def from_error(cls, layer_idx: int, error: BaseException, failed_ext_ids: Sequence[str] = ()) -> ReadFailed:
        """The reply that carries ``error`` (its text and class) for ``failed_ext_ids``."""
        return cls(layer_idx, str(error), tuple(failed_ext_ids), wire_kind(error))

    @classmethod
    def meta_required(cls, layer_idx: int) -> ReadFailed:
        """The reply to a readiness that arrived before any mf_meta on its connection."""
        return cls(layer_idx, META_REQUIRED)

    def exception(self, sender: str | None = None) -> RD2HError:
        """The failure as an rd2h error of the class Decode sent, its message naming ``sender``
        (the Decode address) when given.

        A kind this build does not know becomes :class:`~rd2h.errors.RemoteError`. Without a
        kind (a legacy peer) a failure that names no request is a
        :class:`~rd2h.errors.LayerFailedError`, one that names requests a RemoteError.
        """
        message = self.error or f"Decode failed layer {self.layer_idx} without a reason"
        if sender is not None:
            message = f"{sender}: {message}"
        if self.error_kind:
            return from_wire(self.error_kind, message)
        return RemoteError(message) if self.failed_ext_ids else LayerFailedError(message)

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


@dataclass(frozen=True, slots=True)
class Settled:
    """Prefill -> Decode, never answered: how requests ended on this Prefill rank.

    ``done_ext_ids``: every readiness naming them was answered with success, so Prefill
    reports them DONE. A Decode rank reports a request DONE only once each contributor
    that speaks this protocol said so: a Prefill that gave up on Decode (its reply came
    too late) says it never, and the two sides cannot end one DONE, the other FAILED.
    ``failed_ext_ids``: they failed or were aborted here; Decode fails them too, at once
    instead of at its deadline, with ``error`` (its class name in ``error_kind``).
    """

    done_ext_ids: tuple[str, ...] = ()
    failed_ext_ids: tuple[str, ...] = ()
    error: str = ""
    error_kind: str = ""

    def __post_init__(self) -> None:
        _set(self, "done_ext_ids", _as_str_tuple(self.done_ext_ids, "done_ext_ids"))
        _set(self, "failed_ext_ids", _as_str_tuple(self.failed_ext_ids, "failed_ext_ids"))
        _check_str(self.error, "error", allow_empty=True)
        _check_str(self.error_kind, "error_kind", allow_empty=True)

    @classmethod
    def failure(cls, ext_ids: Sequence[str], error: BaseException) -> Settled:
        """The notice that ``ext_ids`` failed here with ``error`` (its text and class)."""
        return cls((), tuple(ext_ids), str(error), wire_kind(error))

    def exception(self) -> RD2HError:
        """The failure as an rd2h error of the class Prefill sent (RemoteError if unknown)."""
        return from_wire(self.error_kind, self.error or "Prefill failed the request without a reason")


Request = MfMeta | ReadReadyBatch | Settled  # what Decode receives
Reply = Ack | ReadDone | ReadFailed  # what Prefill receives
Message = Request | Reply


def read_ok(reply: Reply, ext_ids: Sequence[str]) -> tuple[str, ...]:
    """Those of ``ext_ids`` (requests of the readiness ``reply`` answers) that it says were
    read: what a Prefill that sent them on their final layer confirms in a ``settled``."""
    if isinstance(reply, ReadDone):
        return tuple(ext_ids)
    if isinstance(reply, ReadFailed):
        return tuple(e for e in ext_ids if not reply.failed(e))
    return ()


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
        fields = (_READ_FAILED, msg.layer_idx, msg.error, msg.failed_ext_ids, msg.error_kind)
    elif kind is Settled:
        fields = (_SETTLED, msg.done_ext_ids, msg.failed_ext_ids, msg.error, msg.error_kind)
    elif kind is MfMeta:
        fields = (_MF_META, *mf_meta_fields(msg))
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
    plain = type(done_ext_ids) is tuple and not done_ext_ids and type(group_member_idx) is int and type(tp_ratio) is int
    if plain and group_member_idx == 0 and tp_ratio == 1:
        tail = _PLAIN_TAIL  # most layers: no final signal, one contributor
    else:
        done = _as_str_tuple(done_ext_ids, "done_ext_ids")
        _check_int(tp_ratio, "tp_ratio", 1)
        _check_int(group_member_idx, "group_member_idx", 0, tp_ratio)
        tail = msgpack.packb((done, group_member_idx, tp_ratio))[1:]
    head = msgpack.packb((_READ_READY_BATCH, layer_idx, layer_name))[1:]  # drop its array header
    return b"\x97" + head + packed_reqs + tail  # 0x97: an array of 7 fields


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
    return ReadFailed(f[1], f[2], f[3] if n > 3 else (), f[4] if n > 4 else "")


def _decode_settled(f: tuple[Any, ...]) -> Settled:
    n = len(f)
    if n < 3:
        raise ValueError(f"needs at least 3 fields, got {n}")
    return Settled(f[1], f[2], f[3] if n > 3 else "", f[4] if n > 4 else "")


_REQUEST_DECODERS: dict[bytes, Callable[[tuple[Any, ...]], Any]] = {
    _MF_META: decode_mf_meta,
    _READ_READY_BATCH: _decode_read_ready_batch,
    _SETTLED: _decode_settled,
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
    """Decode what Decode receives from Prefill: :class:`MfMeta`, :class:`ReadReadyBatch` or
    :class:`Settled`.

    Raises RemoteProtocolError for anything else, naming the message and field.
    """
    if _is_ack(data):
        raise RemoteProtocolError("message: ACK is a reply; Decode does not expect one")
    return _decode(data, _REQUEST_DECODERS, "mf_meta, read_ready_batch or settled")  # type: ignore[no-any-return]


def decode_reply(data: bytes) -> Reply:
    """Decode what Prefill receives: :class:`Ack`, :class:`ReadDone`, :class:`ReadFailed`; else RemoteProtocolError."""
    if type(data) is bytes and (done := _DONE_SEEN.get(data)) is not None:
        return done  # the same bytes decode the same: a layer's READ_DONE is decoded once
    if _is_ack(data):  # not msgpack: b"A" would read as the integer 65
        return Ack()
    reply = _decode(data, _REPLY_DECODERS, "ACK, read_done or read_failed")
    if type(reply) is ReadDone and type(data) is bytes and len(data) <= 16:
        if len(_DONE_SEEN) >= 1 << 14:  # the layer index is the peer's to choose: bounded
            _DONE_SEEN.clear()
        _DONE_SEEN[data] = reply
    return reply  # type: ignore[no-any-return]


_DONE_SEEN: dict[bytes, ReadDone] = {}  # READ_DONE frames decoded (frozen messages: shared)
_PLAIN_TAIL = msgpack.packb(((), 0, 1))[1:]


def decode(data: bytes) -> Message:
    """Decode any rd2h message. Raises RemoteProtocolError, naming the message and field."""
    if _is_ack(data):
        return Ack()
    return _decode(data, _ALL_DECODERS, "an rd2h message tag")  # type: ignore[no-any-return]
