"""One client request's state in the proxy, from its arrival until ``Proxy.finish``."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from rd2h.proxy.instances import Instance

__all__ = ["Pending"]


@dataclass
class Pending:
    rid: str
    prompts: int
    futures: list[asyncio.Future[dict[str, Any]]]  # one per prompt: its sample 0 pulls
    all_in: asyncio.Future[None]  # every prompt's rendezvous is in: Prefill's leg may go
    headers: dict[str, str]  # forwarded to both legs
    heard: int = 0  # prompts whose rendezvous is in
    record: dict[str, Any] = field(default_factory=dict)
    recompute: bool = False  # every Decode that posted recomputes a failed load (its policy)
    started: float = field(default_factory=time.monotonic)
    prefill_answered: float | None = None
    streams: list[Instance] = field(default_factory=list)  # a streamed answer is outstanding until the end
    pinned: dict[str, Instance] = field(default_factory=dict)  # role -> the only instance to use (warm-up)
    warmup: bool = False  # the proxy's own request: no client metrics
    targets: dict[str, Any] | None = None  # Prefill's signed fields with every target, once all are in
    answered_by: dict[str, Instance] = field(default_factory=dict)  # role -> the instance that answered its leg
    nothing: bool = False  # every prompt's rendezvous said Decode loads nothing of it: no Prefill work

    def mark(self, name: str) -> None:  # the first time it passed ``name``, ms from ``started``
        self.record.setdefault("t", {}).setdefault(name, round((time.monotonic() - self.started) * 1e3, 3))
