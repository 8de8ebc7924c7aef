"""The engines of one kind (Prefill or Decode) behind the proxy: least-outstanding choice
among those that answer, ejection and return by health checks.

An instance is *down* from the first failed health check or connect error, and up again
from the first ``/health`` that answers 200: a dead engine stops getting requests within
one check interval. It is *in rotation* while it is up and *warm*: with warm-up on
(:mod:`rd2h.proxy.warmup`) a P/D request went through it since it last came up, so its
handshakes and first-use costs are paid and a client's first request is served like the
second; with warm-up off it is warm as soon as it is up. Going down makes it cold (it may come back
as a new process) and starts a new ``epoch``. Requests go to instances in rotation; among
those, to the one with the fewest requests outstanding (ties in turn), so one slow engine
does not collect a queue while others idle.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

__all__ = ["Instance", "Pool", "gone_for_good"]

log = logging.getLogger("rd2h.proxy")


def gone_for_good(exc: BaseException) -> bool:
    """Whether a failed call says the engine's process is gone (refused, or a connection it
    dropped), as opposed to slow (a timeout)."""
    return isinstance(exc, (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError))


@dataclass
class Instance:
    role: str  # "prefill" or "decode"
    url: str
    up: bool = True  # until a check or a connect error says otherwise
    warm: bool = True  # False until a warm-up went through it (warm-up on), and whenever it goes down
    epoch: int = 0  # counts its goings down: a warm-up is for the process that answered it
    outstanding: int = 0  # requests sent and not yet answered in full
    served: int = 0  # client requests (warm-ups are not counted)
    why_down: str = ""
    _gone: asyncio.Future[str] | None = field(default=None, repr=False, compare=False)

    def gone(self) -> asyncio.Future[str]:
        """Settled (with why) the next time this instance goes down: the requests whose part
        it still owes wait on it (a Prefill that answered before its KV was sent)."""
        if self._gone is None or self._gone.done():
            self._gone = asyncio.get_running_loop().create_future()
        return self._gone

    @property
    def in_rotation(self) -> bool:
        return self.up and self.warm

    def describe(self) -> dict[str, Any]:
        return {"url": self.url, "up": self.up, "warm": self.warm, "outstanding": self.outstanding,
                "served": self.served, **({"why_down": self.why_down} if not self.up else {})}


class Pool:
    """The instances of one role. ``warm_up``: an instance that comes up is cold until
    :meth:`mark_warm` (the proxy's warm-up); otherwise it is in rotation once up."""

    def __init__(self, role: str, urls: Sequence[str], *, warm_up: bool = False) -> None:
        if not urls:
            raise ValueError(f"the proxy needs at least one {role} URL")
        self.role = role
        self.warm_up = warm_up
        self.instances = [Instance(role, url.rstrip("/"), warm=not warm_up) for url in urls]
        self._turn = 0  # breaks ties in turn

    def pick(self, tried: set[str] = frozenset(), *, include_cold: bool = False,  # type: ignore[assignment]
             include_down: bool = False) -> Instance | None:
        """The instance in rotation with the fewest outstanding requests, not in ``tried``; None
        if none. ``include_cold``: up ones not yet warm too; ``include_down``: down ones too
        (health state lags a restart by up to one interval)."""
        candidates = [i for i in self.instances
                      if (i.in_rotation or (include_cold and i.up) or include_down) and i.url not in tried]
        if not candidates:
            return None
        fewest = min(i.outstanding for i in candidates)
        tied = [i for i in candidates if i.outstanding == fewest]
        self._turn += 1
        return tied[self._turn % len(tied)]

    def mark_down(self, instance: Instance, why: str, *, dead: bool = False) -> None:
        """Out of rotation. ``dead``: the failure says the process is gone (its port refuses
        connections, or it dropped one mid-answer), not merely slow: the requests it still owes
        (:meth:`Instance.gone`) fail; a timeout on a loaded machine fails nothing in flight."""
        if instance.up:
            log.warning("%s %s is down: %s", self.role, instance.url, why)
            instance.epoch += 1
        if dead and instance._gone is not None and not instance._gone.done():
            instance._gone.set_result(why)
        instance.up, instance.why_down = False, why
        if self.warm_up:
            instance.warm = False

    def mark_up(self, instance: Instance) -> None:
        if not instance.up:
            log.warning("%s %s answers again: %s", self.role, instance.url,
                        "warming up" if self.warm_up else "back in rotation")
        instance.up, instance.why_down = True, ""

    def mark_warm(self, instance: Instance) -> None:
        if not instance.warm:
            log.info("%s %s is warm: in rotation", self.role, instance.url)
        instance.warm = True

    def any_up(self) -> bool:
        return any(i.up for i in self.instances)

    def any_in_rotation(self) -> bool:
        return any(i.in_rotation for i in self.instances)

    async def check(self, client: httpx.AsyncClient, timeout: float) -> None:
        """One health check of every instance, concurrently."""
        await asyncio.gather(*(self._check_one(client, i, timeout) for i in self.instances))

    async def _check_one(self, client: httpx.AsyncClient, instance: Instance, timeout: float) -> None:
        try:
            response = await client.get(instance.url + "/health", timeout=timeout)
        except httpx.HTTPError as exc:
            self.mark_down(instance, f"health check: {type(exc).__name__}: {exc}", dead=gone_for_good(exc))
            return
        if response.status_code == 200:
            self.mark_up(instance)
        else:
            self.mark_down(instance, f"health check answered {response.status_code}")
