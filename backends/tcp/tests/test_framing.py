"""The tcp channel's wire, without sockets: greeting, length prefixes, and what ends a stream."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from rd2h_tcp.framing import IDENTITY_BYTES, MAGIC, FrameReader, encode

from rd2h.errors import FrameTooLargeError

IDENTITY = b"i" * IDENTITY_BYTES
GREETING = len(MAGIC) + IDENTITY_BYTES


def stream(payloads: list[bytes], limit: int = 1 << 20) -> bytes:
    return MAGIC + IDENTITY + b"".join(encode(p, limit) for p in payloads)


@given(
    payloads=st.lists(st.binary(min_size=1, max_size=300), max_size=12),
    cuts=st.lists(st.integers(min_value=0, max_value=4000), max_size=30),
)
def test_frames_come_out_whole_however_the_stream_is_cut(payloads: list[bytes], cuts: list[int]) -> None:
    data = stream(payloads)
    bounds = sorted({c for c in cuts if c < len(data)} | {0, len(data)})
    reader = FrameReader(1 << 20, GREETING)
    got: list[bytes] = []
    for lo, hi in zip(bounds, bounds[1:]):
        got.extend(reader.feed(data[lo:hi]))
    assert got == payloads
    assert reader.error is None and reader.identity == IDENTITY and reader.buffered == 0


def test_a_big_frame_fed_in_small_pieces_is_not_parsed_each_time() -> None:
    payload = bytes(range(256)) * 4096  # 1 MiB
    data = stream([payload])
    reader = FrameReader(1 << 21, GREETING)
    got: list[bytes] = []
    for start in range(0, len(data), 4096):
        got.extend(reader.feed(data[start:start + 4096]))
    assert got == [payload]


@pytest.mark.parametrize("head", [b"\xff\x00\x00\x00\x00\x00\x00\x00\x01\x7f", b"GET / HTTP/1.1\r\n", b"RD2HTCP2" + IDENTITY])
def test_another_protocol_is_an_error_at_its_first_bytes(head: bytes) -> None:
    reader = FrameReader(1 << 20, GREETING)
    assert reader.feed(head) == []
    assert reader.error is not None and "not an rd2h tcp peer" in reader.error
    assert reader.feed(stream([b"x"])) == []  # nothing after an error


def test_a_frame_over_the_limit_is_an_error_before_its_payload() -> None:
    reader = FrameReader(100, GREETING)
    data = MAGIC + IDENTITY + encode(b"ok", 100) + (101).to_bytes(4, "big")
    assert reader.feed(data) == [b"ok"]  # the frames before it still count
    assert reader.error is not None and "101 bytes" in reader.error and "max_frame_bytes=100" in reader.error


def test_an_empty_frame_is_an_error() -> None:
    reader = FrameReader(100, GREETING)
    assert reader.feed(MAGIC + IDENTITY + b"\0\0\0\0") == []
    assert reader.error == "an empty frame"


def test_the_listener_greeting_is_magic_alone() -> None:
    reader = FrameReader(100, len(MAGIC))
    assert reader.feed(MAGIC[:3]) == []
    assert reader.feed(MAGIC[3:] + encode(b"reply", 100)) == [b"reply"]
    assert reader.identity == b""


def test_encode_refuses_what_no_reader_accepts() -> None:
    with pytest.raises(FrameTooLargeError):
        encode(b"x" * 11, 10)
    with pytest.raises(ValueError):
        encode(b"", 10)
    assert encode(b"x" * 10, 10) == b"\0\0\0\x0a" + b"x" * 10
