"""Decoding a step's readiness once, not once per layer (pure: bytes in, messages out).

Prefill sends every layer of a step with the same ``read_reqs`` bytes (it packs them once,
see :func:`rd2h.wire.protocol.pack_read_reqs`); a Decode that decoded and validated them on
every layer paid a per-id cost per layer for nothing.
"""

from __future__ import annotations

from typing import Any

import msgpack

from rd2h.errors import RemoteProtocolError
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

    def decode(self, data: bytes) -> Request:
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
        return message

    def _remember(self, reqs_bytes: bytes, reqs: tuple[ReadRequest, ...]) -> None:
        self._known[reqs_bytes] = reqs
        while len(self._known) > self._remembered:
            del self._known[next(iter(self._known))]


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
