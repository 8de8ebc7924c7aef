"""The proxy's loose ends: a client gone while the proxy stops a failed request's other leg is
a client gone (499), not that failure; an engine's answer httpx cannot read (DecodingError, no
TransportError) is that engine's 502; the lengths learned from Decode's ``/v1/models`` are
asked again once old (in the background), checked against the Decodes a request may go to (not
the smallest of all), and their listings stop with the proxy; a first-token stream Decode
breaks is counted ``failed`` once. The engines are test_proxy's and test_proxy_first_token's."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import test_proxy
from test_proxy_gone import BOUND, assert_gone

# -- a second cancellation -----------------------------------------------------------------------


def test_a_client_gone_while_the_proxy_stops_decode_after_prefill_failed_is_a_499() -> None:
    """Prefill failed, so the proxy cancels Decode's leg and waits for it to end; the client
    leaving meanwhile must end the request as the client gone, not as Prefill's 502."""
    async def scenario(client: httpx.AsyncClient, engines: test_proxy.Engines) -> None:
        engines.decode_hangs = True  # posts its rendezvous (Prefill is sent, and fails), then holds
        stopping = asyncio.Event()

        async def handle(request: httpx.Request) -> httpx.Response:
            try:
                return await engines(request)
            except asyncio.CancelledError:
                if request.url.host != "decode":
                    raise
                stopping.set()  # the proxy waits for Decode's leg to end: it ends at the next cancellation
                await asyncio.Event().wait()
                raise

        engines.public_proxy.client = httpx.AsyncClient(transport=httpx.MockTransport(handle))
        request = asyncio.create_task(client.post("/v1/completions", json={"model": "m", "prompt": "a"}))
        await asyncio.wait_for(stopping.wait(), BOUND)
        request.cancel()  # the client went away (the server cancels its handler)
        with pytest.raises(asyncio.CancelledError):
            await request
        await assert_gone(client, engines)
        assert "prefill_failed" not in (await client.get("/metrics")).text

    test_proxy.run(scenario, prefill_fails=True)
