"""Decode's stream relayed to the client (:func:`relay`): the streamed answer of both the normal
flow (:meth:`rd2h.proxy.app.Proxy.handle`) and the first-token flow (:mod:`rd2h.proxy.first_flow`,
which rewrites its events); the request ends with it, once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import httpx

from rd2h.proxy.bodies import error_event
from rd2h.proxy.failures import EngineError, PrefillFailed, cancel, failure

if TYPE_CHECKING:
    from rd2h.proxy.app import Proxy
    from rd2h.proxy.pending import Pending

__all__ = ["relay"]


async def relay(
    proxy: Proxy, response: httpx.Response, prefill: asyncio.Task[None], pending: Pending,
    request: tuple[str, dict[str, Any]], rewriter: Any = None,
) -> AsyncIterator[bytes]:
    """Decode's stream. Until its first chunk, a Prefill failure ends it with an error event
    (or, under Decode's ``recompute`` policy, switches to a Decode computing the prompt);
    after it, Decode had its KV whole (it emits nothing before) and Prefill no longer matters.
    ``rewriter`` (feed, flush; ValueError: Decode sent what it cannot read) rewrites the chunks."""
    chunks = response.aiter_raw()
    status, kind, error = response.status_code, "", ""
    relayed = False
    try:
        while True:
            # a task only while Prefill may still fail the stream; then each chunk at once
            next_chunk = chunks.__anext__() if relayed else asyncio.ensure_future(chunks.__anext__())
            if not relayed:
                await asyncio.wait({next_chunk, prefill}, return_when=asyncio.FIRST_COMPLETED)
            # Prefill's failure matters until the first chunk, unless it was settled already
            # (handle() recomputed when Prefill failed before Decode's headers came)
            failed = not relayed and "recomputed" not in pending.record and failure(prefill)
            if failed:
                await cancel(next_chunk)
                if isinstance(failed, PrefillFailed) and pending.recompute:
                    await response.aclose()
                    try:
                        response = await proxy.recompute(pending, *request, failed)
                    except EngineError as exc:
                        failed = exc
                    else:
                        chunks, status, relayed = response.aiter_raw(), response.status_code, True
                        continue
                status, error = 502, str(failed)
                kind = getattr(failed, "kind", "engine_failed")
                yield error_event(error, status)  # no [DONE]: the stream failed
                return
            try:
                chunk = await next_chunk
                out = chunk if rewriter is None else rewriter.feed(chunk)
            except StopAsyncIteration:
                if rewriter is not None and (rest := rewriter.flush()):
                    yield rest
                return
            except ValueError as exc:  # Decode sent what the rewriter cannot read
                status, kind, error = 502, "decode_failed", f"Decode: {exc}"
                yield error_event(error, status)
                return
            except httpx.TransportError as exc:  # Decode died mid-stream
                status, kind, error = 502, "decode_failed", f"Decode: {type(exc).__name__}: {exc}"
                yield error_event(error, status)
                return
            if chunk and not relayed:
                proxy._first_byte(pending)
            relayed = relayed or bool(chunk)
            if out:
                yield out
    except (GeneratorExit, asyncio.CancelledError):  # closed before its end: the client went away
        status, kind, error = 499, "cancelled", "the client went away"
        raise
    finally:
        await response.aclose()
        await proxy._settle(prefill, pending)
        proxy.finish(pending, status, error, kind=kind)
