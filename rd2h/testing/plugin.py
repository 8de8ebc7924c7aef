"""pytest plugin, loaded in every pytest run where rd2h is installed (entry point ``pytest11``).

It registers the marker the conformance suite puts on its tests, so that runs with
``--strict-markers`` accept it and ``-m rd2h_conformance`` selects them, and the ``closer``
fixture the channel suite and channel tests share. It imports nothing beyond pytest and
cannot fail at import.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest

T = TypeVar("T")


def pytest_configure(config: Any) -> None:
    config.addinivalue_line(
        "markers",
        "rd2h_conformance: a test of rd2h's backend conformance suite (rd2h.testing)",
    )


@pytest.fixture
def closer() -> Iterator[Callable[[T], T]]:
    """``keep(thing)`` returns ``thing`` and closes it when the test ends, last kept first."""
    opened: list[Any] = []

    def keep(thing: T) -> T:
        opened.append(thing)
        return thing

    yield keep
    for thing in reversed(opened):
        thing.close()
