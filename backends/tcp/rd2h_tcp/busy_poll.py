"""Poll without sleeping for a short while after traffic, then sleep: the wake-up a blocked
thread pays is the largest cost of a small round trip on a virtual machine.

A thread blocked in ``poll`` is woken by the kernel when a frame lands; on these 2-vCPU virtual
machines that wake-up (an idle vCPU halted, an interrupt to the host, the vCPU scheduled again)
costs 10-500 us and varies with the host, against ~10 us for a frame between two threads that
are awake. A control channel carries bursts (a layer's readiness, its reply, the next layer's
readiness a few hundred microseconds later), so each end keeps polling for ``window`` seconds
after its last frame in or out, and sleeps once that much time passed with nothing: the cost is
CPU only while traffic flows, none when idle (an idle engine does not spin). Each empty poll
yields the CPU (``sched_yield``), so on a loaded machine a runnable thread waiting for this
core runs first.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["poll_briefly"]

T = TypeVar("T")

_yield = getattr(os, "sched_yield", lambda: None)


def poll_briefly(poll_now: Callable[[], list[T]], until: float) -> list[T]:
    """Call ``poll_now`` (a poll with timeout 0) until it reports something or the monotonic
    clock passes ``until`` (at once where it already has: no call); return what it reported
    (empty: nothing came, sleep now)."""
    clock = time.monotonic
    while clock() < until:
        events = poll_now()
        if events:
            return events
        _yield()
    return []
