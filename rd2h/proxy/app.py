"""The proxy's state and request flow (FastAPI + httpx, async throughout); its routes are in
:mod:`rd2h.proxy.routes`.

Public (clients): ``POST /v1/completions`` and ``/v1/chat/completions`` (streaming passed
through), ``GET /v1/models`` (a Decode's), ``GET /health``. Internal (engines and
operators, its own listener): ``POST /v1/rd2h/rendezvous`` (the metaserver: only a body
signed with the secret the proxy shares with the engines is heard; 404 for an id it does
not wait for), ``GET /v1/rd2h/requests`` (the latest requests, only with ``Authorization:
Bearer <token>``, see :func:`rd2h.vllm.vouch.token`; each says when it passed each hop: ``t``,
ms from ``t_origin``, a time.monotonic() reading), ``GET /metrics`` (Prometheus),
``GET /health`` (every instance's state; 200 once a warm Prefill and Decode are in rotation,
see :mod:`rd2h.proxy.warmup`).

Both legs carry rd2h's fields signed (:mod:`rd2h.vllm.params`): one client request becomes
``prompts x samples`` Decode requests, each with an id of its own, of which sample 0 of each
prompt pulls (the others reuse its blocks from Decode's prefix cache), and ``prompts`` Prefill
requests of one sample each. The Prefill leg changes only what it must
(:func:`rd2h.proxy.bodies.prefill_body`). ``Authorization`` and ``X-Request-Id`` go to both
legs (an id is made when the client sent none) and the id comes back to the client.

Failures: a connect error is retried with exponential backoff on the next instance (the
failed one is out of rotation until its health check answers). Anything after that (the
engine died while holding the request, or answered an HTTP error) fails the client's
request at once with 502, and the Decode request is cancelled (closing its connection
makes vLLM abort it, and the connector releases its blocks); except where Decode's
rendezvous said its ``kv_load_failure_policy`` is ``recompute`` and Prefill failed before
Decode sent the client anything: then the proxy honours that policy itself, at once: the
client's request goes to a Decode engine again as a plain request, which computes its prompt
(logged, counted). A stream that fails after its headers ends with an error event in
OpenAI's error shape and no ``[DONE]``. A client that goes away (or a server that stops) while
the legs are out cancels them and ends the request once (499; :mod:`rd2h.proxy.abandon`).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import secrets
import time
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from rd2h.proxy.abandon import ClosingStream, abandon, never_ran
from rd2h.proxy.bodies import Refused, error_body, parse_body, prefill_body, read_limited, shape_of
from rd2h.proxy.early import all_heard, leg_unless_nothing, nothing_to_prefill, prefill_owes
from rd2h.proxy.failures import (
    EngineError,
    NoInstance,
    PrefillFailed,
    RendezvousTimeout,
    cancel,
    error_answer,
    refused,
    settle,
)  # fmt: skip
from rd2h.proxy.first_flow import first_token_answer
from rd2h.proxy.instances import Instance, Pool, gone_for_good
from rd2h.proxy.metrics import ProxyMetrics
from rd2h.proxy.models import ModelLengths, forwarded, models_answer
from rd2h.proxy.pending import Pending
from rd2h.proxy.readiness import note_readiness
from rd2h.proxy.relay import relay
from rd2h.proxy.warmup import PairTable, warm_up_pairs
from rd2h.vllm.params import MAX_WAIT, decode_fields, later_fields
from rd2h.vllm.vouch import VouchError, token, verify

__all__ = ["EngineError", "NoInstance", "PrefillFailed", "Proxy", "ProxyConfig", "RendezvousTimeout", "cancel"]

log = logging.getLogger("rd2h.proxy")

RENDEZVOUS_PATH = "/v1/rd2h/rendezvous"


@dataclass(frozen=True)
class ProxyConfig:
    prefill: Sequence[str]
    decode: Sequence[str]
    secret: bytes  # shared with the engines: signs both legs, authenticates the rendezvous
    rendezvous_timeout: float = 60.0  # Decode must post within this
    request_timeout: float = 600.0  # a whole engine call (reading its answer)
    connect_timeout: float = 5.0  # reaching an engine: a dead host fails over in seconds, not minutes
    retries: int = 3
    backoff: float = 0.2
    max_body_bytes: int = 16 << 20  # a client body past this is refused with 413 before it is parsed
    body_timeout: float = 10.0  # a client body must arrive within this (a slow body holds no task longer)
    health_interval: float = 2.0  # seconds between health checks of every instance (0: none, no warm-up)
    warmup: bool = True  # one P/D request through each pair before it is in rotation (rd2h.proxy.warmup)
    warmup_timeout: float = 120.0  # a warm-up request's bound
    # where Prefill fetches its targets (the internal listener's /v1/rd2h/targets as engines reach it): Prefill
    # gets the request at once, with Decode; None: only once every rendezvous is in (rd2h.proxy.early)
    targets_url: str | None = None
    first_token_url: str | None = None  # the targets URL, set: the client's first token is Prefill's (first_flow)

    @property
    def warms_up(self) -> bool:
        """Warm-up follows the health checks: without checks, instances are in rotation from the start."""
        return self.warmup and self.health_interval > 0


class Proxy:
    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.prefill_pool = Pool("prefill", config.prefill, warm_up=config.warms_up)
        self.decode_pool = Pool("decode", config.decode, warm_up=config.warms_up)
        self.warmth = PairTable(retry_after=config.health_interval)
        self.was_ready = False
        self.pending: dict[str, Pending] = {}
        self.recent: deque[dict[str, Any]] = deque(maxlen=256)
        self.recomputed = 0  # requests whose Prefill failed, served by a Decode computing the prompt
        self.model_lengths = ModelLengths()  # Decode's max_model_len per instance (rd2h.proxy.models)
        self.metrics = ProxyMetrics(lambda: (self.prefill_pool, self.decode_pool))
        self.metrics.ready.set_function(lambda: 1.0 if self.ready() else 0.0)
        self.client: httpx.AsyncClient | None = None
        self.draining = False
        self._checks: asyncio.Task[None] | None = None
        self._warming: asyncio.Task[None] | None = None

    # -- lifetime ------------------------------------------------------------------------

    async def start(self) -> None:
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=64)
        self.client = httpx.AsyncClient(limits=limits)
        if self.config.health_interval > 0:
            log.info("rd2h proxy: ready once a Prefill and a Decode answer /health%s", " and a warm-up request "
                     "went through them" if self.config.warms_up else "")
            self._checks = asyncio.create_task(self._check_forever())

    async def stop(self) -> None:
        for task in filter(None, (self._checks, self._warming)):
            await cancel(task)
        await self.model_lengths.stop()  # a Decode's listing asked for a request
        if self.client is not None:
            await self.client.aclose()
            self.client = None

    async def check_health(self) -> None:
        assert self.client is not None
        timeout = max(0.5, min(self.config.health_interval, 2.0))
        await asyncio.gather(*(pool.check(self.client, timeout) for pool in (self.prefill_pool, self.decode_pool)))

    async def _check_forever(self) -> None:
        while True:
            try:
                await self.check_health()
                note_readiness(self)
                if self.config.warms_up and (self._warming is None or self._warming.done()):
                    # apart from the checks: a slow warm-up must not delay taking a dead engine out
                    self._warming = asyncio.create_task(warm_up_pairs(self))
            except Exception:  # a check must never end the checking
                log.exception("health check failed")
            await asyncio.sleep(self.config.health_interval)  # a cadence, not synchronisation

    # -- engines -------------------------------------------------------------------------

    async def _send(self, pool: Pool, path: str, body: dict[str, Any], *, stream: bool, pending: Pending,
                    avoid: frozenset[str] = frozenset()) -> httpx.Response:
        """POST to the up instance with the fewest outstanding requests (not one in ``avoid``, while
        another may take it); a connect error takes it out of rotation and moves on (with backoff).
        A streamed answer stays outstanding on its instance until the request ends (:meth:`finish`)."""
        assert self.client is not None
        delay, tried = self.config.backoff, set(avoid)
        timeout = httpx.Timeout(self.config.request_timeout, connect=self.config.connect_timeout)
        for attempt in range(self.config.retries + 1):
            # up ones first; when every one is down or tried, still try (a restart is not seen yet)
            instance = (pending.pinned.get(pool.role) or pool.pick(tried) or pool.pick(tried, include_cold=True)
                        or pool.pick(tried, include_down=True) or pool.pick(include_down=True))
            assert instance is not None  # a pool has at least one instance
            tried.add(instance.url)
            url = instance.url + path
            request = self.client.build_request("POST", url, json=body, timeout=timeout, headers=pending.headers)
            instance.outstanding += 1
            pending.mark(f"{pool.role}_sent")
            try:
                response = await self.client.send(request, stream=stream)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                instance.outstanding -= 1
                pool.mark_down(instance, f"{type(exc).__name__}: {exc}", dead=gone_for_good(exc))
                log.warning("%s: %s (attempt %d)", url, exc, attempt + 1)
                if attempt == self.config.retries or pending.pinned:
                    error = NoInstance if not pool.any_up() else EngineError
                    raise error(f"{url}: {exc} (no {pool.role} instance took the request)") from exc
                await asyncio.sleep(delay)  # backoff between attempts, not synchronisation
                delay *= 2
                continue
            except httpx.TransportError as exc:  # it had the request: do not send it twice
                instance.outstanding -= 1
                pool.mark_down(instance, f"{type(exc).__name__} while it held a request", dead=gone_for_good(exc))
                raise EngineError(f"{url}: {type(exc).__name__}: {exc}") from exc
            except httpx.HTTPError as exc:  # e.g. a body its content-encoding does not decode: its failure, alive
                instance.outstanding -= 1
                raise EngineError(f"{url}: {type(exc).__name__}: {exc}") from exc
            except BaseException:  # cancelled: the request is no longer outstanding there
                instance.outstanding -= 1
                raise
            instance.served += not pending.warmup
            pending.answered_by[pool.role] = instance
            pending.mark(f"{pool.role}_answered")
            if stream:
                pending.streams.append(instance)
            else:
                instance.outstanding -= 1
            return response
        raise AssertionError("unreachable")

    async def prefill(self, pending: Pending, path: str, body: dict[str, Any]) -> None:
        """Send the request to Prefill once: at once, its targets to be fetched (``targets_url``),
        or once every child's rendezvous is in, its targets in its fields. Either way every
        rendezvous must come within ``rendezvous_timeout``."""
        if self.config.targets_url:
            fields = later_fields(self.config.secret, pending.rid, pending.prompts, self.config.targets_url,
                                  min(self.config.rendezvous_timeout, MAX_WAIT), time.time())  # fmt: skip
            try:
                await leg_unless_nothing(pending, self._prefill_leg(pending, path, body, fields))
            except asyncio.CancelledError:  # Decode answered (or the client left) while the leg was stopped
                if pending.nothing:
                    nothing_to_prefill(self, pending)
                raise
        # shielded (one turn of the loop more than awaited directly): this task cancelled (Decode failed)
        # must not cancel the future Prefill's ask waits on; finish() settles it, the ask gets 410
        await asyncio.shield(pending.all_in)
        if pending.nothing:  # Decode loads nothing of any prompt: Prefill has nothing to compute for it
            return nothing_to_prefill(self, pending)
        if self.config.targets_url:  # Prefill answered before its KV went: it owes it until Decode answers
            await prefill_owes(pending)
            return
        assert pending.targets is not None
        await self._prefill_leg(pending, path, body, pending.targets)

    async def _prefill_leg(self, pending: Pending, path: str, body: dict[str, Any], fields: dict[str, Any]) -> None:
        leg = prefill_body(body)
        leg["kv_transfer_params"] = {"do_remote_decode": True, "rd2h": fields}
        try:
            response = await self.send_prefill(pending, path, leg)
        except EngineError as exc:
            raise PrefillFailed(str(exc)) from exc
        if response.status_code >= 400:
            raise PrefillFailed(f"Prefill answered {response.status_code}: {response.text[:300]}")

    async def send_prefill(self, pending: Pending, path: str, leg: dict[str, Any]) -> httpx.Response:
        """Prefill's answer to its leg (read whole), its time observed: rd2h_proxy_prefill_seconds, ``prefill_ms``."""
        sent = time.monotonic()
        response = await self._send(self.prefill_pool, path, leg, stream=False, pending=pending)
        pending.prefill_answered = time.monotonic()
        self.metrics.prefill.observe(pending.prefill_answered - sent)
        pending.record["prefill_ms"] = round((pending.prefill_answered - sent) * 1e3, 1)
        return response

    async def recompute(self, pending: Pending, path: str, body: dict[str, Any], error: Exception) -> httpx.Response:
        """Prefill failed and Decode's policy is ``recompute``: Decode computes the prompt."""
        log.warning("request %s: Prefill failed (%s); a Decode computes the prompt (kv_load_failure_policy "
                    "recompute; %d so far)", pending.rid, error, self.recomputed + 1)
        self.recomputed += 1
        self.metrics.recomputed.inc()
        pending.record["recomputed"] = str(error)
        plain = {k: v for k, v in body.items() if k != "kv_transfer_params"}  # a client's own steer nothing
        return await self._send(self.decode_pool, path, plain, stream=bool(body.get("stream")), pending=pending)

    # -- requests ------------------------------------------------------------------------

    async def handle(self, request: Request, path: str) -> Response:
        arrived = time.monotonic()
        headers = forwarded(request)
        headers.setdefault("x-request-id", uuid.uuid4().hex)
        answer_headers = {"x-request-id": headers["x-request-id"]}
        try:
            if self.draining:
                raise Refused("the proxy is shutting down: send the request again", status=503)
            body = parse_body(await read_limited(request, self.config.max_body_bytes, self.config.body_timeout))
            prompts, samples = shape_of(body, path)
        except Refused as exc:
            self.metrics.requests.labels(path, str(exc.status)).inc()
            self.metrics.errors.labels("draining" if exc.status == 503 else "refused").inc()
            kind = "invalid_request_error" if exc.status < 500 else "rd2h_proxy_unavailable"
            return JSONResponse(error_body(str(exc), kind, exc.status), exc.status, headers=answer_headers)
        if self.config.first_token_url and (first := await first_token_answer(self, path, body, headers, arrived)):
            return first  # a Response; None: the normal flow (counted by reason)
        pending, prefill, decode = self.begin(path, body, (prompts, samples), headers, arrived=arrived)
        response: httpx.Response | None = None
        try:
            try:
                try:
                    response = await self.first_answer(decode, prefill)
                except PrefillFailed as exc:
                    if not pending.recompute:
                        raise
                    response = await self.recompute(pending, path, body, exc)
            except EngineError as exc:
                self.finish(pending, exc.status, str(exc), kind=exc.kind)
                return error_answer(str(exc), exc.status, answer_headers)
            answer_headers["content-type"] = response.headers.get("content-type", "application/json")
            if not body.get("stream"):
                data = await response.aread()
                await response.aclose()
                self._first_byte(pending)
                await self._settle(prefill, pending)
                self.finish(pending, response.status_code)
                return Response(data, status_code=response.status_code, headers=answer_headers)
        except BaseException as exc:  # the client went away (or the server stops) while the legs were out
            await abandon(self, pending, exc, decode, prefill, response=response)  # a recomputing Decode's: no leg
            raise
        return ClosingStream(relay(self, response, prefill, pending, (path, body)), status_code=response.status_code,
                             headers=answer_headers, on_close=never_ran(self, pending, decode, prefill,
                                                                        response=response))  # fmt: skip

    def begin(self, path: str, body: dict[str, Any], shape: tuple[int, int], headers: dict[str, str], *,
               pinned: dict[str, Instance] | None = None, arrived: float | None = None,
               ) -> tuple[Pending, asyncio.Task[None], asyncio.Task[httpx.Response]]:
        """Both legs of a request under way: Decode's now, Prefill's once every rendezvous is in."""
        prompts, samples = shape
        pending = self.open(path, prompts, headers, pinned=pinned, arrived=arrived)
        decode_body = {**body, "kv_transfer_params": {"do_remote_prefill": True, "rd2h": decode_fields(
            self.config.secret, pending.rid, prompts, samples, time.time())}}  # fmt: skip
        prefill = asyncio.create_task(self.prefill(pending, path, body))
        decode = asyncio.create_task(
            self._send(self.decode_pool, path, decode_body, stream=bool(body.get("stream")), pending=pending)
        )
        return pending, prefill, decode

    def open(self, path: str, prompts: int, headers: dict[str, str], *, pinned: dict[str, Instance] | None = None,
             arrived: float | None = None) -> Pending:
        """A request's state, known (its rendezvous are heard) until finish(), its ``rendezvous_timeout`` armed."""
        rid = secrets.token_hex(16)  # unguessable: it names the request on both engines
        loop = asyncio.get_running_loop()
        record: dict[str, Any] = {"id": rid, "path": path, "x_request_id": headers["x-request-id"]}
        if pinned:
            record["warmup"] = True
        pending = Pending(rid, prompts, [loop.create_future() for _ in range(prompts)], loop.create_future(), headers,
                           record=record, pinned=dict(pinned or {}), warmup=bool(pinned))  # fmt: skip
        pending.started = record["t_origin"] = time.monotonic() if arrived is None else arrived  # monotonic s
        pending.mark("begun")
        self.pending[rid] = pending
        self.recent.append(record)
        late = RendezvousTimeout(f"Decode did not post a rendezvous within {self.config.rendezvous_timeout:g} s")
        timer = loop.call_later(self.config.rendezvous_timeout, settle, pending.all_in, late)
        pending.all_in.add_done_callback(lambda _: timer.cancel())  # all heard, timed out or finish()ed
        return pending

    def ready(self) -> bool:  # serving: not draining, and a Prefill and a Decode in rotation (up and warm)
        return not self.draining and self.prefill_pool.any_in_rotation() and self.decode_pool.any_in_rotation()

    async def first_answer(self, decode: asyncio.Task[httpx.Response], prefill: asyncio.Task[None]) -> httpx.Response:
        """Decode's response (headers), unless Prefill failed first: then Decode is cancelled."""
        done, _ = await asyncio.wait({decode, prefill}, return_when=asyncio.FIRST_COMPLETED)
        if prefill in done and prefill.exception() is not None:
            await cancel(decode)
            failed = prefill.exception()
            raise failed if isinstance(failed, EngineError) else EngineError(str(failed))
        try:
            response = await decode
        except EngineError:
            await cancel(prefill)
            raise
        if response.status_code >= 400:  # Decode refused it: Prefill has nothing to do
            await cancel(prefill)
        return response

    async def _settle(self, prefill: asyncio.Task[None], pending: Pending) -> None:
        """Decode answered: Prefill's part has served its purpose; do not leave it running."""
        if not prefill.done():
            await cancel(prefill)
        elif not prefill.cancelled() and prefill.exception() is not None and "recomputed" not in pending.record:
            log.warning("Prefill failed after Decode answered: %s", prefill.exception())

    def _first_byte(self, pending: Pending) -> None:
        pending.mark("first_byte")
        if pending.warmup:
            return
        now = time.monotonic()
        self.metrics.ttft.observe(now - pending.started)
        if pending.prefill_answered is not None:
            self.metrics.decode.observe(now - pending.prefill_answered)

    def finish(self, pending: Pending, status: int, error: str = "", *, kind: str = "") -> None:
        self.pending.pop(pending.rid, None)  # a late rendezvous now gets 404
        if not pending.all_in.done():  # a Prefill waiting for targets hears that none come
            settle(pending.all_in, EngineError(f"the request ended ({status}) before every rendezvous was in"))
            pending.all_in.exception()  # retrieved: nobody else may await it
        for instance in pending.streams:
            instance.outstanding -= 1
        pending.streams.clear()
        pending.mark("end")
        pending.record.update(status=status, total_ms=round((time.monotonic() - pending.started) * 1e3, 1))
        if error:
            pending.record["error"] = error
        if not pending.warmup:  # a warm-up is counted as one (rd2h_proxy_warmups_total)
            self.metrics.requests.labels(pending.record["path"], str(status)).inc()
            if error:
                self.metrics.errors.labels(kind or "engine_failed").inc()
        log.info("rd2h proxy %s", json.dumps(pending.record, sort_keys=True))

    # -- metaserver ----------------------------------------------------------------------

    def rendezvous(self, body: dict[str, Any]) -> Response:
        """A Decode's rendezvous, heard only when signed with the shared secret."""
        try:
            fields = verify(self.config.secret, body, time.time())
            rid, prompt, sample = str(fields["ext_id"]).rsplit("-", 2)
            prompt_idx, sample_idx = int(prompt), int(sample)
            if "nothing" not in fields:  # a prompt Decode loads nothing of names no endpoint (rd2h.vllm.nothing)
                str(fields["endpoint"])
            elif not isinstance(fields["nothing"], str):
                raise ValueError(f"'nothing' must name a reason, got {fields['nothing']!r}")
        except (VouchError, KeyError, ValueError) as exc:
            return refused(self.metrics, "rendezvous", exc)
        pending = self.pending.get(rid)
        if pending is None:
            return JSONResponse({"error": "no request waits for this rendezvous"}, status_code=404)
        if not (0 <= prompt_idx < pending.prompts and sample_idx == 0):
            return JSONResponse({"error": "a rendezvous for a child the request does not have"}, status_code=400)
        future = pending.futures[prompt_idx]
        pending.mark(f"rendezvous_{prompt_idx}")
        if not future.done():
            future.set_result(fields)
            pending.heard += 1
            if pending.heard == pending.prompts and not pending.all_in.done():
                all_heard(self, pending)
        return JSONResponse({"ok": True})

    def may_read_requests(self, request: Request) -> bool:
        """The request list names in-flight ids: only for holders of the operator token."""
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        return hmac.compare_digest(given, token(self.config.secret, "requests"))

    async def models(self, request: Request) -> Response:
        """A Decode's model list (both kinds serve the same model): :func:`rd2h.proxy.models.models_answer`."""
        return await models_answer(self, request)

