"""The time source of the runtimes, injectable so tests move time instead of sleeping.

The pure trackers never read a clock: every call that can time something out takes
``now``. The runtimes pass ``clock()``; tests give them a :class:`ManualClock` and advance
it, then wait on an event the runtime sets, never on a sleep.
"""

from __future__ import annotations

import time
from typing import Callable

__all__ = ["Clock", "monotonic", "ManualClock"]

Clock = Callable[[], float]
monotonic: Clock = time.monotonic


class ManualClock:
    """A clock that only moves when told to. One thread advances it (the test); any thread
    may read it: reading a float attribute is atomic."""

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start

    def __call__(self) -> float:
        return self._now

    def advance(self, seconds: float) -> float:
        if seconds < 0:
            raise ValueError("a clock does not go back")
        self._now += seconds
        return self._now
