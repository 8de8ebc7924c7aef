"""The flow of ``rd2h proxy --first-token-from-prefill`` (what is decided and assembled is
:mod:`rd2h.proxy.first_token`).

1. Prefill gets its leg at once, its signed fields naming where to ask for its targets
   (:func:`rd2h.vllm.params.later_fields` with ``first``: a Mamba Prefill computes the prompt
   whole and sends nothing) and ``return_token_ids``: its answer names the prompt's token ids
   and the token it sampled.
2. On that answer the client gets the first token (a streamed event, or kept for the final
   body). If it ends the request, that is the whole answer, and Prefill's ask for targets gets
   410 (it frees the blocks it held; counted there as ``targets_failed``).
3. Otherwise Decode gets its leg: the prompt's token ids and the first token, ``max_tokens``
   one less, its signed fields with ``tail`` 1. Its rendezvous gives Prefill its targets as in
   Prefill at once (:mod:`rd2h.proxy.early`); what Decode generates follows the first token.

Failures are the at-once flow's: Prefill failing its leg fails the request (502: no token was
sent yet); once Decode's leg is out, Prefill found gone before Decode's first byte, or no
rendezvous within ``rendezvous_timeout``, fails it (a streamed request gets an error event
after its first token), except under Decode's ``recompute`` policy, where a Decode computes
its leg (the prompt and the first token) as a plain request: the same tokens, later.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import httpx
from fastapi.responses import JSONResponse, Response, StreamingResponse

from rd2h.proxy.abandon import ClosingStream, end_once, never_ran, stop_legs
from rd2h.proxy.bodies import error_body, error_event, prefill_body
from rd2h.proxy.early import prefill_owes
from rd2h.proxy.failures import EngineError, PrefillFailed, error_answer
from rd2h.proxy.first_token import (
    DEFAULT_MAX_TOKENS,
    First,
    StreamRewriter,
    decode_leg,
    ends_at_first,
    first_chunks,
    first_of,
    merged_body,
    prefill_only_body,
    read_json,
    splits_a_character,
    why_not,
)  # fmt: skip
from rd2h.proxy.models import refusal
from rd2h.proxy.relay import relay
from rd2h.vllm.params import MAX_WAIT, decode_fields, later_fields

if TYPE_CHECKING:
    from rd2h.proxy.app import Proxy
    from rd2h.proxy.pending import Pending

__all__ = ["first_token_answer"]

log = logging.getLogger("rd2h.proxy")


async def first_token_answer(proxy: Proxy, path: str, body: dict[str, Any], headers: dict[str, str],
                             arrived: float) -> Response | None:
    """The client's answer with its first token from Prefill, or None where the request must
    take the normal flow (the reason logged at debug and counted)."""
    reason = why_not(path, body)
    if reason is not None:
        proxy.metrics.first_token_fallbacks.labels(reason).inc()
        log.debug("first token from Prefill: not for this request (%s): the normal flow", reason)
        return None
    pending = proxy.open(path, 1, headers, arrived=arrived)  # its rendezvous timeout armed
    answer_headers = {"x-request-id": headers["x-request-id"]}
    stream = bool(body.get("stream"))
    # the model's length, learned while Prefill computes (once per Decode process): _too_long checks it
    limits = proxy.model_lengths.learn(proxy.client, proxy.decode_pool, proxy.config.connect_timeout, pending.headers)
    try:
        first, failed = await _prefill(proxy, pending, path, body)
    except BaseException as exc:
        _ended_by(proxy, pending, exc)
        raise
    if failed is not None:
        return failed
    assert first is not None
    refused, too_short = await _too_long(proxy, pending, first, body, limits)
    if refused is not None:
        return refused
    if ends_at_first(first, body):
        return ended_at_first(proxy, pending, first, body, answer_headers)
    ours: First | None = first
    if splits_a_character(first):  # its text is not the client's: Decode generates every token (Prefill at once)
        ours, leg, tail = None, {k: v for k, v in body.items() if k != "kv_transfer_params"}, 0
        proxy.metrics.first_token_fallbacks.labels("split_character").inc()
        pending.record["first_token"] = "split_character: Decode generates it again, Prefill sent at once"
    else:
        leg, tail = decode_leg(body, first), 1
        pending.record["first_token"] = "continued"
    decode_body = {**leg, "kv_transfer_params": {"do_remote_prefill": True, "rd2h": decode_fields(
        proxy.config.secret, pending.rid, 1, 1, time.time(), tail=tail)}}  # fmt: skip
    owes = asyncio.create_task(_owes(pending))
    decode = asyncio.create_task(proxy._send(proxy.decode_pool, path, decode_body, stream=stream, pending=pending,
                                             avoid=too_short))  # fmt: skip
    if stream:
        return ClosingStream(_stream(proxy, pending, (path, leg), ours, body, (decode, owes)),
                             on_close=never_ran(proxy, pending, decode, owes),
                             media_type="text/event-stream", headers=answer_headers)  # fmt: skip
    return await _whole(proxy, pending, (path, leg), ours, body, (decode, owes), answer_headers)


def ended_at_first(proxy: Proxy, pending: Pending, first: First, body: dict[str, Any],
                   headers: dict[str, str]) -> Response:
    """The first token ends the request: Prefill's answer is the client's whole answer."""
    pending.record["first_token"] = "ended_at_first"
    proxy.metrics.first_token.labels("ended_at_first").inc()
    _first_out(proxy, pending)
    proxy.finish(pending, 200)  # Prefill's ask for targets gets 410: it frees what it held
    if body.get("stream"):
        chunk = first_chunks(first, body, last=True)
        return StreamingResponse(_once(chunk), media_type="text/event-stream", headers=headers)
    return JSONResponse(prefill_only_body(first, body), headers=headers)


async def _prefill(proxy: Proxy, pending: Pending, path: str, body: dict[str, Any],
                   ) -> tuple[First | None, Response | None]:
    """Prefill's leg, at once: ``(its first token, None)``, or ``(None, the client's error answer)``."""
    leg = prefill_body(body)
    leg["return_token_ids"] = True  # its answer names the prompt's token ids and the one it sampled
    fields = later_fields(proxy.config.secret, pending.rid, 1, str(proxy.config.first_token_url),
                          min(proxy.config.rendezvous_timeout, MAX_WAIT), time.time(), first=True)  # fmt: skip
    leg["kv_transfer_params"] = {"do_remote_decode": True, "rd2h": fields}
    headers = {"x-request-id": pending.headers["x-request-id"]}
    try:
        response = await proxy.send_prefill(pending, path, leg)
        if response.status_code >= 400:  # Prefill refused it (a client's error, e.g. too long): as it said
            proxy.finish(pending, response.status_code, f"Prefill answered {response.status_code}",
                         kind="prefill_failed")
            proxy.metrics.first_token.labels("failed").inc()
            return None, Response(response.content, response.status_code, headers=headers,
                                  media_type=response.headers.get("content-type"))  # fmt: skip
        return first_of(read_json(response.content, "Prefill")), None
    except (EngineError, ValueError) as exc:
        status, kind = (exc.status, exc.kind) if isinstance(exc, EngineError) else (502, "prefill_failed")
        proxy.finish(pending, status, f"Prefill: {exc}", kind=kind)
        proxy.metrics.first_token.labels("failed").inc()
        return None, error_answer(f"Prefill: {exc}", status, headers)


async def _too_long(proxy: Proxy, pending: Pending, first: First, body: dict[str, Any],
                   limits: asyncio.Future[Any] | None) -> tuple[Response | None, frozenset[str]]:
    """The client's 400 (vLLM's) when the prompt Prefill read plus ``max_tokens`` exceeds the model's
    length on every Decode up, before the first token goes out, else None; and the Decodes known
    too short for it, which Decode's leg must avoid (:func:`rd2h.proxy.models.refusal`)."""
    try:
        if limits is not None:  # the listings are shared: one request gone must not cancel them
            await asyncio.shield(limits)
    except BaseException as exc:
        _ended_by(proxy, pending, exc)
        raise
    lengths = proxy.model_lengths.lengths(proxy.decode_pool, body.get("model"))
    message, too_short = refusal(len(first.prompt_ids), body.get("max_tokens", DEFAULT_MAX_TOKENS), lengths)
    if message is None:
        return None, too_short
    proxy.metrics.first_token.labels("failed").inc()
    proxy.finish(pending, 400, message, kind="refused")  # Prefill's ask for targets gets 410
    return JSONResponse(error_body(message, "invalid_request_error", 400), 400,
                        headers={"x-request-id": pending.headers["x-request-id"]}), too_short


def _ended_by(proxy: Proxy, pending: Pending, exc: BaseException) -> None:
    """The request ends on an exception, unless it ended already: the client gone (499, cancelled)
    or a fault of the proxy's own (500, counted failed). Prefill's ask for targets gets 410."""
    if end_once(proxy, pending, exc) and not isinstance(exc, asyncio.CancelledError):
        proxy.metrics.first_token.labels("failed").inc()


def _first_out(proxy: Proxy, pending: Pending) -> None:
    pending.mark("first_token_out")
    proxy.metrics.first_token_seconds.observe(time.monotonic() - pending.started)  # never a warm-up


async def _owes(pending: Pending) -> None:
    """Prefill's part once Decode's leg is out: every rendezvous in time, then Prefill alive until
    Decode's first byte (:func:`rd2h.proxy.early.prefill_owes`)."""
    await asyncio.shield(pending.all_in)  # cancelled, it must not cancel the future Prefill's ask waits on
    if not pending.nothing:  # Decode loads nothing (e.g. its prefix cache holds it): nothing is owed
        await prefill_owes(pending)


async def _decode_answer(proxy: Proxy, pending: Pending, request: tuple[str, dict[str, Any]],
                         legs: tuple[asyncio.Task[httpx.Response], asyncio.Task[None]]) -> httpx.Response:
    """Decode's response, or under its ``recompute`` policy a Decode computing its leg when
    Prefill failed; EngineError otherwise."""
    try:
        return await proxy.first_answer(*legs)
    except PrefillFailed as exc:
        if not pending.recompute:
            raise
        return await proxy.recompute(pending, *request, exc)


async def _whole(proxy: Proxy, pending: Pending, request: tuple[str, dict[str, Any]], first: First | None,
                 body: dict[str, Any], legs: tuple[asyncio.Task[httpx.Response], asyncio.Task[None]],
                 headers: dict[str, str]) -> Response:
    """A non-streamed request: the first token and Decode's answer in one body (``first`` None:
    Decode's answer as it is)."""
    owes = legs[1]  # Prefill's part: settled once Decode answered
    try:
        try:
            response = await _decode_answer(proxy, pending, request, legs)
        except EngineError as exc:
            proxy.metrics.first_token.labels("failed").inc()
            proxy.finish(pending, exc.status, str(exc), kind=exc.kind)
            return error_answer(str(exc), exc.status, headers)
        data = await response.aread()
        await response.aclose()
        pending.mark("first_byte")  # Decode had the KV whole: Prefill owes nothing more
        await proxy._settle(owes, pending)
        if response.status_code >= 400:
            proxy.metrics.first_token.labels("failed").inc()
            proxy.finish(pending, response.status_code, f"Decode answered {response.status_code}")
            return Response(data, response.status_code, headers=headers, media_type="application/json")
        if first is None:
            proxy.finish(pending, 200)
            return Response(data, 200, headers=headers, media_type="application/json")
        try:
            answer = merged_body(first, read_json(data, "Decode"), body)
        except ValueError as exc:
            proxy.metrics.first_token.labels("failed").inc()
            proxy.finish(pending, 502, f"Decode: {exc}", kind="decode_failed")
            return error_answer(f"Decode: {exc}", 502, headers)
        _first_out(proxy, pending)  # one body: the first token reaches the client with the rest
        proxy.metrics.first_token.labels("continued").inc()
        proxy.finish(pending, 200)
        return JSONResponse(answer, headers=headers)
    except BaseException as exc:
        _ended_by(proxy, pending, exc)
        raise
    finally:
        await stop_legs(*legs)


async def _once(chunk: bytes) -> AsyncIterator[bytes]:
    yield chunk


async def _stream(proxy: Proxy, pending: Pending, request: tuple[str, dict[str, Any]], first: First | None,
                  body: dict[str, Any], legs: tuple[asyncio.Task[httpx.Response], asyncio.Task[None]],
                  ) -> AsyncIterator[bytes]:
    """A streamed request: the first token at once, then Decode's stream rewritten as the rest
    (``first`` None: Decode's stream as it is)."""
    owes = legs[1]  # Prefill's part: settled once Decode answered
    relayed = False  # once Decode's stream is relayed, relay() ends the request
    try:
        if first is not None:
            yield first_chunks(first, body, last=False)
            _first_out(proxy, pending)
        try:
            response = await _decode_answer(proxy, pending, request, legs)
        except EngineError as exc:
            proxy.metrics.first_token.labels("failed").inc()
            proxy.finish(pending, 502, str(exc), kind=exc.kind)
            yield error_event(str(exc), 502)
            return
        if response.status_code >= 400:
            try:
                data = await response.aread()
            except httpx.HTTPError as exc:  # its error body did not come whole (or does not decode): still its 4xx/5xx
                data = f"({type(exc).__name__}: {exc})".encode()
            finally:  # a recomputing Decode's answer is no leg: stop_legs would not close it
                await response.aclose()
            proxy.metrics.first_token.labels("failed").inc()
            proxy.finish(pending, response.status_code, f"Decode answered {response.status_code}")
            message = f"Decode answered {response.status_code}: {data[:300].decode(errors='replace')}"
            yield error_event(message, 502)
            return
        relayed = True
        rewriter = None if first is None else StreamRewriter(first)
        async with contextlib.aclosing(relay(proxy, response, owes, pending, request, rewriter)) as decodes:
            async for raw in decodes:  # closed with this stream (the client gone): Decode's stream closes at once
                yield raw
        if first is not None:  # counted once the relay ended it: a stream that failed on the way is no continued one
            proxy.metrics.first_token.labels("continued" if pending.record.get("status") == 200 else "failed").inc()
    finally:
        if not relayed:
            await stop_legs(*legs)
            if pending.rid in proxy.pending:  # the client went away before Decode answered
                proxy.finish(pending, 499, "the client went away", kind="cancelled")
