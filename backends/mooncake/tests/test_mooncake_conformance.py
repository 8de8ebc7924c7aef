"""rd2h's engine conformance suite against Mooncake Transfer Engine (TCP on loopback)."""

from __future__ import annotations

import pytest

from rd2h.testing import EngineConformance

from mooncake_test_options import OPTIONS


@pytest.mark.filterwarnings("error::UserWarning")  # a dead peer must be a PeerGoneError, not a plain TransferError
class TestMooncakeConformance(EngineConformance):
    engine_name = "mooncake"
    # mooncake gives up on a silent peer after 2 s, its call bound is 5 s: failures well inside 10 s
    engine_options = OPTIONS
    skip_if_unavailable = False  # `make setup` installs it: unavailable is a failure
    failure_bound_s = 10.0
