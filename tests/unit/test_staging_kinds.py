"""What an engine moves follows the options it is built with (issue 22 leftover): the vLLM
worker's staging choice asks ``memory_kinds_for`` the configured options, registration and
Decode's handshake ask the built engine's ``memory_kinds_in_use``; and ``RD2H_STAGING``
(auto, always, never) overrides the choice.

No accelerator here: device tensors are CPU tensors that say they live on a device (what
``memory_kind`` reads); only the choice is asked of them, nothing copies them."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
import torch
from test_memory_kinds import OnDevice  # a CPU tensor that says it lives on a device

from rd2h.engine_support import check_peer_kinds, check_region_kinds, kinds_for_options
from rd2h.errors import ConfigError, IncompatiblePeerError, TransferError
from rd2h.interfaces import MemoryKinds, TransferEngine
from rd2h.layout.layers import LayerLayout, TensorLayout
from rd2h.layout.regions import Region
from rd2h.plugins import engine_class
from rd2h.staging import choice
from rd2h.tensors import LayerTensors, layer_layout

NPU = MemoryKinds(frozenset({"host", "npu"}), frozenset({"host", "npu"}))
CUDA = MemoryKinds(frozenset({"host", "cuda"}), frozenset({"host", "cuda"}))


def device_layers(device: str) -> dict[str, LayerTensors]:
    return {f"l{i}": LayerTensors(main=[OnDevice(torch.zeros(8, 16, 32), device)]) for i in range(2)}


def staging(layers: dict[str, LayerTensors], engine: str, options: dict[str, Any] | None = None, **kw: Any) -> Any:
    return choice.WorkerStaging(layers, {n: layer_layout(t) for n, t in layers.items()}, engine, options, **kw)


def npu_layout() -> LayerLayout:
    return LayerLayout((TensorLayout(0x10000, 64, 8, kind="npu:0"),))


def memfabric_built_with(data_op: str, role: str) -> Any:
    """A MemFabric engine as built with ``data_op`` (no memfabric here: only its data path
    and role matter to the checks)."""
    cls = engine_class("memfabric")
    engine = cls.__new__(cls)
    engine._native = SimpleNamespace(config=SimpleNamespace(data_op=data_op))
    engine.role = role
    return engine


# -- MemFabric: a host transport moves host memory only -------------------------------------


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_memfabric_on_its_host_transport_with_npu_kv_stages(role: str) -> None:
    layers = device_layers("npu:0")
    assert staging(layers, "memfabric", {"data_op": "host_tcp"}).needed(role)
    assert not staging(layers, "memfabric", {"data_op": "sdma"}).needed(role)
    assert not staging(layers, "memfabric", {"data_op": "device_rdma"}).needed(role)


def test_memfabric_auto_stages_npu_kv_where_no_npu_makes_it_a_device_path(monkeypatch: pytest.MonkeyPatch) -> None:
    from rd2h_memfabric import _native

    layers = device_layers("npu:0")
    monkeypatch.setattr(_native, "npu_present", lambda: False)  # auto is host_tcp
    assert staging(layers, "memfabric", {}).needed("prefill")
    monkeypatch.setattr(_native, "npu_present", lambda: True)  # auto is sdma
    assert not staging(layers, "memfabric", {"data_op": "auto"}).needed("prefill")


def test_memfabric_on_its_host_transport_refuses_npu_memory_at_registration_and_handshake() -> None:
    prefill = memfabric_built_with("host_tcp", "prefill")
    with pytest.raises(TransferError, match=r"is npu:0 memory, and the memfabric engine reads from host memory only"):
        check_region_kinds(prefill, [Region(0x1000, 64, "npu:0")])
    decode = memfabric_built_with("host_tcp", "decode")
    with pytest.raises(IncompatiblePeerError, match=r"\(main\[0\]\) is npu:0 memory.*reads from host memory only"):
        check_peer_kinds(decode, {"l0": npu_layout()})
    check_region_kinds(memfabric_built_with("sdma", "prefill"), [Region(0x1000, 64, "npu:0")])
    check_peer_kinds(memfabric_built_with("sdma", "decode"), {"l0": npu_layout()})


# -- a third-party engine that declares memory_kinds() alone -----------------------------


class OldStyleEngine(TransferEngine):
    """An engine written before ``memory_kinds_for``: it overrides ``memory_kinds()`` only."""

    name: ClassVar[str] = "oldstyle"

    @classmethod
    def memory_kinds(cls) -> MemoryKinds:
        return CUDA

    def __init__(self, role: str = "decode") -> None:
        self.role = role

    session_id = "oldstyle:1"  # type: ignore[assignment]

    def register(self, regions: Any) -> bytes:
        check_region_kinds(self, regions)
        return b""

    def connect(self, peer_metadata: bytes) -> Any:
        raise NotImplementedError

    def read_batch(self, session: Any, local_addrs: Any, remote_addrs: Any, lengths: Any) -> None:
        raise NotImplementedError


class DuckEngine:
    """An engine class that is no ``TransferEngine`` subclass and says ``memory_kinds()`` only."""

    @classmethod
    def memory_kinds(cls) -> MemoryKinds:
        return CUDA


def test_an_engine_that_overrides_memory_kinds_alone_is_asked_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    assert OldStyleEngine.memory_kinds_for({"anything": 1}) == CUDA
    assert kinds_for_options(OldStyleEngine, {"anything": 1}) == kinds_for_options(DuckEngine, None) == CUDA
    assert OldStyleEngine("prefill").memory_kinds_in_use() == CUDA
    OldStyleEngine("prefill").register([Region(0x1000, 64, "cuda:0")])
    with pytest.raises(TransferError, match="is npu:0 memory"):
        OldStyleEngine("decode").register([Region(0x1000, 64, "npu:0")])
    monkeypatch.setattr(choice.plugins, "engine_class", lambda name: {"oldstyle": OldStyleEngine, "duck": DuckEngine}[name])
    for name in ("oldstyle", "duck"):
        assert not staging(device_layers("cuda:0"), name, {"x": 1}).needed("decode")
        assert staging(device_layers("npu:0"), name).needed("prefill")


# -- RD2H_STAGING ----------------------------------------------------------------------------


def test_the_mode_comes_from_the_environment_and_a_bad_one_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RD2H_STAGING", raising=False)
    assert choice.staging_mode() == "auto"
    for value, mode in (("always", "always"), (" Never ", "never"), ("", "auto")):
        monkeypatch.setenv("RD2H_STAGING", value)
        assert choice.staging_mode() == mode
    monkeypatch.setenv("RD2H_STAGING", "sometimes")
    with pytest.raises(ConfigError, match="RD2H_STAGING must be one of auto, always, never, got 'sometimes'"):
        choice.staging_mode()
    with pytest.raises(ConfigError, match="RD2H_STAGING"):
        staging(device_layers("cuda:0"), "local")


def test_always_stages_host_kv_and_auto_does_not() -> None:
    host = {f"l{i}": LayerTensors(main=[torch.zeros(8, 16, 32)]) for i in range(2)}
    assert staging(host, "local", mode="always").needed("prefill") and staging(host, "local", mode="always").needed("decode")
    assert not staging(host, "local", mode="auto").needed("decode")
    assert not staging(host, "local", mode="never").needed("decode")  # nothing to stage: never has nothing to refuse


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_never_refuses_where_staging_would_be_needed_naming_the_kind_and_engine(role: str) -> None:
    layers = device_layers("cuda:1")
    assert staging(layers, "local", mode="auto").needed(role)
    verb = "reads from" if role == "prefill" else "writes to"
    with pytest.raises(ConfigError, match=rf"RD2H_STAGING=never: the KV is in cuda:1 memory, and the local engine as "
                                          rf"configured {verb} host memory only"):
        staging(layers, "local", mode="never").needed(role)
    with pytest.raises(ConfigError, match="npu:0 memory, and the memfabric engine as configured"):
        staging(device_layers("npu:0"), "memfabric", {"data_op": "host_tcp"}, mode="never").needed(role)
    assert not staging(device_layers("npu:0"), "memfabric", {"data_op": "sdma"}, mode="never").needed(role)


def test_a_landing_wrapper_moves_what_its_engine_moves_as_configured_plus_writes_to_the_staged_device() -> None:
    from rd2h.device import HostStandIn
    from rd2h.staging.decode_landing import DecodeLanding

    tensors = [OnDevice(torch.zeros(8, 16, 32), "npu:0")]
    wrapped = DecodeLanding(tensors, capacity_bytes=1 << 16, device=HostStandIn()).wrap(memfabric_built_with("host_tcp", "decode"))
    assert wrapped.memory_kinds_in_use() == MemoryKinds(frozenset({"host"}), frozenset({"host", "npu"}))
    check_region_kinds(wrapped, [Region(0x1000, 64, "npu:0")])  # written through the landing buffer
    with pytest.raises(IncompatiblePeerError, match="npu:0 memory.*memfabric engine reads from host memory only"):
        check_peer_kinds(wrapped, {"l0": npu_layout()})  # the engine on host_tcp cannot read the peer's NPU
