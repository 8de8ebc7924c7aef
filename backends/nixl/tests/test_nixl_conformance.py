"""rd2h's engine conformance suite against a NIXL agent (UCX; ``cma`` between two processes here)."""

from __future__ import annotations

import pytest

from rd2h.testing import EngineConformance


@pytest.mark.filterwarnings("error::UserWarning")  # a dead peer must be a PeerGoneError, not a plain TransferError
class TestNixlConformance(EngineConformance):
    engine_name = "nixl"
    engine_options = {"timeout": 5.0}
    skip_if_unavailable = False  # `make setup` installs it: unavailable is a failure
    failure_bound_s = 10.0
