"""The shared transfer-engine conformance suite, run against the local engine."""

import pytest

from rd2h.testing import EngineConformance


@pytest.mark.filterwarnings("error::UserWarning")  # the local engine meets the suite's preferences too
class TestLocalEngineConformance(EngineConformance):
    engine_name = "local"
    engine_options = {"threads": 2, "parallel_threshold_bytes": 1 << 20}
    skip_if_unavailable = False  # every test must run here: Linux is all it needs
    failure_bound_s = 5.0
