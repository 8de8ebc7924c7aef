"""Prefill decodes each layer's READ_DONE bytes once: the same bytes give the same (frozen)
message; the memory of them is bounded, since the layer index is the peer's to choose, and
it never changes what any bytes decode to."""

from __future__ import annotations

import msgpack
import pytest

from rd2h.errors import RemoteProtocolError
from rd2h.wire import protocol as p


def test_a_read_done_is_decoded_once_and_stays_what_the_codec_says() -> None:
    frame = p.encode(p.ReadDone(12))
    first = p.decode_reply(frame)
    assert first == p.ReadDone(12)
    assert p.decode_reply(bytes(frame)) is first  # remembered: no second decode
    assert p.decode_reply(bytearray(frame)) == first  # other buffer types decode as before


def test_the_memory_is_bounded() -> None:
    for idx in range(40_000):
        assert p.decode_reply(p.encode(p.ReadDone(idx))).layer_idx == idx
    assert len(p._DONE_SEEN) <= 1 << 14


@pytest.mark.parametrize("frame", [
    msgpack.packb([b"read_done", -1]), msgpack.packb([b"read_done"]), msgpack.packb([b"read_failed", 3]),
])
def test_what_is_not_a_valid_read_done_still_raises(frame: bytes) -> None:
    with pytest.raises(RemoteProtocolError):
        p.decode_reply(frame)
    with pytest.raises(RemoteProtocolError):
        p.decode_reply(frame)


def test_read_failed_is_never_remembered() -> None:
    frame = p.encode(p.ReadFailed(3, "gone", ("r",), "RD2HError"))
    assert p.decode_reply(frame) is not p.decode_reply(frame)
    assert frame not in p._DONE_SEEN


@pytest.mark.parametrize("tail", [
    ((), 0, 1), (("r",), 0, 1), ((), 1, 2), (["r", "s"], 0, 1), ([], 0, 1),
])
def test_encode_readiness_is_the_codecs_bytes_with_or_without_the_plain_tail(tail: tuple) -> None:
    reads = (p.ReadRequest("r", [1, 2], [3], 0, 0),)
    done, member, ratio = tail
    assert p.encode_readiness(7, "l7", p.pack_read_reqs(reads), done, member, ratio) == p.encode(
        p.ReadReadyBatch(7, "l7", reads, tuple(done), member, ratio)
    )


@pytest.mark.parametrize("bad", [((), True, 1), ((), 0, True), ((), 2, 2), ((), 0, 0), (("r", 3), 0, 1)])
def test_encode_readiness_still_refuses_bad_fields(bad: tuple) -> None:
    with pytest.raises((ValueError, TypeError)):
        p.encode_readiness(0, "l0", p.pack_read_reqs(()), *bad)
