"""ReadinessDecoder decodes a step's read_reqs once: whatever it is fed, it answers exactly as
decode_request does (the same message or the same kind of error), and it remembers."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rd2h.errors import RemoteProtocolError
from rd2h.wire import protocol as p
from rd2h.wire.readiness_decoder import ReadinessDecoder

ids = st.lists(st.integers(0, 2**63 - 1) | st.integers(0, 50), max_size=6).map(tuple)
reqs = st.lists(st.builds(p.ReadRequest, st.text(min_size=1, max_size=6), ids, ids, st.integers(0, 9), st.integers(0, 9)), max_size=4)
done = st.lists(st.text(min_size=1, max_size=6), max_size=3).map(tuple)


@st.composite
def readiness_frames(draw: st.DrawFn) -> bytes:
    ratio = draw(st.integers(1, 4))
    batch = p.ReadReadyBatch(draw(st.integers(0, 99)), draw(st.text(min_size=1, max_size=8)), tuple(draw(reqs)), draw(done), draw(st.integers(0, ratio - 1)), ratio)
    return p.encode(batch)


def _outcome(decode, frame: bytes) -> object:
    try:
        return decode(frame)
    except RemoteProtocolError:
        return RemoteProtocolError


@settings(max_examples=300, deadline=None)
@given(st.lists(readiness_frames(), min_size=1, max_size=4), st.data())
def test_answers_as_decode_request_whatever_the_order(frames: list[bytes], data: st.DataObject) -> None:
    decoder = ReadinessDecoder(remembered=2)
    for _ in range(8):
        frame = data.draw(st.sampled_from(frames))
        if data.draw(st.booleans()):  # mutate one byte: garbage must be refused alike
            i = data.draw(st.integers(0, len(frame) - 1))
            frame = frame[:i] + bytes([data.draw(st.integers(0, 255))]) + frame[i + 1:]
        assert _outcome(decoder.decode, frame) == _outcome(p.decode_request, frame)


def test_a_repeated_read_reqs_is_decoded_once() -> None:
    packed = p.pack_read_reqs([p.ReadRequest("r", (1, 2), (1, 2), 0, 0)])
    decoder = ReadinessDecoder()
    first = decoder.decode(p.encode_readiness(0, "l0", packed))
    second = decoder.decode(p.encode_readiness(1, "l1", packed, ("r",)))
    assert second.read_reqs is first.read_reqs  # the same objects: not decoded again
    assert (second.layer_idx, second.layer_name, second.done_ext_ids) == (1, "l1", ("r",))
    assert first.reqs_bytes == second.reqs_bytes == packed


def test_other_messages_and_bad_small_fields_are_refused_as_decode_request_does() -> None:
    decoder = ReadinessDecoder()
    packed = p.pack_read_reqs([p.ReadRequest("r", (1,), (1,), 0, 0)])
    decoder.decode(p.encode_readiness(0, "l0", packed))
    bad_member = b"\x97" + msgpack.packb((b"read_ready_batch", 0, "l0"))[1:] + packed + msgpack.packb(((), 5, 2))[1:]
    with pytest.raises(RemoteProtocolError, match="group_member_idx"):
        decoder.decode(bad_member)
    with pytest.raises(RemoteProtocolError):
        decoder.decode(p.encode(p.ReadDone(3)))
