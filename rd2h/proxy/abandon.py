"""A request whose handler or stream ends without its answer (the client went away, the server
shuts down): its legs are cancelled (closing their connections makes vLLM abort them and the
connector free their blocks) and the request ends once, so Prefill's ask for targets gets 410
and nothing stays in ``Proxy.pending``.

A stream needs more than its generator's ``finally``: Starlette never closes a body iterator,
and one the server never started (the client gone before the headers went out) has no
``finally`` to run. :class:`ClosingStream` closes it after the response, whatever happened, and
then calls ``on_close`` for what a generator that never ran left behind.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from fastapi.responses import StreamingResponse

from rd2h.proxy.failures import cancel

if TYPE_CHECKING:
    import httpx

    from rd2h.proxy.app import Proxy
    from rd2h.proxy.pending import Pending

__all__ = ["ClosingStream", "abandon", "end_once", "gone_status", "never_ran", "stop_legs"]


def gone_status(exc: BaseException) -> tuple[int, str, str]:
    """``(status, error, kind)`` of a request ended by ``exc``: the client gone (499) when it was
    cancelled, else a fault of the proxy's own (500)."""
    if isinstance(exc, asyncio.CancelledError):
        return 499, "the client went away", "cancelled"
    return 500, f"proxy: {exc!r}", "proxy_failed"


def end_once(proxy: Proxy, pending: Pending, exc: BaseException) -> bool:
    """End the request on ``exc`` unless it ended already; whether it did end it here."""
    if pending.rid not in proxy.pending:
        return False
    status, error, kind = gone_status(exc)
    proxy.finish(pending, status, error, kind=kind)  # Prefill's ask for targets gets 410
    return True


async def stop_legs(*legs: asyncio.Future[Any] | None) -> None:
    """Cancel every leg still running (an answer it had is closed); the first step is synchronous,
    so a second cancellation while awaiting them still leaves each one cancelled."""
    running = [leg for leg in legs if leg is not None and not leg.done()]
    for leg in running:
        leg.cancel()
    for leg in legs:
        if leg is not None:
            await cancel(leg)


async def abandon(proxy: Proxy, pending: Pending, exc: BaseException, *legs: asyncio.Future[Any] | None,
                  response: httpx.Response | None = None) -> None:
    """A handler left on ``exc`` with its legs out: the request ends (unless it ended already), its
    legs are stopped and ``response`` (an answer that is no leg's, or one not relayed) is closed."""
    end_once(proxy, pending, exc)
    await stop_legs(*legs)
    if response is not None:
        await response.aclose()


def never_ran(proxy: Proxy, pending: Pending, *legs: asyncio.Future[Any] | None,
              response: httpx.Response | None = None) -> Callable[[], Awaitable[None]]:
    """``on_close`` for a stream whose generator may never run (the client gone before the headers
    went out): unless the request ended already, :func:`abandon` as the client gone (``response``:
    Decode's answer, which the generator would have closed)."""
    async def end() -> None:
        if pending.rid in proxy.pending:
            await abandon(proxy, pending, asyncio.CancelledError(), *legs, response=response)
    return end


class ClosingStream(StreamingResponse):
    """A StreamingResponse that closes its body iterator once the response ends however it ended
    (its generator's ``finally`` runs at once, not when it is collected), then awaits ``on_close``."""

    def __init__(self, content: Any, *, on_close: Callable[[], Awaitable[None]], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            try:
                if aclose is not None:
                    await aclose()
            finally:  # a generator that raised while closing must not leave its request pending
                await self._on_close()
