"""rd2h's engine conformance suite against memfabric-hybrid 1.3.0 (HOST_TCP under the CPU kit)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest

from rd2h.interfaces import Session
from rd2h.testing import EngineConformance
from rd2h.testing.engine_suite import Reader
from rd2h.testing.peer import PeerProcess


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


STORE_URL = f"tcp://127.0.0.1:{_free_port()}"


@pytest.mark.filterwarnings("error::UserWarning")  # e.g. a dead peer reported as a plain TransferError
class TestMemFabricConformance(EngineConformance):
    engine_name = "memfabric"
    skip_if_unavailable = False  # the runner starts this under the kit: unavailable is a failure
    failure_bound_s = 10.0  # above the engine timeout (5 s) plus the liveness probe (2 s)

    @classmethod
    def engine_options_for(cls, role: str) -> dict[str, Any]:
        # The reading (decode) side starts the config store; memfabric 1.3.0 does not need it in
        # this role arrangement (a Prefill engine serves its own), but the option must work.
        return {"store_url": STORE_URL, "timeout": 5.0, "start_store": role == "decode"}

    # memfabric 1.3.0's HOST_TCP path binds every Prefill engine's data port at 11000 on the
    # host's address, so only one Prefill engine can run per host: one peer per test, not a
    # class-wide peer beside the per-test peers of the kill tests.
    @pytest.fixture
    def peer(self, reader: Reader) -> Iterator[PeerProcess]:
        with self.start_peer(seed=1) as p:
            yield p

    @pytest.fixture
    def session(self, reader: Reader, peer: PeerProcess) -> Session:
        return reader.engine.connect(peer.metadata)
