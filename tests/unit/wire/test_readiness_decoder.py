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


def _raw_readiness(layer_idx: object, layer_name: object, read_reqs: list, tail: tuple) -> bytes:
    """A readiness as msgpack, any field values (decode_request judges them)."""
    wire = [(r.ext_req_id, r.main_block_ids, r.indexer_block_ids, r.main_start_block, r.indexer_start_block) for r in read_reqs]
    return msgpack.packb((b"read_ready_batch", layer_idx, layer_name, wire, *tail))


layer_fields = st.tuples(
    st.integers(0, 2**63 - 1) | st.integers(-3, 300) | st.floats(allow_nan=False) | st.none(),
    st.text(max_size=8) | st.binary(max_size=4) | st.integers(0, 3),
)


@settings(max_examples=300, deadline=None)
@given(reqs, st.sampled_from([(), ((), 0, 1), (("a",), 1, 2), ((), 0, 1, "extension")]), st.lists(layer_fields, min_size=2, max_size=6), st.data())
def test_the_layers_of_one_step_decode_as_decode_request_does(
    read_reqs: list, tail: tuple, layers: list, data: st.DataObject
) -> None:
    """Frames that repeat a step's bytes around other layer fields (the shortcut's case),
    valid or not, mutated or not: the same answer as decode_request."""
    decoder = ReadinessDecoder()
    for layer_idx, layer_name in layers:
        frame = _raw_readiness(layer_idx, layer_name, read_reqs, tail)
        if data.draw(st.booleans()):
            i = data.draw(st.integers(0, len(frame) - 1))
            frame = frame[:i] + bytes([data.draw(st.integers(0, 255))]) + frame[i + 1:]
        assert _outcome(decoder.decode, frame) == _outcome(p.decode_request, frame)


def test_the_next_layer_of_a_step_is_decoded_from_its_layer_fields_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    from rd2h.wire import readiness_decoder

    packed = p.pack_read_reqs([p.ReadRequest("r", (1, 2), (1, 2), 0, 0)])
    decoder = ReadinessDecoder()
    first = decoder.decode(p.encode_readiness(0, "l0", packed))

    def no_full_parse(data: object) -> None:
        raise AssertionError("the readiness was parsed in full")

    monkeypatch.setattr(readiness_decoder, "_split_readiness", no_full_parse)
    second = decoder.decode(p.encode_readiness(17, "layers.17.attn", packed))
    assert second == p.decode_request(p.encode_readiness(17, "layers.17.attn", packed))
    assert second.read_reqs is first.read_reqs and second.reqs_bytes == packed
    with pytest.raises(AssertionError, match="in full"):  # another step's requests: parsed in full
        decoder.decode(p.encode_readiness(1, "l1", p.pack_read_reqs([p.ReadRequest("s", (3,), (3,), 0, 0)])))
