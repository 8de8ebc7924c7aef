"""Prefill at once (``ProxyConfig.targets_url``): Prefill answers its leg before its KV reached
Decode, so a Prefill that dies then is seen only by the proxy (Decode learns of a Prefill from its
first announcement). The proxy's Prefill part of the request waits for the instance that
answered the leg to go down (rd2h.proxy.early.prefill_owes) and fails the request as a failed
leg does, instead of leaving Decode waiting for its ``request_timeout``. The engines are
test_proxy's; the health check is run by the test (no timer), on a Prefill that stopped answering."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from test_proxy import Engines, run

URL = "http://proxy/internal/v1/rd2h/targets"
BOUND = 30.0  # a hang's bound (the request waits for the test's events, never for time)


def prefill_stops_answering(engines: Engines, error: Exception | None = None) -> None:
    """From now on nothing reaches Prefill: connections to it are refused (killed), or ``error``."""
    async def handle(request: httpx.Request) -> httpx.Response:
        if request.url.host == "prefill":
            raise error or httpx.ConnectError("connection refused")
        return await engines(request)

    engines.public_proxy.client = httpx.AsyncClient(transport=httpx.MockTransport(handle))


async def answered_then_killed(client: httpx.AsyncClient, engines: Engines, body: dict[str, Any],
                               request: asyncio.Task[httpx.Response] | None = None) -> httpx.Response:
    engines.decode_hangs = True  # posts its rendezvous, then waits for a KV that never comes
    request = request or asyncio.create_task(client.post("/v1/completions", json=body))
    await asyncio.wait_for(engines.prefilled.wait(), BOUND)  # Prefill answered its leg
    proxy = engines.public_proxy
    for _ in range(100_000):  # turns of the loop, no clock: Decode's rendezvous is posted by a task
        if "rendezvous_all" in next(iter(proxy.pending.values())).record.get("t", {}):
            break
        await asyncio.sleep(0)
    prefill_stops_answering(engines)
    await proxy.check_health()  # the next health check finds it down
    return await asyncio.wait_for(request, BOUND)


def test_a_prefill_gone_after_its_leg_answered_fails_the_request_at_once() -> None:
    async def scenario(client: httpx.AsyncClient, engines: Engines) -> None:
        response = await answered_then_killed(client, engines, {"model": "m", "prompt": "a"})
        assert response.status_code == 502, response.text
        assert "went down before Decode had the request's KV" in response.text
        health = (await client.get("/health")).json()
        assert health["pending"] == 0 and health["prefill_at_once"] is True  # tests tell the flows apart by it
        assert engines.decode_bodies[0]["kv_transfer_params"]["do_remote_prefill"]

    run(scenario, targets_url=URL)


def test_under_decodes_recompute_policy_a_decode_computes_the_prompt() -> None:
    async def scenario(client: httpx.AsyncClient, engines: Engines) -> None:
        response = await answered_then_killed(client, engines, {"model": "m", "prompt": "a"})
        assert response.status_code == 200 and response.json()["choices"][0]["text"] == "computed"
        assert "kv_transfer_params" not in engines.decode_bodies[-1]  # the plain request: computed there
        health = (await client.get("/health")).json()
        assert health["recomputed"] == 1 and health["pending"] == 0

    run(scenario, targets_url=URL, policy="recompute")


def test_a_streamed_request_gets_an_error_event() -> None:
    async def scenario(client: httpx.AsyncClient, engines: Engines) -> None:
        response = await answered_then_killed(client, engines, {"model": "m", "prompt": "a", "stream": True})
        assert response.status_code == 502 or "rd2h_proxy_error" in response.text, response.text

    run(scenario, targets_url=URL)


def test_health_says_the_sequential_flow_is_not_at_once() -> None:
    async def scenario(client: httpx.AsyncClient, engines: Engines) -> None:
        assert (await client.get("/health")).json()["prefill_at_once"] is False

    run(scenario)


def test_a_health_check_that_times_out_fails_nothing_in_flight() -> None:
    """A live Prefill on a loaded machine may answer its health check late: out of rotation,
    but the requests it owes go on; refused afterwards (killed), they fail."""
    async def scenario(client: httpx.AsyncClient, engines: Engines) -> None:
        engines.decode_hangs = True
        request = asyncio.create_task(client.post("/v1/completions", json={"model": "m", "prompt": "a"}))
        await asyncio.wait_for(engines.prefilled.wait(), BOUND)
        prefill_stops_answering(engines, httpx.ReadTimeout("timed out"))
        await engines.public_proxy.check_health()
        health = (await client.get("/health")).json()
        assert not health["prefill"][0]["up"] and health["pending"] == 1 and not request.done()
        response = await answered_then_killed(client, engines, {}, request)
        assert response.status_code == 502 and "ConnectError" in response.text, response.text

    run(scenario, targets_url=URL)
