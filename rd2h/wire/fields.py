"""Field checks and the bounded msgpack reader shared by the wire codecs (pure, internal).

``rd2h.wire.protocol`` (messages) and ``rd2h.wire.layer_metadata`` (the map inside ``mf_meta``) both
validate peer input with these. Every check raises ``TypeError``/``ValueError`` naming the
field; the codecs turn those into :class:`~rd2h.errors.RemoteProtocolError` for peer input.
"""

from __future__ import annotations

import sys
from array import array
from typing import Any

import msgpack
import numpy as np
import numpy.typing as npt

from rd2h.errors import RemoteProtocolError

__all__ = [
    "INT_END", "VERSION_END", "kind", "check_int", "check_str", "as_bytes", "as_str_tuple", "unpack", "as_block_ids",
    "int64_view",
]  # fmt: skip

# Every integer on the wire must fit a signed 64-bit slot: addresses and block ids end up in
# numpy int64 arrays on the way to the transfer engine.
INT_END = 2**63
VERSION_END = 2**32


def kind(value: object) -> str:
    return type(value).__name__


def check_int(value: object, field: str, lo: int = 0, end: int = INT_END) -> None:
    if type(value) is not int:  # bool is rejected on purpose
        raise TypeError(f"{field}: expected an integer, got {kind(value)}")
    if not lo <= value < end:
        raise ValueError(f"{field}: {value} is outside {lo}..{end - 1}")


def check_str(value: object, field: str, *, allow_empty: bool = False) -> None:
    if type(value) is not str:
        raise TypeError(f"{field}: expected a string, got {kind(value)}")
    if not value and not allow_empty:
        raise ValueError(f"{field}: must not be empty")


def as_bytes(value: object, field: str) -> bytes:
    if type(value) is bytes:
        return value
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"{field}: expected bytes, got {kind(value)}")


def as_str_tuple(value: object, field: str) -> tuple[str, ...]:
    if type(value) is not tuple:
        if type(value) is not list:
            raise TypeError(f"{field}: expected a tuple or list of strings, got {kind(value)}")
        value = tuple(value)
    for i, item in enumerate(value):
        check_str(item, f"{field}[{i}]")
    return value  # type: ignore[return-value]


def _reject_ext(code: int, data: bytes) -> object:
    raise ValueError(f"msgpack extension type {code} is not used by rd2h")


def unpack(data: object, what: str) -> Any:
    """msgpack -> Python with arrays as tuples and every size capped by the input's size.

    Raises RemoteProtocolError naming ``what`` for anything but one well-formed value.
    """
    if isinstance(data, memoryview):
        size = data.nbytes
    elif isinstance(data, (bytes, bytearray)):
        size = len(data)
    else:
        raise RemoteProtocolError(f"{what}: expected bytes, got {kind(data)}")
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
        raise RemoteProtocolError(f"{what}: not one well-formed msgpack value ({kind(exc)}: {exc})") from exc


# Index of the most significant byte of each 8-byte slot of array("Q"): see as_block_ids.
_TOP_BYTE = 7 if sys.byteorder == "little" else 0


def as_block_ids(value: object, field: str) -> tuple[tuple[int, ...], array]:
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
            raise TypeError(f"{field}: expected a tuple, list or 1-D array of block ids, got {kind(value)}")
    try:
        packed = array("Q", value)  # type: ignore[arg-type]
    except OverflowError:
        raise ValueError(f"{field}: block ids must lie in 0..{INT_END - 1}") from None
    except TypeError:
        raise TypeError(f"{field}: block ids must be integers") from None
    if not packed.tobytes()[_TOP_BYTE::8].isascii():
        raise ValueError(f"{field}: block ids must lie in 0..{INT_END - 1}")
    return value, packed  # type: ignore[return-value]


def int64_view(packed: array) -> npt.NDArray[np.int64]:
    """The ids ``as_block_ids`` packed, as a read-only int64 array sharing their memory."""
    if not len(packed):
        return np.empty(0, dtype=np.int64)
    view = np.frombuffer(packed, dtype=np.int64)  # every id was checked to be < 2**63
    view.flags.writeable = False
    return view
