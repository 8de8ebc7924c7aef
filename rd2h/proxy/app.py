"""The proxy's ASGI app (FastAPI + httpx, async throughout).

Routes: ``POST /v1/completions`` and ``/v1/chat/completions`` (streaming passed through),
``POST /v1/rd2h/rendezvous`` (the metaserver: only a body signed with the secret the proxy
shares with the engines is heard; 404 for an id it does not wait for),
``GET /v1/rd2h/requests`` (the latest requests with their rendezvous, for operators and
tests: only with ``Authorization: Bearer <token>``, see :func:`rd2h.vllm.vouch.token`),
``GET /health``.

Both legs carry rd2h's fields signed (:mod:`rd2h.vllm.params`): one client request becomes
``prompts x samples`` Decode requests, each with an id of its own, of which sample 0 of each
prompt pulls (the others reuse its blocks from Decode's prefix cache), and ``prompts`` Prefill
requests of one sample each. The Prefill
leg changes only what it must: one token, one sample, no streaming, no ``min_tokens``.
Parameters rd2h cannot serve are refused with 400 and a message naming them.

Failures: a transport error before a request reached an engine (connect errors) is
retried with exponential backoff, on the next instance of that kind. Anything after that
(the engine died while holding the request, or answered an HTTP error) fails the client's
request at once with 502, and the Decode request is cancelled (closing its connection
makes vLLM abort it, and the connector releases its blocks); except where Decode's
rendezvous said its ``kv_load_failure_policy`` is ``recompute`` and Prefill failed before
Decode sent the client anything: then the proxy honours that policy itself, at once: the
client's request goes to a Decode engine again as a plain request, which computes its prompt
(logged, counted in ``/health``'s ``recomputed``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import json
import logging
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from rd2h.vllm.params import MAX_CHILDREN, decode_fields, prefill_fields
from rd2h.vllm.vouch import VouchError, token, verify

__all__ = ["ProxyConfig", "children_of", "create_app", "prefill_body", "shape_of"]

log = logging.getLogger("rd2h.proxy")

RENDEZVOUS_PATH = "/v1/rd2h/rendezvous"


@dataclass(frozen=True)
class ProxyConfig:
    prefill: Sequence[str]
    decode: Sequence[str]
    secret: bytes  # shared with the engines: signs both legs, authenticates the rendezvous
    rendezvous_timeout: float = 60.0  # Decode must post within this
    request_timeout: float = 600.0  # whole request, per engine call
    retries: int = 3
    backoff: float = 0.2


class EngineError(Exception):
    """An engine failed a request (transport error after it was sent, or HTTP error)."""


class PrefillFailed(EngineError):
    """Prefill failed a request after the rendezvous was handed to it: Decode may recompute."""


def children_of(body: dict[str, Any], path: str) -> int:
    """How many engine requests vLLM makes of this body: one per prompt of a prompt list."""
    if path.endswith("chat/completions"):
        return 1
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return len(prompt)
    return 1


class Refused(ValueError):
    """A client request rd2h cannot serve as asked: answered 400 with this message."""


def shape_of(body: dict[str, Any], path: str) -> tuple[int, int]:
    """``(prompts, samples)`` of a client request; Refused for what rd2h cannot serve."""
    prompts = children_of(body, path)
    samples = body.get("n", 1)
    if samples is None:
        samples = 1
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise Refused(f"n must be an integer >= 1, got {samples!r}")
    if prompts * samples > MAX_CHILDREN:
        raise Refused(f"{prompts} prompts x n={samples} is more than the {MAX_CHILDREN} requests one call may make")
    if body.get("prompt_logprobs") is not None or (body.get("echo") and body.get("logprobs") is not None):
        raise Refused(
            "prompt_logprobs (and echo with logprobs) need the prompt computed by the engine that answers; "
            "with rd2h the Decode engine loads it: ask an engine directly for those"
        )
    return prompts, samples


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The Prefill leg: the client's request with what must change for one prefill."""
    leg = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "n", "best_of", "min_tokens")}
    leg.update(max_tokens=1, stream=False)
    if "max_completion_tokens" in body:
        leg["max_completion_tokens"] = 1
    return leg


@dataclass
class _Pending:
    rid: str
    prompts: int
    futures: list[asyncio.Future[dict[str, Any]]]  # one per prompt: its sample 0 pulls
    record: dict[str, Any] = field(default_factory=dict)
    recompute: bool = False  # every Decode that posted recomputes a failed load (its policy)


class _Proxy:
    def __init__(self, config: ProxyConfig) -> None:
        if not config.prefill or not config.decode:
            raise ValueError("the proxy needs at least one Prefill and one Decode URL")
        self.config = config
        self._prefill = itertools.cycle([u.rstrip("/") for u in config.prefill])
        self._decode = itertools.cycle([u.rstrip("/") for u in config.decode])
        self.pending: dict[str, _Pending] = {}
        self.recent: deque[dict[str, Any]] = deque(maxlen=256)
        self.recomputed = 0  # requests whose Prefill failed, served by a Decode computing the prompt
        self.client: httpx.AsyncClient | None = None

    # -- engines -------------------------------------------------------------------------

    async def _send(self, urls: itertools.cycle, path: str, body: dict[str, Any], stream: bool) -> httpx.Response:
        """POST to the next instance; connect errors move on to the next, with backoff."""
        assert self.client is not None
        delay = self.config.backoff
        for attempt in range(self.config.retries + 1):
            url = next(urls) + path
            request = self.client.build_request("POST", url, json=body, timeout=self.config.request_timeout)
            try:
                return await self.client.send(request, stream=stream)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                log.warning("%s: %s (attempt %d)", url, exc, attempt + 1)
                if attempt == self.config.retries:
                    raise EngineError(f"{url}: {exc}") from exc
                await asyncio.sleep(delay)  # backoff between attempts, not synchronisation
                delay *= 2
            except httpx.TransportError as exc:  # it had the request: do not send it twice
                raise EngineError(f"{url}: {type(exc).__name__}: {exc}") from exc
        raise AssertionError("unreachable")

    async def prefill(self, pending: _Pending, path: str, body: dict[str, Any]) -> None:
        """Wait for every child's rendezvous, then send the request to Prefill once."""
        started = time.monotonic()
        try:
            found = await asyncio.wait_for(asyncio.gather(*pending.futures), self.config.rendezvous_timeout)
        except asyncio.TimeoutError:
            raise EngineError(f"Decode did not post a rendezvous within {self.config.rendezvous_timeout:g} s") from None
        pending.record["rendezvous_ms"] = round((time.monotonic() - started) * 1e3, 1)
        pending.record["children"] = [
            {k: r.get(k) for k in ("endpoint", "first_block", "num_tokens")} for r in found
        ]
        targets = {p: [found[p]] for p in range(pending.prompts)}
        pending.recompute = all(r.get("on_load_failure") == "recompute" for r in found)
        leg = prefill_body(body)
        leg["kv_transfer_params"] = {
            "do_remote_decode": True,
            "rd2h": prefill_fields(self.config.secret, pending.rid, pending.prompts, 1, targets, time.time()),
        }
        sent = time.monotonic()
        try:
            response = await self._send(self._prefill, path, leg, stream=False)
        except EngineError as exc:
            raise PrefillFailed(str(exc)) from exc
        pending.record["prefill_ms"] = round((time.monotonic() - sent) * 1e3, 1)
        if response.status_code >= 400:
            raise PrefillFailed(f"Prefill answered {response.status_code}: {response.text[:300]}")

    async def recompute(self, pending: _Pending, path: str, body: dict[str, Any], error: Exception) -> httpx.Response:
        """Prefill failed and Decode's policy is ``recompute``: Decode computes the prompt."""
        log.warning("request %s: Prefill failed (%s); a Decode computes the prompt (kv_load_failure_policy "
                    "recompute; %d so far)", pending.rid, error, self.recomputed + 1)
        self.recomputed += 1
        pending.record["recomputed"] = str(error)
        return await self._send(self._decode, path, body, stream=bool(body.get("stream")))

    # -- requests ------------------------------------------------------------------------

    async def handle(self, request: Request, path: str) -> Response:
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return JSONResponse({"error": {"message": "the body is not JSON"}}, status_code=400)
        if not isinstance(body, dict):
            return JSONResponse({"error": {"message": "the body must be a JSON object"}}, status_code=400)
        try:
            prompts, samples = shape_of(body, path)
        except Refused as exc:
            return JSONResponse({"error": {"message": str(exc), "type": "invalid_request_error"}}, status_code=400)
        rid = secrets.token_hex(16)  # unguessable: it names the request on both engines
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in range(prompts)]
        pending = _Pending(rid, prompts, futures, {"id": rid, "path": path})
        self.pending[rid] = pending
        self.recent.append(pending.record)
        started = time.monotonic()
        decode_body = dict(body)
        decode_body["kv_transfer_params"] = {
            "do_remote_prefill": True, "rd2h": decode_fields(self.config.secret, rid, prompts, samples, time.time()),
        }
        stream = bool(body.get("stream"))
        prefill = asyncio.create_task(self.prefill(pending, path, body))
        decode = asyncio.create_task(self._send(self._decode, path, decode_body, stream=stream))
        try:
            try:
                response = await self._first(decode, prefill)
            except PrefillFailed as exc:
                if not pending.recompute:
                    raise
                response = await self.recompute(pending, path, body, exc)
        except EngineError as exc:
            self._finish(pending, started, 502, str(exc))
            return JSONResponse({"error": {"message": str(exc), "type": "rd2h_proxy_error"}}, status_code=502)
        if not stream:
            data = await response.aread()
            await response.aclose()
            await self._settle(prefill, pending)
            self._finish(pending, started, response.status_code)
            return Response(data, status_code=response.status_code, media_type=response.headers.get("content-type"))
        return StreamingResponse(
            self._relay(response, prefill, pending, started, (path, body)), status_code=response.status_code,
            media_type=response.headers.get("content-type", "text/event-stream"),
        )

    async def _first(self, decode: asyncio.Task[httpx.Response], prefill: asyncio.Task[None]) -> httpx.Response:
        """Decode's response (headers), unless Prefill failed first: then Decode is cancelled."""
        done, _ = await asyncio.wait({decode, prefill}, return_when=asyncio.FIRST_COMPLETED)
        if prefill in done and prefill.exception() is not None:
            await _cancel(decode)
            failed = prefill.exception()
            raise failed if isinstance(failed, EngineError) else EngineError(str(failed))
        try:
            response = await decode
        except EngineError:
            await _cancel(prefill)
            raise
        if response.status_code >= 400:  # Decode refused it: Prefill has nothing to do
            await _cancel(prefill)
        return response

    async def _settle(self, prefill: asyncio.Task[None], pending: _Pending) -> None:
        """Decode answered: Prefill's part has served its purpose; do not leave it running."""
        if not prefill.done():
            await _cancel(prefill)
        elif not prefill.cancelled() and prefill.exception() is not None and "recomputed" not in pending.record:
            log.warning("Prefill failed after Decode answered: %s", prefill.exception())

    async def _relay(
        self, response: httpx.Response, prefill: asyncio.Task[None], pending: _Pending, started: float,
        request: tuple[str, dict[str, Any]],
    ) -> AsyncIterator[bytes]:
        """Decode's stream. Until its first chunk, a Prefill failure ends it with an error event
        (or, under Decode's ``recompute`` policy, switches to a Decode computing the prompt);
        after it, Decode had its KV whole (it emits nothing before) and Prefill no longer matters."""
        chunks = response.aiter_raw()
        status = response.status_code
        relayed = False
        try:
            while True:
                next_chunk = asyncio.ensure_future(chunks.__anext__())
                if not relayed:
                    await asyncio.wait({next_chunk, prefill}, return_when=asyncio.FIRST_COMPLETED)
                failed = not relayed and _failure(prefill)
                if failed:
                    await _cancel(next_chunk)
                    if isinstance(failed, PrefillFailed) and pending.recompute:
                        await response.aclose()
                        try:
                            response = await self.recompute(pending, *request, failed)
                        except EngineError as exc:
                            failed = exc
                        else:
                            chunks, status, relayed = response.aiter_raw(), response.status_code, True
                            continue
                    status = 502
                    error = {"error": {"message": str(failed), "type": "rd2h_proxy_error"}}
                    yield f"data: {json.dumps(error)}\n\n".encode()
                    return
                try:
                    chunk = await next_chunk
                except StopAsyncIteration:
                    return
                relayed = relayed or bool(chunk)
                yield chunk
        finally:
            await response.aclose()
            await self._settle(prefill, pending)
            self._finish(pending, started, status)

    def _finish(self, pending: _Pending, started: float, status: int, error: str = "") -> None:
        self.pending.pop(pending.rid, None)  # a late rendezvous now gets 404
        pending.record.update(status=status, total_ms=round((time.monotonic() - started) * 1e3, 1))
        if error:
            pending.record["error"] = error
        log.info("rd2h proxy %s", json.dumps(pending.record, sort_keys=True))

    # -- metaserver ----------------------------------------------------------------------

    def rendezvous(self, body: dict[str, Any]) -> Response:
        """A Decode's rendezvous, heard only when signed with the shared secret."""
        try:
            fields = verify(self.config.secret, body, time.time())
            rid, prompt, sample = str(fields["ext_id"]).rsplit("-", 2)
            prompt_idx, sample_idx = int(prompt), int(sample)
            str(fields["endpoint"])
        except (VouchError, KeyError, ValueError) as exc:
            log.warning("refused a rendezvous: %s", exc)
            return JSONResponse({"error": f"rendezvous refused: {exc}"}, status_code=403)
        pending = self.pending.get(rid)
        if pending is None:
            return JSONResponse({"error": "no request waits for this rendezvous"}, status_code=404)
        if not (0 <= prompt_idx < pending.prompts and sample_idx == 0):
            return JSONResponse({"error": "a rendezvous for a child the request does not have"}, status_code=400)
        future = pending.futures[prompt_idx]
        if not future.done():
            future.set_result(fields)
        return JSONResponse({"ok": True})

    def may_read_requests(self, request: Request) -> bool:
        """The request list names in-flight ids: only for holders of the operator token."""
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        return hmac.compare_digest(given, token(self.config.secret, "requests"))


def _failure(task: asyncio.Future[Any]) -> BaseException | None:
    """The exception a finished task ended with (None while it runs, or if cancelled)."""
    if not task.done() or task.cancelled():
        return None
    return task.exception()


async def _cancel(task: asyncio.Future[Any]) -> None:
    task.cancel()
    with contextlib.suppress(BaseException):
        result = await task
        if isinstance(result, httpx.Response):
            await result.aclose()


def create_app(config: ProxyConfig) -> FastAPI:
    """The proxy as an ASGI app; its HTTP client lives as long as the app runs."""
    proxy = _Proxy(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=64)
        async with httpx.AsyncClient(limits=limits) as client:
            proxy.client = client
            yield
        proxy.client = None

    app = FastAPI(title="rd2h proxy", lifespan=lifespan)
    app.state.proxy = proxy

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy.handle(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await proxy.handle(request, "/v1/chat/completions")

    @app.post(RENDEZVOUS_PATH)
    async def rendezvous(request: Request) -> Response:
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return JSONResponse({"error": "the body is not JSON"}, status_code=400)
        if not isinstance(body, dict):
            return JSONResponse({"error": "the body must be a JSON object"}, status_code=400)
        return proxy.rendezvous(body)

    @app.get("/v1/rd2h/requests")
    async def requests(request: Request) -> Response:
        if not proxy.may_read_requests(request):
            return JSONResponse({"error": "needs Authorization: Bearer <rd2h operator token>"}, status_code=401)
        return JSONResponse(list(proxy.recent))

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "pending": len(proxy.pending), "recomputed": proxy.recomputed}

    return app
