"""The streamed flow of ``rd2h proxy --first-token-from-prefill``: Decode's leg goes out with
Prefill's, not after Prefill answers, so Decode's admission, its rendezvous and the transfer
overlap Prefill's compute (the time the client waits for its last token is the at-once flow's),
while the client's first token is still Prefill's.

1. Prefill and Decode get their legs at once: Prefill's as in :mod:`rd2h.proxy.first_flow`
   (its targets fetched later, ``return_token_ids``, its sampled token the client's first);
   Decode's the normal flow's, asked with ``return_token_ids``: it loads the prompt's KV but the
   last token's and generates every token, the first included.
2. On Prefill's answer the client gets the first token. If it ends the request, that is the
   whole answer and Decode's leg is cancelled.
3. Decode's stream follows (:class:`rd2h.proxy.first_token.Continuation`): its first token is
   dropped once it is the one Prefill sampled, with the same text. Greedy on the same weights
   it is, up to the numerics of two engines; where it is not (:class:`Mismatch`, counted as the
   ``mismatch`` outcome and logged), Decode's stream is closed and Decode computes the rest as a
   plain request, the prompt's token ids and Prefill's token its prompt (its prefix cache holds
   what it loaded): the client's tokens are still one engine's, later.

A non-streamed request gains nothing from an early first token: it takes the at-once flow's
order too, but its answer is Decode's alone (:func:`rd2h.proxy.first_flow.first_token_answer`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi.responses import Response, StreamingResponse

from rd2h.proxy.bodies import error_event
from rd2h.proxy.failures import EngineError, cancel
from rd2h.proxy.first_flow import _decode_answer, _ended_by, _first_out, _owes, _prefill, ended_at_first
from rd2h.proxy.first_token import (
    Continuation,
    First,
    Mismatch,
    StreamRewriter,
    decode_leg,
    ends_at_first,
    first_chunks,
    splits_a_character,
)
from rd2h.vllm.params import decode_fields

if TYPE_CHECKING:
    import httpx

    from rd2h.proxy.app import Proxy
    from rd2h.proxy.pending import Pending

__all__ = ["overlapped_answer"]

log = logging.getLogger("rd2h.proxy")


async def overlapped_answer(proxy: Proxy, pending: Pending, path: str, body: dict[str, Any],
                            headers: dict[str, str]) -> Response:
    """A streamed request's answer: Prefill's leg now, Decode's once Prefill asked for its targets
    (its engine has the request: Decode's HTTP and tokenizing then overlap Prefill's compute,
    not its API server's tokenizing), or once Prefill answered, if that comes first."""
    prefill = asyncio.ensure_future(_prefill(proxy, pending, path, body))
    legs: tuple[asyncio.Task[httpx.Response], asyncio.Task[None]] | None = None
    try:
        asked = asyncio.ensure_future(pending.asked.wait())
        try:
            await asyncio.wait({prefill, asked}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            asked.cancel()
        if not prefill.done() or prefill.result()[1] is None:
            legs = (_decode_at_once(proxy, pending, path, body), asyncio.create_task(_owes(pending)))
        first, failed = await prefill
    except BaseException as exc:
        _ended_by(proxy, pending, exc)
        for task in (prefill, *(legs or ())):
            await cancel(task)
        raise
    if failed is not None or ends_at_first(first, body):
        for task in legs or ():
            await cancel(task)  # its HTTP stream closed: vLLM aborts Decode's request
    if failed is not None:
        return failed
    assert first is not None and legs is not None
    if ends_at_first(first, body):
        return ended_at_first(proxy, pending, first, body, headers)
    ours = None if splits_a_character(first) else first
    pending.record["first_token"] = "overlapped" if ours else "split_character: Decode's stream whole"
    if ours is None:
        proxy.metrics.first_token_fallbacks.labels("split_character").inc()
    return StreamingResponse(_stream(proxy, pending, path, ours, body, legs), media_type="text/event-stream",
                             headers=headers)


def _decode_at_once(proxy: Proxy, pending: Pending, path: str, body: dict[str, Any]) -> asyncio.Task[httpx.Response]:
    """Decode's leg, sent now: the normal flow's, its token ids asked for (the first is checked)."""
    leg = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    leg["return_token_ids"] = True
    leg["kv_transfer_params"] = {"do_remote_prefill": True,
                                 "rd2h": decode_fields(proxy.config.secret, pending.rid, 1, 1, time.time())}
    return asyncio.create_task(proxy._send(proxy.decode_pool, path, leg, stream=True, pending=pending))


async def _stream(proxy: Proxy, pending: Pending, path: str, first: First | None, body: dict[str, Any],
                            legs: tuple[asyncio.Task[httpx.Response], asyncio.Task[None]]) -> AsyncIterator[bytes]:
    """The client's stream: Prefill's first token at once, then Decode's stream after its own
    first token (``first`` None: Prefill's token was not sent, Decode's stream as it is)."""
    owes = legs[1]
    relayed = False  # once Decode's stream is relayed, _relay ends the request
    try:
        if first is not None:
            yield first_chunks(first, body, last=False)
            _first_out(proxy, pending)
        try:
            response = await _decode_answer(proxy, pending, (path, body), legs)
        except EngineError as exc:
            proxy.metrics.first_token.labels("failed").inc()
            proxy.finish(pending, 502, str(exc), kind=exc.kind)
            yield error_event(str(exc), 502)
            return
        if response.status_code >= 400:
            data = await response.aread()
            await response.aclose()
            proxy.metrics.first_token.labels("failed").inc()
            proxy.finish(pending, response.status_code, f"Decode answered {response.status_code}")
            yield error_event(f"Decode answered {response.status_code}: {data[:300].decode(errors='replace')}", 502)
            return
        relayed = True
        continuation = Continuation(first, body)
        relay = proxy._relay(response, owes, pending, (path, body))
        try:
            async for raw in relay:
                out = continuation.feed(raw)
                if out:
                    yield out
        except Mismatch as exc:
            await relay.aclose()  # Decode's stream closed (vLLM aborts its request); the request ended
            assert first is not None
            async for raw in _recomputed(proxy, pending, path, first, body, exc):
                yield raw
            return
        rest = continuation.flush()
        if rest:
            yield rest
        if first is not None:
            proxy.metrics.first_token.labels("continued").inc()
    finally:
        if not relayed:
            for task in legs:
                if not task.done():
                    await cancel(task)
            if pending.rid in proxy.pending:  # the client went away before Decode answered
                proxy.finish(pending, 499, "the client went away", kind="cancelled")


async def _recomputed(proxy: Proxy, pending: Pending, path: str, first: First, body: dict[str, Any],
                      why: Mismatch) -> AsyncIterator[bytes]:
    """Decode's first token was not Prefill's: Decode computes the rest as a plain request
    (the prompt and Prefill's token), relayed as the rest of the client's stream."""
    proxy.metrics.first_token.labels("mismatch").inc()
    log.warning("request %s: %s; Decode computes the rest after Prefill's token as a plain request",
                pending.rid, why)
    rewriter = StreamRewriter(first)
    try:
        response = await proxy._send(proxy.decode_pool, path, decode_leg(body, first), stream=True, pending=pending)
    except EngineError as exc:
        yield error_event(f"Decode, computing the rest after a first-token mismatch: {exc}", 502)
        return
    try:
        if response.status_code >= 400:
            data = await response.aread()
            yield error_event(f"Decode answered {response.status_code}: {data[:300].decode(errors='replace')}", 502)
            return
        async for raw in response.aiter_raw():
            out = rewriter.feed(raw)
            if out:
                yield out
        rest = rewriter.flush()
        if rest:
            yield rest
    finally:
        await response.aclose()
