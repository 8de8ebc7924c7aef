"""A client that goes away (or a server that stops) while the proxy's normal flow has its legs out:
the legs are cancelled (vLLM aborts a request whose connection closes), the request ends once
(499, counted ``cancelled``), nothing stays pending, and Prefill's ask for targets (Prefill at
once) gets 410. A stream the server never started, or closed mid-way, ends the same. The engines
are test_proxy's; the server's side of a stream is Starlette's own, driven by the test."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import httpx
import pytest
from starlette.requests import ClientDisconnect, Request
from test_proxy import OPERATOR, Engines, run
from test_proxy_early import ask_for_targets

URL = "http://proxy/internal/v1/rd2h/targets"
BOUND = 30.0  # a hang's bound (the test waits for events, never for time)


def watched(engines: Engines) -> list[str]:
    """The engines, each request whose handler is cancelled (its connection closed) recorded by host."""
    cancelled: list[str] = []

    async def handle(request: httpx.Request) -> httpx.Response:
        try:
            return await engines(request)
        except asyncio.CancelledError:
            cancelled.append(request.url.host)
            raise

    engines.public_proxy.client = httpx.AsyncClient(transport=httpx.MockTransport(handle))
    return cancelled


async def assert_gone(client: httpx.AsyncClient, engines: Engines) -> None:
    """Ended once as the client gone, nothing pending or outstanding."""
    proxy = engines.public_proxy
    assert (await client.get("/health")).json()["pending"] == 0 and proxy.pending == {}
    record = (await client.get("/v1/rd2h/requests", headers=OPERATOR)).json()[-1]
    assert record["status"] == 499 and record["error"] == "the client went away"
    scrape = (await client.get("/metrics")).text
    assert 'rd2h_proxy_errors_total{kind="cancelled"} 1.0' in scrape
    assert all(i.outstanding == 0 for pool in (proxy.prefill_pool, proxy.decode_pool) for i in pool.instances)


def test_a_client_gone_while_decode_holds_the_request_cancels_it_and_ends_the_request() -> None:
    async def scenario(client: httpx.AsyncClient, engines: Engines) -> None:
        cancelled = watched(engines)
        engines.decode_hangs = True  # posts its rendezvous, then holds the request
        request = asyncio.create_task(client.post("/v1/completions", json={"model": "m", "prompt": "a"}))
        await asyncio.wait_for(engines.prefilled.wait(), BOUND)  # Prefill had its leg (after the rendezvous)
        request.cancel()  # the client went away (the server cancels its handler)
        with pytest.raises(asyncio.CancelledError):
            await request
        assert cancelled == ["decode"]  # its connection closed: vLLM aborts it, the connector frees its blocks
        await assert_gone(client, engines)

    run(scenario)


def test_a_client_gone_before_every_rendezvous_tells_prefill_at_once_no_targets_come() -> None:
    async def scenario(client: httpx.AsyncClient, engines: Engines) -> None:
        cancelled = watched(engines)
        engines.decode_hangs = "silent"  # never posts its rendezvous
        request = asyncio.create_task(client.post("/v1/completions", json={"model": "m", "prompt": "a"}))
        await asyncio.wait_for(engines.prefilled.wait(), BOUND)  # Prefill's leg, sent at once, answered
        asked = asyncio.Event()
        ask = ask_for_targets(client, engines, asked)
        await asyncio.wait_for(asked.wait(), BOUND)
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request
        answer = await asyncio.wait_for(ask, BOUND)
        assert answer.status_code == 410 and "no targets" in answer.text  # Prefill frees the blocks it held
        assert cancelled == ["decode"]
        await assert_gone(client, engines)

    run(scenario, targets_url=URL, rendezvous_timeout=BOUND)


def asgi(body: dict[str, Any], spec: str) -> tuple[dict[str, Any], Any]:
    """An ASGI scope and receive: the body, then the client gone (``http.disconnect``)."""
    raw = json.dumps(body).encode()
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "query_string": b"",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())],
             "asgi": {"version": "3.0", "spec_version": spec}}  # fmt: skip
    messages = [{"type": "http.request", "body": raw, "more_body": False}]

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    return scope, receive


@pytest.mark.parametrize("fails", ["http.response.start", "http.response.body"])
@pytest.mark.parametrize("targets_url", [None, URL])
def test_a_stream_whose_client_went_away_ends_the_request(fails: str, targets_url: str | None) -> None:
    """Sending the headers fails (the generator never ran) or sending a chunk does (it is left at a
    yield): Starlette raises ClientDisconnect (ASGI 2.4: OSError) and closes neither generator itself."""
    async def scenario(client: httpx.AsyncClient, engines: Engines) -> None:
        proxy = engines.public_proxy
        scope, receive = asgi({"model": "m", "prompt": "a", "stream": True}, "2.4")
        response = await proxy.handle(Request(scope, receive), "/v1/completions")
        sent: list[str] = []

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == fails:
                raise OSError("the client's connection is closed")
            sent.append(message["type"])

        with pytest.raises(ClientDisconnect):
            await response(scope, receive, send)
        assert sent == ([] if fails == "http.response.start" else ["http.response.start"])
        await assert_gone(client, engines)

    run(scenario, targets_url=targets_url, rendezvous_timeout=BOUND)


def test_a_stream_whose_generator_raises_while_closing_still_ends_its_request() -> None:
    """ClosingStream awaits on_close even when closing the body generator raises."""
    from rd2h.proxy.abandon import ClosingStream

    closed: list[str] = []

    async def body() -> Any:
        try:
            yield b"data: 1\n\n"
        finally:
            raise RuntimeError("a generator that fails while closing")

    async def on_close() -> None:
        closed.append("ended")

    async def scenario() -> None:
        async def receive() -> dict[str, Any]:
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body":
                raise OSError("the client went away")

        response = ClosingStream(body(), on_close=on_close, media_type="text/event-stream")
        with contextlib.suppress(Exception):
            await response({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)

    asyncio.run(scenario())
    assert closed == ["ended"]
