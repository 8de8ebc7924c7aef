"""The proxy's routes: the public app (clients) and the internal app (engines' rendezvous,
operators' request list and metrics) over one :class:`~rd2h.proxy.app.Proxy`."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from rd2h.proxy.app import RENDEZVOUS_PATH, Proxy, ProxyConfig
from rd2h.proxy.bodies import Refused, parse_body, read_limited
from rd2h.proxy.early import TARGETS_PATH, answer_targets
from rd2h.proxy.metrics import CONTENT_TYPE
from rd2h.proxy.readiness import health_body

__all__ = ["create_apps"]


async def _engine_body(request: Request) -> Any:
    """An engine's post (a rendezvous, an ask for targets): its JSON body, or the answer refusing it."""
    try:
        return parse_body(await read_limited(request, 64 << 10))
    except Refused as exc:
        return JSONResponse({"error": str(exc)}, status_code=exc.status)


def create_apps(config: ProxyConfig) -> tuple[FastAPI, FastAPI]:
    """``(public, internal)`` ASGI apps over one proxy; the public app's lifespan starts and
    stops the shared HTTP client and the health checks."""
    proxy = Proxy(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await proxy.start()
        try:
            yield
        finally:
            await proxy.stop()

    public = FastAPI(title="rd2h proxy", lifespan=lifespan)
    internal = FastAPI(title="rd2h proxy (internal)")
    public.state.proxy = internal.state.proxy = proxy

    @public.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy.handle(request, "/v1/completions")

    @public.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await proxy.handle(request, "/v1/chat/completions")

    @public.get("/v1/models")
    async def models(request: Request) -> Response:
        return await proxy.models(request)

    @public.get("/health")
    @internal.get("/health")
    async def health() -> Response:
        body = health_body(proxy)
        return JSONResponse(body, status_code=200 if body["ready"] else 503)

    @internal.post(RENDEZVOUS_PATH)
    async def rendezvous(request: Request) -> Response:
        body = await _engine_body(request)
        return body if isinstance(body, Response) else proxy.rendezvous(body)

    @internal.post(TARGETS_PATH)
    async def targets(request: Request) -> Response:
        body = await _engine_body(request)
        return body if isinstance(body, Response) else await answer_targets(proxy, body)

    @internal.get("/v1/rd2h/requests")
    async def requests(request: Request) -> Response:
        if not proxy.may_read_requests(request):
            return JSONResponse({"error": "needs Authorization: Bearer <rd2h operator token>"}, status_code=401)
        return JSONResponse(list(proxy.recent))

    @internal.get("/metrics")
    async def metrics() -> Response:
        return Response(proxy.metrics.scrape(), media_type=CONTENT_TYPE)

    return public, internal
