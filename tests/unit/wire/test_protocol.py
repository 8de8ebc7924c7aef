"""rd2h.wire.protocol: round trips, legacy forms, version rules, and a fuzzer that proves any bytes
either decode to a valid message or raise RemoteProtocolError."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rd2h.errors import (
    BlockRangeError,
    IncompatiblePeerError,
    LayerFailedError,
    RD2HError,
    RegionError,
    RemoteError,
    RemoteProtocolError,
)
from rd2h.layout.layers import LayerLayout, LayoutTag, TensorLayout
from rd2h.wire import layer_metadata as lm
from rd2h.wire import protocol as p

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FUZZ_TREES = settings(FUZZ, max_examples=150)  # structured inputs cost more to generate
ROUND = settings(max_examples=100, deadline=None)

ID_MAX = 2**63 - 1

# -- strategies -------------------------------------------------------------------------------

names = st.text(min_size=1, max_size=12)
block_ids = st.lists(st.integers(0, ID_MAX) | st.integers(0, 300), max_size=12).map(tuple)
offsets = st.integers(0, ID_MAX) | st.integers(0, 1000)
read_requests = st.builds(p.ReadRequest, names, block_ids, block_ids, offsets, offsets)


@st.composite
def read_ready_batches(draw: st.DrawFn) -> p.ReadReadyBatch:
    tp_ratio = draw(st.integers(1, 2**63 - 1) | st.integers(1, 8))
    return p.ReadReadyBatch(
        layer_idx=draw(st.integers(0, ID_MAX) | st.integers(0, 100)),
        layer_name=draw(names),
        read_reqs=tuple(draw(st.lists(read_requests, max_size=4))),
        done_ext_ids=tuple(draw(st.lists(names, max_size=3))),
        group_member_idx=draw(st.integers(0, tp_ratio - 1)),
        tp_ratio=tp_ratio,
    )


@st.composite
def tensors(draw: st.DrawFn) -> TensorLayout:
    block_len = draw(st.integers(1, 2**20))
    scale = draw(st.integers(1, 8))
    num_blocks = draw(st.integers(1, 2**20))
    stride = draw(st.none() | st.integers(block_len * scale, block_len * scale + 2**12))  # None: dense
    end = (stride or block_len * scale) * (num_blocks - 1) + block_len * scale
    base = draw(st.integers(0, 2**63 - 1 - end))
    return TensorLayout(base, block_len, num_blocks, scale, block_stride=stride)


layout_tags = st.builds(
    LayoutTag,
    st.sampled_from(["bfloat16", "int8", ""]) | st.text(max_size=8),
    st.lists(st.integers(0, 2**20) | st.integers(0, 2**63 - 1), max_size=4).map(tuple),
    st.integers(0, 512) | st.integers(0, 2**63 - 1),
    st.sampled_from(["", "LBHNC"]) | st.text(max_size=8),
)


@st.composite
def layers(draw: st.DrawFn) -> LayerLayout:
    main = tuple(draw(st.lists(tensors(), min_size=1, max_size=3)))
    indexer = draw(st.none() | tensors())
    scale = draw(st.none() | tensors()) if indexer is not None else None
    return LayerLayout(main, indexer, scale, draw(st.none() | layout_tags))


layer_maps = st.dictionaries(names, layers(), max_size=3)
versions = st.integers(0, 2**32 - 1) | st.integers(1, 4)


@st.composite
def pp_fields(draw: st.DrawFn) -> dict[str, int]:
    pp_size = draw(st.integers(1, 2**32 - 1) | st.integers(1, 4))
    return {"pp_rank": draw(st.integers(0, pp_size - 1)), "pp_size": pp_size}


@st.composite
def mf_metas(draw: st.DrawFn) -> p.MfMeta:
    """Every form: this build's (any versions and pp fields), the reference's two, rd2h v2."""
    session = draw(st.text(max_size=20))
    blob = lm.encode_layer_metadata(draw(layer_maps))
    form = draw(st.sampled_from(p.MetaForm))
    if form is p.MetaForm.REFERENCE:
        return p.MfMeta.reference(session, blob)
    if form is p.MetaForm.REFERENCE_PP:
        return p.MfMeta.reference(session, blob, version=draw(versions), **draw(pp_fields()))
    engine = draw(st.binary(max_size=32))
    if form is p.MetaForm.RD2H_V2:
        return p.MfMeta(session, blob, draw(versions.filter(bool)), 2, engine, form=form, reference_version=1)
    return dataclasses.replace(
        p.MfMeta(session, blob, engine_metadata=engine, **draw(pp_fields())),
        reference_version=draw(versions),
        protocol_version=draw(st.just(p.PROTOCOL_VERSION) | versions.filter(bool)),
    )


error_kinds = st.sampled_from(["", "RegionError", "LayoutTagMismatch", "SomethingNew"]) | st.text(max_size=12)
replies = st.one_of(
    st.just(p.Ack()),
    st.builds(p.ReadDone, offsets),
    st.builds(p.ReadFailed, offsets, st.text(max_size=40), st.lists(names, max_size=3).map(tuple), error_kinds),
)
settleds = st.builds(
    p.Settled, st.lists(names, max_size=3).map(tuple), st.lists(names, max_size=3).map(tuple),
    st.text(max_size=40), error_kinds,
)
requests = st.one_of(mf_metas(), read_ready_batches(), settleds)
messages = st.one_of(requests, replies)


def pack(*fields: object) -> bytes:
    return msgpack.packb(list(fields))


def rd2h_meta(blob: bytes, *, protocol: int = p.PROTOCOL_VERSION, layout: int = lm.LAYOUT_VERSION, **own: object) -> bytes:
    """This build's mf_meta as a hand-written peer would pack it."""
    return pack(b"mf_meta", "h", blob, 2, 0, 1, {"rd2h": protocol, "layout": layout, **own})


def sample_layers() -> dict[str, LayerLayout]:
    kv = (TensorLayout(0x10000, 4096, 64), TensorLayout(0x60000, 4096, 64))
    return {
        "model.layers.0.attn": LayerLayout(kv, TensorLayout(0xA0000, 512, 64, 2), TensorLayout(0xC0000, 16, 64, 2)),
        "model.layers.1.attn": LayerLayout(kv),
    }


# -- round trips ------------------------------------------------------------------------------


@ROUND
@given(messages)
def test_every_message_round_trips(msg: p.Message) -> None:
    data = p.encode(msg)
    assert p.decode(data) == msg
    if isinstance(msg, (p.MfMeta, p.ReadReadyBatch, p.Settled)):
        assert p.decode_request(data) == msg
    else:
        assert p.decode_reply(data) == msg


@ROUND
@given(layer_maps)
def test_layer_metadata_round_trips(layouts: dict[str, LayerLayout]) -> None:
    data = lm.encode_layer_metadata(layouts)
    assert lm.decode_layer_metadata(data) == layouts
    assert lm.decode_layer_metadata(data, layout_version=lm.LAYOUT_VERSION) == layouts
    meta = p.MfMeta.from_layers("10.0.0.1:5000", layouts)
    assert p.decode_request(p.encode(meta)).layers() == layouts  # type: ignore[union-attr]


def test_read_ready_batch_wire_shape_is_positional_with_bin_tags() -> None:
    msg = p.ReadReadyBatch(3, "l3", (p.ReadRequest("r", (1, 2), (7,), 4, 5),), ("r0",), 1, 2)
    assert msgpack.unpackb(p.encode(msg)) == [b"read_ready_batch", 3, "l3", [["r", [1, 2], [7], 4, 5]], ["r0"], 1, 2]
    assert msgpack.unpackb(p.encode(p.ReadDone(9))) == [b"read_done", 9]
    failed = p.ReadFailed(9, "boom", ("a",), "RegionError")
    assert msgpack.unpackb(p.encode(failed)) == [b"read_failed", 9, "boom", ["a"], "RegionError"]


def test_settled_wire_shape_and_its_short_forms() -> None:
    settled = p.Settled(("a", "b"), ("c",), "aborted", "StateError")
    assert msgpack.unpackb(p.encode(settled)) == [b"settled", ["a", "b"], ["c"], "aborted", "StateError"]
    assert p.decode_request(pack(b"settled", ["a"], [])) == p.Settled(("a",))
    failure = p.decode_request(pack(b"settled", [], ["c"], "gone"))
    assert isinstance(failure, p.Settled) and isinstance(failure.exception(), RemoteError)
    assert isinstance(p.Settled.failure(["c"], BlockRangeError("x")).exception(), BlockRangeError)
    for bad, field in ((pack(b"settled", ["a"]), "at least 3 fields"), (pack(b"settled", [""], []), "done_ext_ids"),
                       (pack(b"settled", [], [1]), "failed_ext_ids"), (pack(b"settled", [], [], 5), "error")):
        with pytest.raises(RemoteProtocolError, match=f"settled: .*{field}"):
            p.decode_request(bad)
    with pytest.raises(RemoteProtocolError, match="unexpected tag"):
        p.decode_reply(p.encode(settled))  # Prefill never receives one


def test_mf_meta_wire_forms() -> None:
    """The reference's fields first, at the reference's positions; rd2h's own in one map."""
    meta = p.MfMeta("h:1", b"\x80", engine_metadata=b"e")
    own = {"rd2h": p.PROTOCOL_VERSION, "layout": lm.LAYOUT_VERSION, "engine": b"e"}
    assert msgpack.unpackb(p.encode(meta)) == [b"mf_meta", "h:1", b"\x80", p.REFERENCE_PROTOCOL_VERSION, 0, 1, own]
    assert (meta.form, meta.legacy, meta.pp_rank, meta.pp_size) == (p.MetaForm.RD2H, False, 0, 1)
    reference = p.MfMeta.reference("h:1", b"\x80")
    assert msgpack.unpackb(p.encode(reference)) == [b"mf_meta", "h:1", b"\x80"]
    newer = p.MfMeta.reference("h:1", b"\x80", version=7, pp_rank=1, pp_size=2)
    assert msgpack.unpackb(p.encode(newer)) == [b"mf_meta", "h:1", b"\x80", 7, 1, 2]
    assert reference.legacy and newer.legacy and not meta.legacy
    old = p.MfMeta("h:1", b"\x80", 2, 2, b"e", form=p.MetaForm.RD2H_V2, reference_version=1)
    assert msgpack.unpackb(p.encode(old)) == [b"mf_meta", "h:1", b"\x80", 2, 2, b"e"]
    with pytest.raises(ValueError, match="engine_metadata: a reference mf_meta does not carry it"):
        dataclasses.replace(reference, engine_metadata=b"x")
    with pytest.raises(ValueError, match="pp_rank: 2 is outside 0..1"):
        p.MfMeta("h", b"\x80", pp_rank=2, pp_size=2)


def test_layer_metadata_wire_keys_and_derived_groups() -> None:
    raw = msgpack.unpackb(lm.encode_layer_metadata(sample_layers()))
    assert raw["model.layers.0.attn"] == {
        "base_addrs": [0x10000, 0x60000, 0xA0000, 0xC0000],
        "block_len": [4096, 4096, 512, 16],
        "block_size_scale": [1, 1, 2, 2],
        "num_blocks": [64, 64, 64, 64],
        "tensor_group_idx": [0, 0, 1, 1],
        "main_tensor_count": 2,
        "has_indexer": True,
        "has_scale": True,
    }
    assert raw["model.layers.1.attn"]["tensor_group_idx"] == [0, 0]


def test_layer_metadata_carries_block_stride_and_tag_when_there_are_any() -> None:
    padded = TensorLayout(0x10000, 4096, 64, block_stride=8192)
    tag = LayoutTag("bfloat16", (8, 16, 128), 16, "LBHNC")
    layers = {"l": LayerLayout((padded, TensorLayout(0x90000, 4096, 64)), tag=tag)}
    raw = msgpack.unpackb(lm.encode_layer_metadata(layers))["l"]
    assert raw["block_stride"] == [8192, None]  # nil: that tensor is dense
    assert raw["tag"] == {"dtype": "bfloat16", "block_shape": [8, 16, 128], "block_tokens": 16, "name": "LBHNC"}
    assert lm.decode_layer_metadata(lm.encode_layer_metadata(layers), layout_version=lm.LAYOUT_VERSION) == layers
    decoded = lm.decode_layer_metadata(lm.encode_layer_metadata(layers))["l"]
    assert decoded.main[0].stride == 8192 and decoded.main[1].dense and decoded.tag == tag
    # an older peer sends neither key: dense tensors, no tag; a tag without a name states none
    del raw["block_stride"], raw["tag"]
    older = lm.decode_layer_metadata(msgpack.packb({"l": raw}), layout_version=2)["l"]
    assert older.main[0].block_stride is None and older.tag is None
    raw["tag"] = {"dtype": "int8", "block_shape": [4], "block_tokens": 0, "future": 1}
    assert lm.decode_layer_metadata(msgpack.packb({"l": raw}))["l"].tag == LayoutTag("int8", (4,), 0, "")
    # a legacy tensor without num_blocks still runs to the end of the int64 space, stride or not
    legacy = {k: v for k, v in raw.items() if k not in ("num_blocks", "tag")} | {"block_stride": [8192, None]}
    runs_to_end = lm.decode_layer_metadata(msgpack.packb({"l": legacy}))["l"].main[0]
    assert runs_to_end.num_blocks == (2**63 - 1 - 0x10000 - 4096) // 8192 + 1


# -- legacy forms and evolution ---------------------------------------------------------------


def test_legacy_mf_meta_decodes_as_version_1_and_needs_accept_legacy() -> None:
    legacy_layer = {
        "base_addrs": [4096, 8192],
        "block_len": [128, 128],
        "block_size_scale": [1, 1],
        "tensor_group_idx": [0, 0],
        "main_tensor_count": 1,
        "has_indexer": True,
    }
    meta = p.decode_request(pack(b"mf_meta", "1.2.3.4:7000", msgpack.packb({"l0": legacy_layer})))
    assert isinstance(meta, p.MfMeta)
    assert (meta.protocol_version, meta.layout_version, meta.engine_metadata) == (1, 1, b"")
    assert meta.form is p.MetaForm.REFERENCE and meta.legacy
    layer = meta.layers()["l0"]
    # no block counts from a legacy peer: each tensor runs to the end of the int64 space
    assert layer.main == (TensorLayout(4096, 128, (2**63 - 1 - 4096) // 128, 1),)
    assert layer.indexer == TensorLayout(8192, 128, (2**63 - 1 - 8192) // 128, 1)
    assert layer.scale is None
    with pytest.raises(IncompatiblePeerError, match="duplicate writes"):
        p.check_compatible(meta)
    p.check_compatible(meta, accept_legacy=True)
    # a layout-2 peer must send the keys a legacy peer leaves out
    with pytest.raises(RemoteProtocolError, match=r"mf_meta: layer_metadata\['l0'\]: has_scale: missing"):
        p.decode_request(rd2h_meta(msgpack.packb({"l0": legacy_layer})))


def test_legacy_read_ready_batch_and_entries() -> None:
    msg = p.decode_request(pack(b"read_ready_batch", 5, "l5", [["a", [1, 2]], ["b", [3], [4]], ["c", [5], [6], 7]], []))
    assert msg == p.ReadReadyBatch(
        5,
        "l5",
        (p.ReadRequest("a", (1, 2), (1, 2)), p.ReadRequest("b", (3,), (4,)), p.ReadRequest("c", (5,), (6,), 7)),
        (),
        0,
        1,
    )
    six = p.decode_request(pack(b"read_ready_batch", 5, "l5", [], [], 0))
    assert (six.group_member_idx, six.tp_ratio) == (0, 1)  # type: ignore[union-attr]


def test_legacy_read_failed_means_all_failed() -> None:
    msg = p.decode_reply(pack(b"read_failed", 2, "engine error -5"))
    assert msg == p.ReadFailed(2, "engine error -5")
    assert isinstance(msg, p.ReadFailed) and msg.all_failed and msg.failed("anything")
    partial = p.ReadFailed(2, "unknown request", ("x",))
    assert not partial.all_failed and partial.failed("x") and not partial.failed("y")
    assert p.decode_reply(pack(b"read_failed", 2, "e", ["x"])) == p.ReadFailed(2, "e", ("x",), "")


def test_read_failed_carries_the_error_class() -> None:
    reply = p.ReadFailed.from_error(4, RegionError("0x10+8 is outside"), ["a"])
    assert (reply.error, reply.failed_ext_ids, reply.error_kind) == ("0x10+8 is outside", ("a",), "RegionError")
    rebuilt = p.decode_reply(p.encode(reply)).exception()  # type: ignore[union-attr]
    assert type(rebuilt) is RegionError and str(rebuilt) == "0x10+8 is outside"
    unknown = p.ReadFailed(4, "new reason", ("a",), "ErrorFromTheFuture").exception()
    assert type(unknown) is RemoteError and unknown.kind == "ErrorFromTheFuture"
    foreign = p.ReadFailed.from_error(4, KeyError("k"))
    assert foreign.error_kind == "RD2HError" and type(foreign.exception()) is RD2HError


def test_a_legacy_read_failed_rebuilds_by_what_it_names() -> None:
    whole = p.decode_reply(pack(b"read_failed", 2, "engine error -5")).exception()  # type: ignore[union-attr]
    assert type(whole) is LayerFailedError and "engine error -5" in str(whole)
    some = p.decode_reply(pack(b"read_failed", 2, "", ["a"])).exception()  # type: ignore[union-attr]
    assert type(some) is RemoteError and "layer 2" in str(some)


def test_trailing_fields_are_ignored_and_str_tags_accepted() -> None:
    assert p.decode(pack(b"read_done", 1, "future", [1, 2])) == p.ReadDone(1)
    assert p.decode(pack("read_done", 1)) == p.ReadDone(1)
    entry = ["r", [1], [2], 0, 0, "future field"]
    msg = p.decode(pack(b"read_ready_batch", 0, "l", [entry], [], 0, 1, {"future": 1}))
    assert msg == p.ReadReadyBatch(0, "l", (p.ReadRequest("r", (1,), (2,)),))
    layer = msgpack.unpackb(lm.encode_layer_metadata(sample_layers()))
    layer["model.layers.1.attn"]["future_key"] = [1, 2, 3]
    assert lm.decode_layer_metadata(msgpack.packb(layer)) == sample_layers()


# -- versions, ACK, META_REQUIRED --------------------------------------------------------------


def test_check_compatible_accepts_equal_and_refuses_others_naming_both() -> None:
    meta = p.MfMeta.from_layers("h:1", sample_layers())
    p.check_compatible(meta)
    ours = (p.PROTOCOL_VERSION, lm.LAYOUT_VERSION)
    for versions in [(ours[0] + 1, ours[1]), (ours[0], ours[1] + 1), (ours[0], 1), (1, ours[1]), (2, 2)]:
        other = dataclasses.replace(meta, protocol_version=versions[0], layout_version=versions[1])
        with pytest.raises(IncompatiblePeerError) as info:
            p.check_compatible(other, accept_legacy=True)
        text = str(info.value)
        assert f"rd2h protocol {versions[0]}, cache layout {versions[1]}" in text
        assert f"rd2h protocol {ours[0]}, cache layout {ours[1]}" in text and "same rd2h version" in text


def test_forms_are_told_apart_by_shape() -> None:
    blob = lm.encode_layer_metadata(sample_layers())
    legacy_blob = msgpack.packb({})
    cases = [
        (pack(b"mf_meta", "h", legacy_blob), p.MetaForm.REFERENCE, (1, 0, 1)),
        (pack(b"mf_meta", "h", legacy_blob, 5), p.MetaForm.REFERENCE_PP, (5, 0, 1)),
        (pack(b"mf_meta", "h", legacy_blob, 5, 1, 4), p.MetaForm.REFERENCE_PP, (5, 1, 4)),
        # the reference's later fields, or a map that is not rd2h's, are trailing fields
        (pack(b"mf_meta", "h", legacy_blob, 5, 1, 4, {"pp_layers": [1]}, 9), p.MetaForm.REFERENCE_PP, (5, 1, 4)),
        (pack(b"mf_meta", "h", legacy_blob, 5, 1, 4, [1, 2]), p.MetaForm.REFERENCE_PP, (5, 1, 4)),
        (rd2h_meta(blob, engine=b"e", future_key=[1]), p.MetaForm.RD2H, (2, 0, 1)),
        (pack(b"mf_meta", "h", b"\xc1 never read", 2, 2, b"e"), p.MetaForm.RD2H_V2, (1, 0, 1)),
    ]
    for data, form, (version, pp_rank, pp_size) in cases:
        meta = p.decode_request(data)
        assert isinstance(meta, p.MfMeta)
        assert (meta.form, meta.reference_version, meta.pp_rank, meta.pp_size) == (form, version, pp_rank, pp_size)
        assert meta.legacy == (form in (p.MetaForm.REFERENCE, p.MetaForm.REFERENCE_PP))
    rd2h = p.decode_request(rd2h_meta(blob, engine=b"e", future_key=[1]))
    assert rd2h == p.MfMeta.from_layers("h", sample_layers(), engine_metadata=b"e")
    p.check_compatible(rd2h)  # type: ignore[arg-type]
    assert p.decode_request(rd2h_meta(blob)).engine_metadata == b""  # type: ignore[union-attr]


def test_the_reference_newer_form_is_a_legacy_peer_that_keeps_its_pp_fields() -> None:
    data = pack(b"mf_meta", "10.0.0.1:7000", msgpack.packb({}), 3, 0, 1)
    meta = p.decode_request(data)
    assert isinstance(meta, p.MfMeta) and meta.legacy and meta.engine_metadata == b""
    with pytest.raises(IncompatiblePeerError, match="legacy build.*accept_legacy=True"):
        p.check_compatible(meta)
    p.check_compatible(meta, accept_legacy=True)
    staged = p.decode_request(pack(b"mf_meta", "h", msgpack.packb({}), 3, 1, 2))
    with pytest.raises(IncompatiblePeerError, match="pipeline stage 1 of 2 of a legacy build.*pp_size 1"):
        p.check_compatible(staged, accept_legacy=True)  # type: ignore[arg-type]
    # an rd2h pipeline stage is served: its layer metadata names the layers it holds
    stage = p.MfMeta.from_layers("h", sample_layers(), pp_rank=1, pp_size=2)
    assert p.decode_request(p.encode(stage)) == stage
    p.check_compatible(stage)


def test_rd2h_protocol_2_is_recognised_and_refused() -> None:
    meta = p.decode_request(pack(b"mf_meta", "h:1", lm.encode_layer_metadata(sample_layers()), 2, 2, b"engine"))
    assert isinstance(meta, p.MfMeta) and meta.form is p.MetaForm.RD2H_V2 and not meta.legacy
    assert (meta.protocol_version, meta.layout_version, meta.engine_metadata) == (2, 2, b"engine")
    for accept_legacy in (False, True):
        with pytest.raises(IncompatiblePeerError, match="rd2h protocol 2, upgrade"):
            p.check_compatible(meta, accept_legacy=accept_legacy)


def test_unknown_layout_version_stays_opaque_until_layers_is_asked() -> None:
    meta = p.decode_request(rd2h_meta(b"not msgpack \xc1", layout=9))
    assert isinstance(meta, p.MfMeta) and meta.layout_version == 9
    with pytest.raises(IncompatiblePeerError):
        p.check_compatible(meta)
    with pytest.raises(IncompatiblePeerError):
        meta.layers()


@pytest.mark.parametrize("frame", [b"ACK", bytearray(b"ACK"), memoryview(b"ACK")])
def test_ack_is_a_raw_frame(frame: bytes) -> None:
    assert p.encode(p.Ack()) == b"ACK"
    assert p.decode_reply(frame) == p.Ack()
    assert p.decode(frame) == p.Ack()
    with pytest.raises(RemoteProtocolError, match="ACK"):
        p.decode_request(frame)


def test_meta_required() -> None:
    reply = p.decode_reply(p.encode(p.ReadFailed.meta_required(4)))
    assert isinstance(reply, p.ReadFailed) and reply.needs_meta and reply.error == p.META_REQUIRED
    assert not p.ReadFailed(4, "read failed").needs_meta


def test_requests_and_replies_are_not_confused() -> None:
    with pytest.raises(RemoteProtocolError, match="unexpected tag b'read_done'"):
        p.decode_request(p.encode(p.ReadDone(1)))
    with pytest.raises(RemoteProtocolError, match="unexpected tag b'mf_meta'"):
        p.decode_reply(p.encode(p.MfMeta("h", lm.encode_layer_metadata({}))))
    with pytest.raises(RemoteProtocolError, match="unknown tag"):
        p.decode(pack(b"read_everything", 1))


# -- invalid input names the message and field ------------------------------------------------

OK_LAYER = msgpack.unpackb(lm.encode_layer_metadata({"l": sample_layers()["model.layers.0.attn"]}))["l"]


def meta_with(**changes: object) -> bytes:
    layer = {**OK_LAYER, **changes}
    layer = {k: v for k, v in layer.items() if v is not None}
    return rd2h_meta(msgpack.packb({"l": layer}))


BAD_REQUESTS = [
    (b"", "message: not one well-formed msgpack value"),
    (b"\x92\xa1a", "message: not one well-formed msgpack value"),  # truncated
    (p.encode(p.ReadDone(1)) + b"\x00", "not one well-formed"),  # trailing bytes
    (b"\xdd\xff\xff\xff\xff", "exceeds max_array_len"),  # claims 2**32 elements
    (b"\x91" * 5000 + b"\x90", "not one well-formed"),  # nested too deep
    (b"\xd6\xff\x00\x00\x00\x01", "not one well-formed"),  # ext type (timestamp)
    (b"\x92\xa2\xff\xfe\x01", "not one well-formed"),  # invalid UTF-8
    (msgpack.packb({"a": 1}), "expected a non-empty array, got dict"),
    (pack(), "expected a non-empty array"),
    (pack(7, 1), "tag must be a byte string"),
    (pack(b"read_ready_batch", 0, "l", []), "read_ready_batch: needs at least 5 fields"),
    (pack(b"read_ready_batch", -1, "l", [], []), "read_ready_batch: layer_idx: -1 is outside"),
    (pack(b"read_ready_batch", True, "l", [], []), "read_ready_batch: layer_idx: expected an integer, got bool"),
    (pack(b"read_ready_batch", 1.0, "l", [], []), "layer_idx: expected an integer, got float"),
    (pack(b"read_ready_batch", 0, b"l", [], []), "layer_name: expected a string, got bytes"),
    (pack(b"read_ready_batch", 0, "", [], []), "layer_name: must not be empty"),
    (pack(b"read_ready_batch", 0, "l", {}, []), "read_reqs: expected an array, got dict"),
    (pack(b"read_ready_batch", 0, "l", [["r"]], []), r"read_reqs\[0\]: needs at least 2 fields"),
    (pack(b"read_ready_batch", 0, "l", [5], []), r"read_reqs\[0\]: expected an array, got int"),
    (pack(b"read_ready_batch", 0, "l", [["r", [1, -2]]], []), r"read_reqs\[0\].main_block_ids: block ids must lie"),
    (pack(b"read_ready_batch", 0, "l", [["r", [2**63]]], []), r"main_block_ids: block ids must lie"),
    (pack(b"read_ready_batch", 0, "l", [["r", [2**64 - 1]]], []), r"main_block_ids: block ids must lie"),
    (pack(b"read_ready_batch", 0, "l", [["r", [1], [1.5]]], []), r"indexer_block_ids: block ids must be integers"),
    (pack(b"read_ready_batch", 0, "l", [["r", [1], ["x"]]], []), r"indexer_block_ids: block ids must be integers"),
    (pack(b"read_ready_batch", 0, "l", [["r", [1], [None]]], []), r"indexer_block_ids: block ids must be integers"),
    (pack(b"read_ready_batch", 0, "l", [["r", {}, []]], []), r"main_block_ids: expected a tuple, list or 1-D"),
    (pack(b"read_ready_batch", 0, "l", [["r", "ab", []]], []), r"main_block_ids: expected a tuple"),
    (pack(b"read_ready_batch", 0, "l", [["r", [1], [1], -1]], []), r"read_reqs\[0\].main_start_block"),
    (pack(b"read_ready_batch", 0, "l", [["", [1]]], []), r"read_reqs\[0\].ext_req_id: must not be empty"),
    (pack(b"read_ready_batch", 0, "l", [], [1]), r"done_ext_ids\[0\]: expected a string"),
    (pack(b"read_ready_batch", 0, "l", [], "r"), r"done_ext_ids: expected a tuple or list"),
    (pack(b"read_ready_batch", 0, "l", [], [], 2, 2), "group_member_idx: 2 is outside 0..1"),
    (pack(b"read_ready_batch", 0, "l", [], [], 0, 0), "tp_ratio: 0 is outside"),
    (pack(b"read_ready_batch", 0, "l", [], [], 1), "group_member_idx: 1 is outside 0..0"),
    (pack(b"mf_meta", "h"), "mf_meta: needs at least 3 fields"),
    (pack(b"mf_meta", 5, b""), "mf_meta: p_session: expected a string"),
    (pack(b"mf_meta", "h", "str not bin"), "mf_meta: layer_metadata: expected bytes"),
    (pack(b"mf_meta", "h", b"\xc1"), "mf_meta: layer_metadata: not one well-formed"),
    (pack(b"mf_meta", "h", msgpack.packb([1])), "mf_meta: layer_metadata: expected a map"),
    (pack(b"mf_meta", "h", msgpack.packb({b"l": {}})), "layer names must be non-empty strings"),
    (pack(b"mf_meta", "h", msgpack.packb({"l": 1})), r"layer_metadata\['l'\]: expected a map"),
    (pack(b"mf_meta", "h", msgpack.packb({}), -1), "reference_version: -1 is outside"),
    (pack(b"mf_meta", "h", msgpack.packb({}), "2"), "reference_version: expected an integer"),
    (pack(b"mf_meta", "h", msgpack.packb({}), 2, 1), "pp_rank: 1 is outside 0..0"),
    (pack(b"mf_meta", "h", msgpack.packb({}), 2, 0, 0), "pp_size: 0 is outside"),
    (pack(b"mf_meta", "h", msgpack.packb({}), 2, 2, "x"), "pp_size: expected an integer, got str"),
    (pack(b"mf_meta", "h", msgpack.packb({}), 2, True, 1), "pp_rank: expected an integer, got bool"),
    (rd2h_meta(msgpack.packb({}), protocol=0), r"mf_meta: rd2h_fields.rd2h: 0 is outside"),
    (rd2h_meta(msgpack.packb({}), protocol="3"), r"rd2h_fields.rd2h: expected an integer"),
    (pack(b"mf_meta", "h", msgpack.packb({}), 2, 0, 1, {"rd2h": 3}), r"rd2h_fields.layout: missing"),
    (rd2h_meta(msgpack.packb({}), layout=1.0), r"rd2h_fields.layout: expected an integer, got float"),
    (rd2h_meta(msgpack.packb({}), engine="x"), r"rd2h_fields.engine: expected bytes"),
    (meta_with(main_tensor_count=0), "main_tensor_count: 0 is outside"),
    (meta_with(main_tensor_count=3), "base_addrs: has 4 entries, main_tensor_count"),
    (meta_with(has_indexer=False), "has_scale: a scale tensor needs an indexer"),
    (meta_with(has_indexer=1), "has_indexer: expected a boolean, got int"),
    (meta_with(has_scale=False), "has 4 entries"),
    (meta_with(block_len=[4096, 0, 512, 16]), r"block_len\[1\]: 0 is outside"),
    (meta_with(block_size_scale=[1, 1, 2, -2]), r"block_size_scale\[3\]: -2 is outside"),
    (meta_with(base_addrs=[-1, 0x60000, 0xA0000, 0xC0000]), r"base_addrs\[0\]: -1 is outside"),
    (meta_with(base_addrs=[2**63 - 4096, 0x60000, 0xA0000, 0xC0000]), "tensor 0 ends past the int64 address space"),
    (meta_with(block_len=[2**40, 4096, 512, 16], block_size_scale=[2**23, 1, 2, 2]), "tensor 0 ends past"),
    (meta_with(num_blocks=[64, 64, -1, 64]), r"num_blocks\[2\]: -1 is outside"),
    (meta_with(num_blocks=None), "num_blocks: missing"),
    (meta_with(tensor_group_idx=[0, 0, 1]), "tensor_group_idx: has 3 entries"),
    (meta_with(tensor_group_idx=[0, 0, 1, -1]), r"tensor_group_idx\[3\]"),
    (meta_with(base_addrs="nope"), "base_addrs: expected an array, got str"),
    (meta_with(block_stride=[8192, None, None]), "block_stride: has 3 entries"),
    (meta_with(block_stride=8192), "block_stride: expected an array, got int"),
    (meta_with(block_stride=[4095, None, None, None]), r"block_stride\[0\]: 4095 is smaller than a block"),
    (meta_with(block_stride=[0, None, None, None]), r"block_stride\[0\]: 0 is outside"),
    (meta_with(block_stride=[None, "x", None, None]), r"block_stride\[1\]: expected an integer"),
    (meta_with(block_stride=[2**62, None, None, None]), "tensor 0 ends past the int64 address space"),
    (meta_with(tag=[1]), "tag: expected a map, got tuple"),
    (meta_with(tag={"dtype": "x", "block_shape": []}), "tag.block_tokens: missing"),
    (meta_with(tag={"dtype": 1, "block_shape": [], "block_tokens": 1}), "tag.dtype: expected a string"),
    (meta_with(tag={"dtype": "x", "block_shape": [-1], "block_tokens": 1}), r"tag.block_shape\[0\]: -1 is outside"),
    (meta_with(tag={"dtype": "x", "block_shape": "8x8", "block_tokens": 1}), "tag.block_shape: expected an array"),
    (meta_with(tag={"dtype": "x", "block_shape": [], "block_tokens": True}), "tag.block_tokens: expected an integer"),
    (meta_with(tag={"dtype": "x", "block_shape": [], "block_tokens": 1, "name": 5}), "tag.name: expected a string"),
]


@pytest.mark.parametrize(("data", "message"), BAD_REQUESTS)
def test_bad_requests_raise_remote_protocol_error_naming_the_field(data: bytes, message: str) -> None:
    with pytest.raises(RemoteProtocolError, match=message):
        p.decode_request(data)
    with pytest.raises(RemoteProtocolError):
        p.decode(data)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (pack(b"read_done"), "read_done: needs at least 2 fields"),
        (pack(b"read_done", -3), "read_done: layer_idx"),
        (pack(b"read_failed", 1), "read_failed: needs at least 3 fields"),
        (pack(b"read_failed", 1, b"bytes"), "read_failed: error: expected a string"),
        (pack(b"read_failed", 1, "e", {"a": 1}), "read_failed: failed_ext_ids: expected a tuple or list"),
        (pack(b"read_failed", 1, "e", [""]), r"failed_ext_ids\[0\]: must not be empty"),
        (pack(b"read_failed", 1, "e", [], 7), r"read_failed: error_kind: expected a string, got int"),
        (b"ACKK", "not one well-formed"),
        (b"AC", "not one well-formed"),
    ],
)
def test_bad_replies_raise_remote_protocol_error(data: bytes, message: str) -> None:
    with pytest.raises(RemoteProtocolError, match=message):
        p.decode_reply(data)


@pytest.mark.parametrize("value", [None, "text", 17, [b"x"]])
def test_non_bytes_input_is_a_protocol_error(value: object) -> None:
    with pytest.raises(RemoteProtocolError, match="expected bytes"):
        p.decode(value)  # type: ignore[arg-type]
    with pytest.raises(RemoteProtocolError, match="expected bytes"):
        lm.decode_layer_metadata(value)  # type: ignore[arg-type]


# -- local construction -----------------------------------------------------------------------


def test_construction_normalises_sequences_and_rejects_bad_fields() -> None:
    req = p.ReadRequest("r", [1, 2], np.array([3, 4], dtype=np.int64))
    assert req.main_block_ids == (1, 2) and req.indexer_block_ids == (3, 4)
    assert all(type(i) is int for i in req.indexer_block_ids)
    batch = p.ReadReadyBatch(0, "l", [req], ["r"])
    assert batch.read_reqs == (req,) and batch.done_ext_ids == ("r",)
    assert p.decode(p.encode(batch)) == batch
    # numpy scalars inside a tuple still encode
    numpy_ids = p.ReadReadyBatch(0, "l", (p.ReadRequest("r", (np.int64(5),), ()),))
    assert p.decode(p.encode(numpy_ids)) == numpy_ids
    with pytest.raises(ValueError, match="main_block_ids"):
        p.ReadRequest("r", (-1,), ())
    with pytest.raises(TypeError, match="indexer_block_ids"):
        p.ReadRequest("r", (), {1: 2})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"read_reqs\[0\]"):
        p.ReadReadyBatch(0, "l", ("not a request",))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="group_member_idx"):
        p.ReadReadyBatch(0, "l", (), (), 3, 2)
    with pytest.raises(TypeError, match="not an rd2h message"):
        p.encode("read_done")  # type: ignore[arg-type]


def test_encode_layer_metadata_rejects_layouts_it_could_not_decode() -> None:
    t = TensorLayout(0, 64, 8)
    with pytest.raises(TypeError, match="layer name"):
        lm.encode_layer_metadata({7: LayerLayout((t,))})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="LayerLayout"):
        lm.encode_layer_metadata({"l": (t,)})  # type: ignore[dict-item]
    with pytest.raises(IncompatiblePeerError, match="reads 1, 2, 3"):
        lm.decode_layer_metadata(lm.encode_layer_metadata({}), layout_version=lm.LAYOUT_VERSION + 1)
    with pytest.raises(TypeError, match="not a LayoutTag"):
        lm.encode_layer_metadata({"l": LayerLayout((t,), tag=("bfloat16",))})  # type: ignore[arg-type]


# -- fuzz: only RemoteProtocolError, or a valid message that re-encodes to itself -------------


def check_decodes_or_refuses(data: bytes) -> None:
    for decoder in (p.decode, p.decode_request, p.decode_reply):
        try:
            msg = decoder(data)
        except RemoteProtocolError:
            continue
        assert p.decode(p.encode(msg)) == msg
        if isinstance(msg, p.MfMeta) and msg.form is not p.MetaForm.RD2H_V2:
            if msg.layout_version in lm.READ_LAYOUT_VERSIONS:
                msg.layers()  # a decoded mf_meta of a known layout has usable metadata
    try:
        lm.decode_layer_metadata(data)
    except RemoteProtocolError:
        pass


@FUZZ
@given(st.binary(max_size=200))
def test_fuzz_random_bytes(data: bytes) -> None:
    check_decodes_or_refuses(data)


@st.composite
def mutated_encodings(draw: st.DrawFn) -> bytes:
    data = bytearray(p.encode(draw(messages)))
    for _ in range(draw(st.integers(1, 4))):
        action = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate"]))
        pos = draw(st.integers(0, max(len(data) - 1, 0)))
        if action == "flip" and data:
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif action == "set" and data:
            data[pos] = draw(st.integers(0, 255))
        elif action == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=4))
        elif action == "delete" and data:
            del data[pos : pos + draw(st.integers(1, 4))]
        elif action == "truncate":
            del data[pos:]
    return bytes(data)


@FUZZ
@given(mutated_encodings())
def test_fuzz_mutated_encodings(data: bytes) -> None:
    check_decodes_or_refuses(data)


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=5) | st.binary(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=8,
)


def _paths(obj: object, prefix: tuple[int, ...] = ()) -> list[tuple[int, ...]]:
    out = [prefix] if prefix else []
    if isinstance(obj, list):
        for i, item in enumerate(obj):
            out += _paths(item, (*prefix, i))
    return out


@FUZZ_TREES
@given(messages.filter(lambda m: not isinstance(m, p.Ack)), st.data())
def test_fuzz_swapped_field_types(msg: p.Message, data: st.DataObject) -> None:
    tree = msgpack.unpackb(p.encode(msg))
    path = data.draw(st.sampled_from(_paths(tree)))
    parent = tree
    for i in path[:-1]:
        parent = parent[i]
    parent[path[-1]] = data.draw(msgpack_values)
    check_decodes_or_refuses(msgpack.packb(tree))


@FUZZ_TREES
@given(layer_maps, st.data())
def test_fuzz_layer_metadata_values(layouts: dict[str, LayerLayout], data: st.DataObject) -> None:
    tree = msgpack.unpackb(lm.encode_layer_metadata(layouts))
    if tree:
        layer = tree[data.draw(st.sampled_from(sorted(tree)))]
        key = data.draw(st.sampled_from(sorted(layer)))
        if data.draw(st.booleans()):
            layer[key] = data.draw(msgpack_values)
        else:
            del layer[key]
    blob = msgpack.packb(tree)
    for version in (None, *lm.READ_LAYOUT_VERSIONS):
        try:
            decoded = lm.decode_layer_metadata(blob, layout_version=version)
        except RemoteProtocolError:
            continue
        assert lm.decode_layer_metadata(lm.encode_layer_metadata(decoded)) == decoded
    check_decodes_or_refuses(rd2h_meta(blob))


@ROUND
@given(st.integers(0, 2**31), st.text(min_size=1, max_size=20),
       st.lists(st.tuples(st.text(min_size=1, max_size=8), st.lists(st.integers(0, 2**40), max_size=40),
                          st.integers(0, 1000)), max_size=6),
       st.lists(st.text(min_size=1, max_size=8), max_size=4), st.integers(1, 64), st.data())
def test_encode_readiness_is_encode_of_the_batch(layer_idx, name, reqs, done, ratio, data) -> None:  # noqa: ANN001
    """Prefill packs a step's requests once and frames them per layer: same bytes as encode()."""
    member = data.draw(st.integers(0, ratio - 1))
    read_reqs = tuple(p.ReadRequest(e, ids, ids[::-1], start, start + 1) for e, ids, start in reqs)
    batch = p.ReadReadyBatch(layer_idx, name, read_reqs, tuple(done), member, ratio)
    frame = p.encode_readiness(layer_idx, name, p.pack_read_reqs(read_reqs), tuple(done), member, ratio)
    assert frame == p.encode(batch)
    assert p.decode_request(frame) == batch


# -- docs/protocol.md shows the bytes this codec writes -----------------------------------------

DOCS = Path(__file__).resolve().parents[3] / "docs" / "protocol.md"


def _hex_blocks(text: str) -> list[bytes]:
    """The bytes of each fenced block of annotated hex (a line's leading two-digit tokens)."""
    blocks = []
    for block in re.findall(r"```\n(.*?)```", text, flags=re.S):
        tokens = []
        for line in block.splitlines():
            for token in line.split():
                if not re.fullmatch(r"[0-9a-f]{2}", token):
                    break
                tokens.append(token)
        if tokens:
            blocks.append(bytes.fromhex("".join(tokens)))
    return blocks


def test_the_examples_of_the_protocol_reference_are_what_the_codec_writes() -> None:
    text = DOCS.read_text()
    blocks = _hex_blocks(text)
    meta = p.MfMeta("10.0.0.1:7000", msgpack.packb({}), engine_metadata=b"E")
    readiness = p.ReadReadyBatch(3, "layers.3", (p.ReadRequest("req-a", (5, 6, 300), (5, 6)),), ("req-a",))
    assert p.encode(meta) in blocks and p.encode(readiness) in blocks
    for reply in (p.ReadDone(3), p.ReadFailed(3, "x", ("req-a",), "RegionError")):
        assert p.encode(reply).hex(" ") in text
