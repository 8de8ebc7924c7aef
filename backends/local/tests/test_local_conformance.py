"""The shared transfer-engine conformance suite, run against the local engine."""

from rd2h.testing import EngineConformance


class TestLocalEngineConformance(EngineConformance):
    engine_name = "local"
    engine_options = {"threads": 2, "parallel_threshold_bytes": 1 << 20}
    skip_if_unavailable = False  # every test must run here: Linux is all it needs
    failure_bound_s = 5.0
