"""How the proxy's request flow fails (the exceptions it maps to HTTP answers) and the small
pieces it settles and cancels its futures and tasks with."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import httpx
from fastapi.responses import JSONResponse

from rd2h.proxy.bodies import error_body

__all__ = [
    "EngineError", "NoInstance", "PrefillFailed", "RendezvousTimeout", "cancel", "error_answer", "failure", "refused",
    "settle",
]  # fmt: skip

log = logging.getLogger("rd2h.proxy")


class EngineError(Exception):
    """An engine failed a request (transport error after it was sent, or HTTP error)."""

    kind = "engine_failed"
    status = 502  # the client's answer


class PrefillFailed(EngineError):
    """Prefill failed a request after the rendezvous was handed to it: Decode may recompute."""

    kind = "prefill_failed"


class RendezvousTimeout(EngineError):
    kind = "rendezvous_timeout"


class NoInstance(EngineError):
    """No instance of a role is in rotation: 503, the client may retry later."""

    kind = "no_instance"
    status = 503


def settle(future: asyncio.Future[Any], error: BaseException | None) -> None:
    """Settle ``future`` (with ``error``, or None as its result) unless it is done already."""
    if not future.done():
        future.set_exception(error) if error is not None else future.set_result(None)


def failure(task: asyncio.Future[Any]) -> BaseException | None:
    """The exception a finished task ended with (None while it runs, or if cancelled)."""
    if not task.done() or task.cancelled():
        return None
    return task.exception()


async def cancel(task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` and wait until it ended (an answer it had is closed): how it ended is not
    the caller's concern, its cancellation included. This task's own cancellation while it waits
    (the client went away) is: it propagates once ``task`` ended, so the request ends as the client
    gone (499), not as the failure that had it cancel ``task``."""
    current = asyncio.current_task()
    before = current.cancelling() if current is not None else 0
    task.cancel()
    with contextlib.suppress(Exception, asyncio.CancelledError):
        await task
    if task.done() and not task.cancelled() and task.exception() is None and isinstance(task.result(), httpx.Response):
        await task.result().aclose()  # it answered before the cancellation reached it
    if current is not None and current.cancelling() > before:
        raise asyncio.CancelledError


def refused(metrics: Any, what: str, exc: Exception) -> JSONResponse:
    """An engine's post (``what``: "rendezvous", "targets") that is not vouched for: logged,
    counted (``rd2h_proxy_errors_total{kind="<what>_refused"}``), answered 403."""
    log.warning("refused a %s post: %s", what, exc)
    metrics.errors.labels(f"{what}_refused").inc()
    return JSONResponse({"error": f"{what} refused: {exc}"}, status_code=403)


def error_answer(message: str, status: int, headers: dict[str, str] | None = None) -> JSONResponse:
    """The client's answer when the proxy or an engine failed its request, in OpenAI's error shape."""
    return JSONResponse(error_body(message, "rd2h_proxy_error", status), status, headers=headers)
