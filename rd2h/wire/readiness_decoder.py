"""Decoding a step's readiness once, not once per layer (pure: bytes in, messages out).

Prefill sends every layer of a step with the same ``read_reqs`` bytes (it packs them once,
see :func:`rd2h.wire.protocol.pack_read_reqs`); a Decode that decoded and validated them on
every layer paid a per-id cost per layer for nothing.
"""

from __future__ import annotations

from typing import Any

import msgpack

from rd2h.errors import RemoteProtocolError
from rd2h.wire.fields import INT_END
from rd2h.wire.protocol import _READ_READY_BATCH, ReadReadyBatch, ReadRequest, Request, _set, decode_request

__all__ = ["ReadinessDecoder"]


class ReadinessDecoder:
    """``decode_request`` that decodes a step's ``read_reqs`` once, not once per layer.

    Prefill sends every layer of a step with the same ``read_reqs`` bytes (it packs them once,
    see :func:`pack_read_reqs`). This decoder keeps the requests decoded from the last few
    distinct byte strings and, for a readiness that repeats one, decodes only the small
    fields around it. What it returns is what ``decode_request`` returns (plus ``reqs_bytes``
    on a readiness), and it raises the same RemoteProtocolError for anything else. One
    decoder per thread.
    """

    def __init__(self, remembered: int = 8) -> None:
        self._remembered = remembered
        self._known: dict[bytes, tuple[ReadRequest, ...]] = {}  # insertion order = age
        # the latest readiness decoded in full, cut around its layer fields: a frame that
        # starts and ends with the same bytes differs only in them (see _repeat)
        self._last: _Shape | None = None

    def decode(self, data: bytes) -> Request:
        repeat = self._repeat(data)
        if repeat is not None:
            return repeat
        split = _split_readiness(data)
        if split is None:  # not a plain readiness, or malformed: the full decoder says why
            return decode_request(data)
        head, reqs_bytes, tail = split
        reqs = self._known.get(reqs_bytes)
        if reqs is None:
            message = decode_request(data)
            assert isinstance(message, ReadReadyBatch)
            self._remember(reqs_bytes, message.read_reqs)
        else:
            try:
                message = ReadReadyBatch(head[1], head[2], reqs, *tail[:3])
            except (TypeError, ValueError) as exc:
                raise RemoteProtocolError(f"read_ready_batch: {exc}") from exc
        _set(message, "reqs_bytes", reqs_bytes)
        self._last = _Shape.of(data, head, message)
        return message

    def _repeat(self, data: bytes) -> ReadReadyBatch | None:
        """The next layer of the latest step, decoded from its two layer fields alone.

        Every layer of a step sends the same bytes before ``layer_idx`` (array header and
        tag) and after ``layer_name`` (the requests and the fields after them). A frame that
        starts and ends with those bytes, with exactly an int and a string between, is that
        readiness for another layer: msgpack objects follow one another without separators, so
        the full decoder would read the same fields. Anything else: None (decoded in full).
        """
        last = self._last
        if last is None or type(data) is not bytes:
            return None
        end = len(data) - len(last.suffix)
        if end <= len(last.prefix) or not (data.startswith(last.prefix) and data.endswith(last.suffix)):
            return None
        try:
            layer_idx, layer_name = msgpack.unpackb(
                b"\x92" + data[len(last.prefix):end], use_list=False, raw=False, max_ext_len=0
            )
        except Exception:  # noqa: BLE001 - not two objects: the full decoder says what it is
            return None
        if type(layer_idx) is not int or not 0 <= layer_idx < INT_END or type(layer_name) is not str or not layer_name:
            return None
        # the other fields were checked with the first layer: no __post_init__ (4 of 5 us here)
        message = _new_batch(ReadReadyBatch)
        for put, value in zip(_SETTERS, (layer_idx, layer_name, *last.fields)):
            put(message, value)
        return message

    def _remember(self, reqs_bytes: bytes, reqs: tuple[ReadRequest, ...]) -> None:
        self._known[reqs_bytes] = reqs
        while len(self._known) > self._remembered:
            del self._known[next(iter(self._known))]


_FIELDS = ("layer_idx", "layer_name", "read_reqs", "done_ext_ids", "group_member_idx", "tp_ratio", "reqs_bytes")
_SETTERS = tuple(getattr(ReadReadyBatch, name).__set__ for name in _FIELDS)  # the slots' own descriptors
_new_batch = object.__new__


class _Shape:
    """A decoded readiness cut around its layer fields: the bytes before ``layer_idx``, the
    bytes after ``layer_name`` and the decoded fields those bytes hold."""

    __slots__ = ("prefix", "suffix", "fields")

    def __init__(self, prefix: bytes, suffix: bytes, fields: tuple[Any, ...]) -> None:
        self.prefix, self.suffix, self.fields = prefix, suffix, fields

    @staticmethod
    def of(data: bytes, head: tuple[Any, ...], message: ReadReadyBatch) -> _Shape | None:
        prefix = data[: 1 + len(msgpack.packb(head[0]))]  # array header (one byte: <= 15 fields) + tag
        layer = msgpack.packb(head[1]) + msgpack.packb(head[2])
        if data[0] & 0xF0 != 0x90 or data[len(prefix): len(prefix) + len(layer)] != layer:
            return None  # not the usual encoding: no shortcut
        fields = (message.read_reqs, message.done_ext_ids, message.group_member_idx, message.tp_ratio, message.reqs_bytes)
        return _Shape(prefix, data[len(prefix) + len(layer):], fields)


def _split_readiness(data: object) -> tuple[tuple[Any, ...], bytes, tuple[Any, ...]] | None:
    """``(tag, layer_idx, layer_name)``, the raw ``read_reqs`` and the fields after them, for a
    well-formed readiness of at least 5 fields; None for anything else."""
    if not isinstance(data, bytes) or len(data) < 2:
        return None
    unpacker = msgpack.Unpacker(
        use_list=False, raw=False, strict_map_key=True, max_buffer_size=len(data),
        max_str_len=len(data), max_bin_len=len(data), max_array_len=len(data),
        max_map_len=len(data) // 2, max_ext_len=0,
    )
    unpacker.feed(data)
    try:
        fields = unpacker.read_array_header()
        if fields < 5:
            return None
        head = (unpacker.unpack(), unpacker.unpack(), unpacker.unpack())
        if head[0] != _READ_READY_BATCH:
            return None
        start = unpacker.tell()
        unpacker.skip()
        end = unpacker.tell()
        tail = tuple(unpacker.unpack() for _ in range(fields - 4))
        if unpacker.tell() != len(data):
            return None
    except Exception:  # noqa: BLE001 - any failure: let the full decoder name it
        return None
    return head, data[start:end], tail
