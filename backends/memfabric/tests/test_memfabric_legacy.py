"""``connect_legacy``: a reference-implementation Prefill known only by its ``"ip:port"``.

Nothing here starts memfabric (a guard makes sure): the engine is built bare around a fake
of its native handle, and the liveness probe is replaced. The real wheel is exercised by
the conformance suite's legacy check under the CPU kit (``inkit/``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from rd2h.errors import PeerGoneError, RegionError, TransferError
from rd2h.interfaces import Region
from rd2h.layout.regions import RegionSet
from rd2h_memfabric import MemFabricEngine, _native


class FakeNative:
    session_id = "10.0.0.2:11000"

    def __init__(self) -> None:
        self.reads: list[tuple[Any, ...]] = []

    def read(self, peer_id: str, local: list[int], remote: list[int], lengths: list[int], timeout: float) -> None:
        self.reads.append((peer_id, local, remote, lengths))


@pytest.fixture(autouse=True)
def no_memfabric(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    def refuse() -> None:
        raise AssertionError("memfabric_hybrid must not be imported by these tests")

    monkeypatch.setattr(_native, "_import", refuse)
    probed: list[str] = []
    monkeypatch.setattr(_native, "peer_listening", lambda session_id, timeout: probed.append(session_id) or True)
    return probed


def bare_engine(role: str = "decode", registered: tuple[tuple[int, int], ...] = ((0x1000, 0x1000),)) -> MemFabricEngine:
    engine = MemFabricEngine.__new__(MemFabricEngine)
    engine.role, engine.timeout, engine._closed = role, 1.0, False
    engine._native = FakeNative()  # type: ignore[assignment]
    engine._bounds = RegionSet(registered)
    return engine


def arrays(*columns: list[int]) -> list[np.ndarray]:
    return [np.asarray(c, dtype=np.int64) for c in columns]


def test_connects_from_the_session_id_alone(no_memfabric: list[str]) -> None:
    session = bare_engine().connect_legacy("10.0.0.1:7000")
    assert no_memfabric == ["10.0.0.1:7000"]  # the liveness probe asked the peer's address
    assert session.peer_id == "10.0.0.1:7000"
    assert session.peer_regions == (Region(0, 2**63 - 1),)  # nothing the peer proved


def test_reads_are_checked_on_the_decode_side_only() -> None:
    engine = bare_engine()
    session = engine.connect_legacy("10.0.0.1:7000")
    engine.read_batch(session, *arrays([0x1000], [0x7F00_0000_0000], [4096]))  # any remote address
    assert engine._native.reads == [("10.0.0.1:7000", [0x1000], [0x7F00_0000_0000], [4096])]  # type: ignore[attr-defined]
    with pytest.raises(RegionError, match="local destination"):
        engine.read_batch(session, *arrays([0x1800], [0x10], [4096]))  # runs past what Decode registered
    assert len(engine._native.reads) == 1  # type: ignore[attr-defined]


@pytest.mark.parametrize("p_session", ["", "10.0.0.1", "10.0.0.1:0", "10.0.0.1:port", ":7000", 7000])
def test_a_session_id_that_is_not_ip_port_is_a_transfer_error(p_session: Any, no_memfabric: list[str]) -> None:
    with pytest.raises(TransferError, match="(host|ip):port"):
        bare_engine().connect_legacy(p_session)
    assert no_memfabric == []


def test_refusals_say_why(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(TransferError, match="only a decode-side"):
        bare_engine("prefill").connect_legacy("10.0.0.1:7000")
    closed = bare_engine()
    closed._closed = True
    with pytest.raises(TransferError, match="closed"):
        closed.connect_legacy("10.0.0.1:7000")
    monkeypatch.setattr(_native, "peer_listening", lambda session_id, timeout: False)
    with pytest.raises(PeerGoneError, match="10.0.0.1:7000"):
        bare_engine().connect_legacy("10.0.0.1:7000")
