"""The conformance suite's device cases ask the engine as configured for the suite what it
moves (``memory_kinds_in_use``; for reads, ``memory_kinds_for`` the peer's options too), not
the engine class's ``memory_kinds()``: MemFabric on ``host_tcp`` declares NPU memory as a
class but moves host memory only, and its device cases must skip saying so."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import pytest

from rd2h.interfaces import MemoryKinds
from rd2h.testing import engine_device_cases
from rd2h.testing.engine_device_cases import DeviceCases

EVERYTHING = MemoryKinds(frozenset({"host", "cuda"}), frozenset({"host", "cuda"}))
HOST_ONLY = MemoryKinds()


class Engine:
    """Declares cuda memory as a class; moves what its ``transport`` option says."""

    def __init__(self, transport: str) -> None:
        self.transport = transport

    @classmethod
    def memory_kinds(cls) -> MemoryKinds:
        return EVERYTHING

    @classmethod
    def memory_kinds_for(cls, options: Mapping[str, Any]) -> MemoryKinds:
        return HOST_ONLY if options.get("transport") == "host" else EVERYTHING

    def memory_kinds_in_use(self) -> MemoryKinds:
        return self.memory_kinds_for({"transport": self.transport})


class Cases(DeviceCases):
    engine_name = "fake"
    peer_role: ClassVar[str] = "prefill"
    peer_transport: ClassVar[str] = "device"

    @classmethod
    def engine_options_for(cls, role: str) -> dict[str, Any]:
        return {"transport": cls.peer_transport}


def skip_reason(engine: Engine, side: str, cases: type[Cases] = Cases) -> str | None:
    try:
        cases()._need_device(engine, "cuda", side)  # type: ignore[arg-type]
    except pytest.skip.Exception as exc:
        return str(exc)
    return None


@pytest.fixture
def device_here(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_device_cases, "device_missing", lambda kind: "")


@pytest.mark.parametrize("side", ["reads_from", "writes_to"])
def test_an_engine_configured_host_only_skips_its_device_cases_saying_so(side: str, device_here: None) -> None:
    reason = skip_reason(Engine("host"), side)
    assert reason is not None and "as configured does not move cuda memory in " + side in reason, reason


@pytest.mark.parametrize("side", ["reads_from", "writes_to"])
def test_an_engine_configured_for_the_device_runs_its_device_cases_where_the_device_is(side: str, device_here: None) -> None:
    assert skip_reason(Engine("device"), side) is None


def test_a_read_from_a_peer_configured_host_only_skips(device_here: None) -> None:
    class HostPeer(Cases):
        peer_transport = "host"

    reason = skip_reason(Engine("device"), "reads_from", HostPeer)
    assert reason is not None and "does not move cuda memory in reads_from" in reason, reason
    assert skip_reason(Engine("device"), "writes_to", HostPeer) is None  # the reader's own destinations


def test_without_the_device_the_case_skips_naming_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_device_cases, "device_missing", lambda kind: f"no {kind} device here")
    reason = skip_reason(Engine("device"), "writes_to")
    assert reason is not None and "moves cuda memory in writes_to, but it cannot be tried here: no cuda device" in reason
