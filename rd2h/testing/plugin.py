"""pytest plugin, loaded in every pytest run where rd2h is installed (entry point ``pytest11``).

It only registers the marker the conformance suite puts on its tests, so that runs with
``--strict-markers`` accept it and ``-m rd2h_conformance`` selects them. It imports
nothing beyond pytest's own hook machinery and cannot fail at import.
"""

from __future__ import annotations

from typing import Any


def pytest_configure(config: Any) -> None:
    config.addinivalue_line(
        "markers",
        "rd2h_conformance: a test of rd2h's backend conformance suite (rd2h.testing)",
    )
