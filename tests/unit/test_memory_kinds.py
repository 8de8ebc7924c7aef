"""Memory kinds (issue 22): derived from tensors, carried by regions and layouts, sent in the
layer metadata, declared by engines and checked at registration and at the handshake.

No accelerator here: device tensors are CPU tensors that say they live on a device (what
``memory_kind`` reads), and every check below runs the real code with those kinds."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import msgpack
import numpy as np
import pytest
import torch

from rd2h.engine_support import capable_engines, check_peer_kinds, check_region_kinds
from rd2h.errors import ConfigError, IncompatiblePeerError, ProtocolError, RemoteProtocolError, TransferError
from rd2h.interfaces import HOST_ONLY, MemoryKinds, TransferEngine
from rd2h.layout.layers import LayerLayout, TensorLayout
from rd2h.layout.regions import KindIndex, Region, check_memory_kind, device_index, device_type, merge_by_kind
from rd2h.plugins import engine_class, load_engine
from rd2h.tensors import LayerTensors, layer_layout, memory_kind, tensor_layout
from rd2h.wire import protocol
from rd2h.wire.layer_metadata import LAYOUT_VERSION, decode_layer_metadata, encode_layer_metadata
from rd2h.wire.mf_meta import MfMeta


class OnDevice:
    """A CPU tensor that says it lives on ``device``: rd2h reads a tensor's memory through
    ``data_ptr``, its strides and its ``device`` (type and index), so this is what a GPU
    tensor shows it. (torch without torch_npu cannot even name an NPU device.)"""

    def __init__(self, tensor: torch.Tensor, device: str) -> None:
        kind, _, index = device.partition(":")
        self._t, self.device = tensor, SimpleNamespace(type=kind, index=int(index))
        self.shape, self.dtype = tensor.shape, tensor.dtype

    def __getattr__(self, name: str) -> Any:
        return getattr(self._t, name)


# -- deriving a kind ---------------------------------------------------------------------


def test_memory_kind_of_host_memory() -> None:
    assert memory_kind(np.zeros(4)) == "host"
    assert memory_kind(torch.zeros(4)) == "host"
    assert memory_kind(torch.zeros(4, 8)[:, :2]) == "host"


@pytest.mark.parametrize("device", ["cuda:0", "cuda:3", "npu:7", "xpu:1"])
def test_memory_kind_of_a_device_tensor_is_its_type_and_index(device: str) -> None:
    assert memory_kind(OnDevice(torch.zeros(4), device)) == device


def test_memory_kind_refuses_what_it_cannot_name() -> None:
    with pytest.raises(ConfigError, match="no device index"):
        memory_kind(torch.empty(4, device="meta"))
    with pytest.raises(ConfigError, match="torch tensor or numpy array"):
        memory_kind([1, 2, 3])


def test_a_device_tensor_gives_layouts_and_regions_of_its_kind() -> None:
    main, indexer = OnDevice(torch.zeros(4, 64), "cuda:1"), torch.zeros(4, 16)
    layout = layer_layout(LayerTensors(main=[main], indexer=indexer))
    assert tensor_layout(main).kind == "cuda:1" and layout.main[0].kind == "cuda:1"
    assert layout.indexer is not None and layout.indexer.kind == "host"
    assert [r.kind for r in layout.regions()] == ["cuda:1", "host"]


# -- the kind itself ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["host", "cuda:0", "npu:15", "xpu:99999", "privateuseone:2"])
def test_memory_kinds_that_are_well_formed(kind: str) -> None:
    assert check_memory_kind(kind) == kind
    assert Region(4096, 1, kind).kind == kind


@pytest.mark.parametrize(
    "kind", ["", "cuda", "CUDA:0", "cuda:01", "cuda:-1", "cuda:100000", "host:0", "cuda:0 ", ":0", "0:0", "a" * 40 + ":0"]
)
def test_malformed_memory_kinds(kind: str) -> None:
    with pytest.raises(ValueError, match="memory kind"):
        check_memory_kind(kind)
    with pytest.raises(ValueError):
        Region(4096, 1, kind)
    with pytest.raises(ValueError):
        TensorLayout(4096, 64, 2, kind=kind)


def test_cpu_is_host_in_this_process_but_malformed_on_the_wire() -> None:
    assert Region(0, 1, "cpu").kind == TensorLayout(0, 64, 1, kind="cpu").kind == "host"
    with pytest.raises(ValueError, match="not a memory kind"):
        check_memory_kind("cpu")


def test_device_type_and_index() -> None:
    assert (device_type("cuda:3"), device_index("cuda:3")) == ("cuda", 3)
    assert (device_type("host"), device_index("host")) == ("host", 0)
    assert Region(0, 1, "npu:2").device_type == "npu"


def test_kind_index_names_the_kind_of_every_address() -> None:
    index = KindIndex([Region(0x1000, 0x1000), Region(0x2000, 0x100), Region(0x9000, 0x1000, "cuda:0")])
    assert index.kinds == ("host", "cuda:0") and index.uniform is None
    codes = index.codes(np.array([0x1000, 0x20FF, 0x2100, 0x9FFF, 0xA000, 0], np.int64))
    assert codes.tolist() == [0, 0, -1, 1, -1, -1]
    assert index.kind_of(0x9000) == "cuda:0" and index.kind_of(0x2100) is None
    assert KindIndex([Region(0, 8)]).uniform == "host" and KindIndex().codes([5]).tolist() == [-1]
    with pytest.raises(ValueError, match="two memory kinds overlap"):
        KindIndex([Region(0x1000, 0x1000), Region(0x1800, 0x1000, "cuda:0")])


def test_merge_keeps_kinds_apart() -> None:
    merged = merge_by_kind([Region(0, 8), Region(8, 8), Region(16, 8, "cuda:0"), Region(24, 8, "cuda:1")])
    assert sorted(merged, key=lambda r: r.addr) == [Region(0, 16), Region(16, 8, "cuda:0"), Region(24, 8, "cuda:1")]


# -- the layer metadata --------------------------------------------------------------------


def _layer(main_kind: str = "host", indexer_kind: str = "host") -> LayerLayout:
    return LayerLayout(
        (TensorLayout(0x10000, 64, 8, kind=main_kind), TensorLayout(0x20000, 64, 8, kind=main_kind)),
        TensorLayout(0x30000, 16, 8, kind=indexer_kind),
        TensorLayout(0x40000, 4, 8, kind=indexer_kind),
    )


def test_the_layer_metadata_carries_every_tensors_kind_through_the_codec() -> None:
    layers = {"l0": _layer("cuda:0", "cuda:0"), "l1": _layer("npu:3", "host"), "l2": _layer()}
    meta = MfMeta.from_layers("10.0.0.1:7000", layers, engine_metadata=b"E")
    decoded = protocol.decode(protocol.encode(meta))
    assert isinstance(decoded, MfMeta) and decoded.layout_version == LAYOUT_VERSION == 4
    got = decoded.layers()
    assert got == layers  # kinds are not part of equality: compared one by one below
    for name, layout in layers.items():
        assert [t.kind for t in got[name].tensors()] == [t.kind for t in layout.tensors()], name


def test_host_only_layers_send_no_kinds_and_a_map_without_them_is_host() -> None:
    raw = msgpack.unpackb(encode_layer_metadata({"l0": _layer()}))
    assert "memory_kind" not in raw["l0"]
    raw = msgpack.unpackb(encode_layer_metadata({"l0": _layer("cuda:0")}))
    assert raw["l0"]["memory_kind"] == ["cuda:0", "cuda:0", "host", "host"]
    older = msgpack.packb({"l0": {k: v for k, v in raw["l0"].items() if k != "memory_kind"}})
    for version in (3, 4):
        assert {t.kind for t in decode_layer_metadata(older, layout_version=version)["l0"].tensors()} == {"host"}


@pytest.mark.parametrize(
    ("kinds", "words"),
    [
        (["cuda"] * 4, "memory_kind[0]"),
        (["host", "host", "cpu", "host"], "memory_kind[2]"),
        (["host", "host", "host", 7], "memory_kind[3]"),
        (["host"] * 3, "has 3 entries"),
        ("host", "expected an array"),
        (["host", "host", "host", "gpu:1" * 20], "memory_kind[3]"),
    ],
)
def test_malformed_kinds_from_a_peer_are_a_protocol_error(kinds: object, words: str) -> None:
    raw = msgpack.unpackb(encode_layer_metadata({"l0": _layer()}))
    raw["l0"]["memory_kind"] = kinds
    data = msgpack.packb(raw)
    with pytest.raises(RemoteProtocolError, match=words.replace("[", r"\[")):
        decode_layer_metadata(data, layout_version=LAYOUT_VERSION)
    frame = protocol.encode(MfMeta("p", b"\x80", engine_metadata=b"E"))
    frame = frame.replace(b"\xc4\x01\x80", msgpack.packb(data), 1)  # the same mf_meta with this map
    with pytest.raises(ProtocolError):
        protocol.decode(frame)


# -- engines: declarations and refusals -------------------------------------------------------


def test_memory_kinds_hold_device_types_only() -> None:
    assert TransferEngine.memory_kinds() == HOST_ONLY == MemoryKinds(frozenset({"host"}), frozenset({"host"}))
    kinds = MemoryKinds(frozenset({"host", "cuda"}), frozenset({"host"}))
    assert kinds.for_role("prefill") == {"host", "cuda"} and kinds.for_role("decode") == {"host"}
    for bad in ("cuda:0", "", "CUDA", 3):
        with pytest.raises(ValueError):
            MemoryKinds(frozenset({bad}))  # type: ignore[arg-type]


@pytest.mark.parametrize(("name", "reads"), [("local", {"host"}), ("nixl", {"host", "cuda"})])
def test_installed_engines_declare_their_kinds(name: str, reads: set[str]) -> None:
    kinds = engine_class(name).memory_kinds()
    assert kinds.reads_from == reads and kinds.writes_to == reads


def test_capable_engines_are_the_installed_ones_that_declare_the_type() -> None:
    assert capable_engines("cuda:0", "decode") == capable_engines("cuda:5", "prefill") == ["nixl"]
    assert "local" in capable_engines("host", "decode")
    assert capable_engines("rd2hfake:0", "decode") == []


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_registration_of_memory_the_engine_does_not_move_names_kind_and_engines(role: str) -> None:
    with load_engine("local", role) as engine:
        with pytest.raises(TransferError) as info:
            check_region_kinds(engine, [Region(0x1000, 64), Region(0x7F0000000000, 64, "cuda:2")])
        text = str(info.value)
        verb = "reads from" if role == "prefill" else "writes to"
        assert "0x7f0000000000+64 is cuda:2 memory" in text and f"local engine {verb} host memory only" in text
        assert "installed engines that can: nixl" in text
        with pytest.raises(TransferError, match="no installed engine can"):
            check_region_kinds(engine, [Region(0x1000, 64, "rd2hfake:0")])
        check_region_kinds(engine, [Region(0x1000, 64)])  # host memory passes
        # an engine whose options narrow its kinds passes its own
        with pytest.raises(TransferError, match="writes to no memory|reads from no memory"):
            check_region_kinds(engine, [Region(0x1000, 64)], MemoryKinds(frozenset(), frozenset()))


def test_a_peer_whose_layers_live_where_decodes_engine_cannot_read_is_incompatible() -> None:
    with load_engine("local", "decode") as engine:
        check_peer_kinds(engine, {"l0": _layer()})
        with pytest.raises(IncompatiblePeerError) as info:
            check_peer_kinds(engine, {"l0": _layer(), "l1": _layer("host", "cuda:1")})
        text = str(info.value)
        assert "layer 'l1' (indexer) is cuda:1 memory" in text and "reads from host memory only" in text
        assert "nixl" in text
    nixl = engine_class("nixl")
    check_peer_kinds(nixl.__new__(nixl), {"l1": _layer("cuda:0", "cuda:1")})  # the class's declaration decides


def test_an_engine_wrapper_is_checked_as_the_engine_it_wraps() -> None:
    """Decode's engine may be a wrapper delegating by ``__getattr__`` (a test double): the checks
    must not raise AttributeError out of the handshake (they did: the Sink logged "unexpected
    error in the loop" and never replied), and they go by the inner engine's name and kinds."""

    class Wrapper:
        def __init__(self, inner: Any) -> None:
            self._inner = inner

        def __getattr__(self, name: str) -> Any:
            return getattr(self._inner, name)

    with load_engine("local", "decode") as engine:
        wrapped = Wrapper(engine)
        check_peer_kinds(wrapped, {"l0": _layer()})
        with pytest.raises(IncompatiblePeerError, match="the local engine reads from host memory only"):
            check_peer_kinds(wrapped, {"l1": _layer("host", "cuda:1")})
        with pytest.raises(TransferError, match="the local engine writes to host memory only"):
            check_region_kinds(wrapped, [Region(0x1000, 64, "cuda:0")])
    nixl = engine_class("nixl")
    check_peer_kinds(Wrapper(nixl.__new__(nixl)), {"l1": _layer("cuda:0", "cuda:1")})  # the inner engine's kinds


def test_engines_are_asked_once_whatever_kinds_peers_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refusal names the engines that can; finding them imports and asks every backend, so
    it happens once per process: a peer naming a new device type every handshake costs
    Decode's loop a dict lookup, not an import or a subprocess."""
    import rd2h.engine_support as support
    from rd2h import plugins

    calls = []
    real = plugins.list_backends
    monkeypatch.setattr(plugins, "list_backends", lambda: calls.append(1) or real())
    support._declared.cache_clear()
    try:
        names = [capable_engines(f"type{i}:0", "decode") for i in range(200)]
        assert names == [[]] * 200 and capable_engines("cuda:0", "prefill") == ["nixl"] and len(calls) == 1
    finally:
        support._declared.cache_clear()
