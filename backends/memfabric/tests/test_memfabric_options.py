"""What the memfabric engine decides before memfabric starts: options, availability, metadata.

Nothing here imports memfabric_hybrid (a guard makes sure), so these run in any process.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import msgpack
import pytest

from rd2h.errors import BackendUnavailableError, ConfigError, PortError, TransferError
from rd2h.interfaces import Availability, MemoryKinds
from rd2h.layout.regions import RegionSet
from rd2h.plugins import engine_class
from rd2h_memfabric import MemFabricEngine, _metadata, _native
from rd2h_memfabric.engine import _resolve_data_op

STORE = "tcp://127.0.0.1:24000"


@pytest.fixture(autouse=True)
def no_memfabric(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse() -> None:
        raise AssertionError("memfabric_hybrid must not be imported by these tests")

    monkeypatch.setattr(_native, "_import", refuse)


@pytest.fixture
def no_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_native, "environment", lambda: (False, "no Ascend here (test)"))


def test_published_under_its_entry_point() -> None:
    assert engine_class("memfabric") is MemFabricEngine
    assert MemFabricEngine.name == "memfabric"


@pytest.mark.parametrize(
    ("options", "error", "words"),
    [
        ({"role": "decode", "no_such": 1}, ConfigError, "no_such"),
        ({"role": "both"}, ConfigError, "role"),
        ({"role": "decode", "store_url": "127.0.0.1:24000"}, ConfigError, "tcp://"),
        ({"role": "decode", "store_url": "tcp://127.0.0.1"}, ConfigError, "store_url"),
        ({"role": "decode", "hostname": "localhost"}, ConfigError, "IPv4"),
        ({"role": "decode", "hostname": "::1"}, ConfigError, "IPv4"),
        ({"role": "decode", "port": 0}, PortError, "port"),
        ({"role": "decode", "port": 70000}, PortError, "port"),
        ({"role": "decode", "port": "8000"}, PortError, "port"),
        ({"role": "decode", "device_id": -1}, ConfigError, "device_id"),
        ({"role": "decode", "data_op": "rdma"}, ConfigError, "data_op"),
        ({"role": "decode", "timeout": 0}, ConfigError, "timeout"),
    ],
)
def test_bad_options_are_config_errors_before_anything_starts(options: dict[str, Any], error: type, words: str) -> None:
    options.setdefault("store_url", STORE)
    with pytest.raises(error, match=words):
        MemFabricEngine(**options)


def test_store_url_is_required() -> None:
    with pytest.raises(TypeError, match="store_url"):
        MemFabricEngine("decode")  # type: ignore[call-arg]


def test_unavailable_environment_is_backend_unavailable(no_environment: None) -> None:
    assert MemFabricEngine.availability() == Availability(False, "no Ascend here (test)")
    with pytest.raises(BackendUnavailableError, match="no Ascend here"):
        MemFabricEngine("decode", store_url=STORE)


def test_missing_wheel_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_native.importlib.util, "find_spec", lambda name: None)
    ok, reason = _native.environment()
    assert not ok and "pip install rd2h[memfabric]" in reason
    with pytest.raises(BackendUnavailableError, match=r"pip install rd2h\[memfabric\]"):
        MemFabricEngine("prefill", store_url=STORE)


class TestEnvironment:
    @pytest.fixture(autouse=True)
    def wheel_present(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(_native.importlib.util, "find_spec", lambda name: object())
        monkeypatch.setenv("ASCEND_HOME_PATH", "/opt/ascend")

    def test_no_driver(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.delenv("FAKE_ASCEND_INSTALL_INFO", raising=False)
        monkeypatch.setattr(_native.os.path, "isfile", lambda p: False)
        ok, reason = _native.environment()
        assert not ok and "/etc/ascend_install.info" in reason and "tests/kit/memfabric-cpu" in reason

    def test_real_driver(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.delenv("FAKE_ASCEND_INSTALL_INFO", raising=False)
        monkeypatch.setattr(_native.os.path, "isfile", lambda p: p == "/etc/ascend_install.info")
        assert _native.environment() == (True, "")

    def test_kit_without_its_preload(self, monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
        info = tmp_path / "ascend_install.info"
        info.write_text("x")
        monkeypatch.setenv("FAKE_ASCEND_INSTALL_INFO", str(info))
        monkeypatch.setattr(_native, "_preloaded", lambda name: False)
        ok, reason = _native.environment()
        assert not ok and "env.sh" in reason

    def test_kit_complete(self, monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
        info = tmp_path / "ascend_install.info"
        info.write_text("x")
        monkeypatch.setenv("FAKE_ASCEND_INSTALL_INFO", str(info))
        monkeypatch.setattr(_native, "_preloaded", lambda name: name == "librealpath_shim")
        assert _native.environment() == (True, "")
        monkeypatch.delenv("ASCEND_HOME_PATH")
        ok, reason = _native.environment()
        assert not ok and "ASCEND_HOME_PATH" in reason


def test_auto_data_op_follows_the_npu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_native, "npu_present", lambda: True)
    assert _resolve_data_op("auto") == "sdma"
    monkeypatch.setattr(_native, "npu_present", lambda: False)
    assert _resolve_data_op("auto") == "host_tcp"
    assert _resolve_data_op("device_rdma") == "device_rdma"


def test_configurations_that_cannot_share_an_engine() -> None:
    base = _native.Config("decode", STORE, "127.0.0.1", None, 0, "host_tcp")
    assert base.conflicts_with(base) == []
    assert base.conflicts_with(_native.Config("decode", STORE, "127.0.0.1", 5000, 0, "host_tcp")) == ["port"]
    running = _native.Config("decode", STORE, "127.0.0.1", 5000, 0, "host_tcp")
    assert running.conflicts_with(base) == []  # no port asked for: take the running one's
    other = _native.Config("prefill", STORE, "10.0.0.1", None, 2, "host_tcp")
    assert base.conflicts_with(other) == ["role", "hostname", "device_id"]
    assert "role=prefill" in other.describe() and "device_id=2" in other.describe()


def test_registrations_sharing_a_2mib_unit_are_registered_as_one() -> None:
    mib = 1 << 20
    base = 64 * mib
    regions = RegionSet([(base, mib), (base + mib + 4096, 4096), (base + 4 * mib, mib), (base + 6 * mib - 10, 20)])
    assert _native._native_ranges(regions) == {base: mib + 8192, base + 4 * mib: 2 * mib + 10}
    assert _native._native_ranges(RegionSet([(base, 2 * mib), (base + 2 * mib + 4096, 10)])) == {
        base: 2 * mib,
        base + 2 * mib + 4096: 10,
    }


class TestMetadata:
    def test_round_trip(self) -> None:
        blob = _metadata.encode("10.1.2.3:5000", [(4096, 8192), (1 << 40, 1)])
        assert _metadata.decode(blob) == ("10.1.2.3:5000", [(4096, 8192), (1 << 40, 1)])

    @pytest.mark.parametrize(
        "blob",
        [
            b"",
            b"\xc1",
            msgpack.packb(["rd2h", 1]),
            msgpack.packb([b"rd2h-local", 1, "127.0.0.1:1", []]),
            msgpack.packb([b"rd2h-memfabric", 2, "127.0.0.1:1", []]),
            msgpack.packb([b"rd2h-memfabric", 1, "127.0.0.1", []]),
            msgpack.packb([b"rd2h-memfabric", 1, "127.0.0.1:99999", []]),
            msgpack.packb([b"rd2h-memfabric", 1, "127.0.0.1:1", [[0, 0]]]),
            msgpack.packb([b"rd2h-memfabric", 1, "127.0.0.1:1", [[-1, 10]]]),
            msgpack.packb([b"rd2h-memfabric", 1, "127.0.0.1:1", [[1, 2, 3]]]),
            msgpack.packb([b"rd2h-memfabric", 1, "127.0.0.1:1", {"a": 1}]),
            "not bytes",
        ],
    )
    def test_garbage_is_transfer_error(self, blob: Any) -> None:
        with pytest.raises(TransferError, match="memfabric-engine metadata"):
            _metadata.decode(blob)

    def test_appended_fields_are_ignored(self) -> None:
        blob = msgpack.packb([b"rd2h-memfabric", 1, "127.0.0.1:7", [[4096, 10]], "later"])
        assert _metadata.decode(blob) == ("127.0.0.1:7", [(4096, 10)])


def test_native_error_lines_since_a_mark() -> None:
    errors = _native._Errors()
    errors.add("old")
    mark = errors.now()
    assert errors.since(mark) == ""
    errors.add("first")
    errors.add("second")
    assert errors.since(mark) == "second"


def test_declares_host_and_npu_memory_and_host_only_on_host_tcp() -> None:
    """memfabric's device paths (SDMA, device RDMA) move Ascend NPU memory both ways; its
    host_tcp transport copies with the CPU and moves host memory only: so says an engine
    built that way (what registration checks) and the options before it is built (what the
    vLLM worker's staging choice asks)."""
    both = frozenset({"host", "npu"})
    assert MemFabricEngine.memory_kinds() == MemoryKinds(both, both)
    for data_op, kinds in (("host_tcp", MemoryKinds()), ("sdma", MemoryKinds(both, both)), ("device_rdma", MemoryKinds(both, both))):
        engine = MemFabricEngine.__new__(MemFabricEngine)  # no memfabric: only the data path matters here
        engine._native = SimpleNamespace(config=SimpleNamespace(data_op=data_op))
        assert engine.memory_kinds_in_use() == kinds, data_op
        assert MemFabricEngine.memory_kinds_for({"store_url": "tcp://127.0.0.1:1", "data_op": data_op}) == kinds


def test_auto_data_op_moves_npu_memory_only_where_an_npu_is(monkeypatch: pytest.MonkeyPatch) -> None:
    both = frozenset({"host", "npu"})
    monkeypatch.setattr(_native, "npu_present", lambda: False)
    assert MemFabricEngine.memory_kinds_for({}) == MemoryKinds()  # auto is host_tcp here
    monkeypatch.setattr(_native, "npu_present", lambda: True)
    assert MemFabricEngine.memory_kinds_for({"data_op": "auto"}) == MemoryKinds(both, both)  # auto is sdma
    assert MemFabricEngine.memory_kinds_for({"data_op": "bogus"}) == MemoryKinds(both, both)  # refused when built
