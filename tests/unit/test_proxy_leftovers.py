"""The proxy's loose ends: a client gone while the proxy stops a failed request's other leg is
a client gone (499), not that failure; an engine's answer httpx cannot read (DecodingError, no
TransportError) is that engine's 502, a model list's and a streamed error body's too; the lengths learned from Decode's
``/v1/models`` are asked again once old (in the background), checked against the Decodes a request may go to (not
the smallest of all), and their listings stop with the proxy; a first-token stream Decode
breaks is counted ``failed`` once. The engines are test_proxy's and test_proxy_first_token's."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
import test_proxy
import test_proxy_first_token as first_token
from test_proxy_first_limits import listing
from test_proxy_first_token import GREEDY, MALFORMED, decode_mangled, engines_as, events, metric
from test_proxy_gone import BOUND, assert_gone

from rd2h.proxy.instances import Pool
from rd2h.proxy.models import ModelLengths, refusal

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


# -- an answer httpx cannot read ------------------------------------------------------------------


@pytest.mark.parametrize(("role", "kind"), [("prefill", "prefill_failed"), ("decode", "engine_failed")])
def test_an_engine_answer_that_does_not_decode_is_that_engines_502(role: str, kind: str) -> None:
    """A body its content-encoding does not decode raises httpx.DecodingError, which is no
    TransportError: the engine failed the request (502 naming it and the error), not the proxy."""
    async def scenario(client: httpx.AsyncClient, engines: test_proxy.Engines) -> None:
        async def handle(request: httpx.Request) -> httpx.Response:
            if request.method == "POST" and request.url.host == role:
                return httpx.Response(200, content=b"not gzip", headers={"content-encoding": "gzip"})
            return await engines(request)

        engines.public_proxy.client = httpx.AsyncClient(transport=httpx.MockTransport(handle))
        answer = await client.post("/v1/completions", json={"model": "m", "prompt": "a"})
        assert answer.status_code == 502, answer.text
        message = answer.json()["error"]["message"]
        assert f"http://{role}/v1/completions" in message and "DecodingError" in message, message
        scrape = (await client.get("/metrics")).text
        assert metric(scrape, f'rd2h_proxy_errors_total{{kind="{kind}"}}') == 1
        assert metric(scrape, 'rd2h_proxy_errors_total{kind="proxy_failed"}') == 0
        proxy = engines.public_proxy
        assert proxy.pending == {} and all(i.up and i.outstanding == 0 for pool in (
            proxy.prefill_pool, proxy.decode_pool) for i in pool.instances)  # fmt: skip

    test_proxy.run(scenario)


def test_a_model_list_that_does_not_decode_is_decodes_502() -> None:
    """The proxy's /v1/models passes a Decode's answer on: one httpx cannot decode is Decode's 502
    naming it (the instance stays up: it answered), not an exception out of the handler."""
    async def scenario(client: httpx.AsyncClient, engines: test_proxy.Engines) -> None:
        async def handle(request: httpx.Request) -> httpx.Response:
            if request.method == "GET" and request.url.path == "/v1/models":
                return httpx.Response(200, content=b"not gzip", headers={"content-encoding": "gzip"})
            return await engines(request)

        engines.public_proxy.client = httpx.AsyncClient(transport=httpx.MockTransport(handle))
        answer = await client.get("/v1/models")
        assert answer.status_code == 502, answer.text
        message = answer.json()["error"]["message"]
        assert "http://decode" in message and "DecodingError" in message, message
        assert all(i.up for i in engines.public_proxy.decode_pool.instances)

    test_proxy.run(scenario)


def test_a_decode_error_body_that_does_not_read_ends_a_first_token_stream_with_an_error_event() -> None:
    """Decode refused a first-token stream's leg, but its error body does not decode (httpx.DecodingError
    while reading it): still Decode's failure, an error event after the first token, not an exception
    out of the stream (the request recorded as a client gone)."""
    async def scenario(client: httpx.AsyncClient, engines: first_token.Engines) -> None:
        async def handle(request: httpx.Request) -> httpx.Response:
            if request.method == "POST" and request.url.host == "decode":
                async def body() -> Any:  # streamed: read (and decoded) only after the headers
                    yield b"not gzip"

                return httpx.Response(400, content=body(), headers={"content-encoding": "gzip"})
            return await engines(request)

        engines_as(client, handle)
        answer = await client.post("/v1/completions", json={**GREEDY, "stream": True})
        got = events(answer.content)
        assert got[0]["choices"][0]["text"] == "A" and len(got) == 2, got
        message = got[-1]["error"]["message"]
        assert "Decode answered 400" in message and "DecodingError" in message, message
        record = (await client.get("/v1/rd2h/requests", headers=test_proxy.OPERATOR)).json()[-1]
        assert record["status"] == 400, record
        await first_token.assert_ended(client, engines, "failed")

    first_token.run(scenario)


# -- the first-token flow's outcome -----------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_a_decode_answer_of_another_shape_is_counted_failed_once(stream: bool) -> None:
    change, _ = MALFORMED["text_not_a_string"]

    async def scenario(client: httpx.AsyncClient, engines: first_token.Engines) -> None:
        engines_as(client, decode_mangled(engines, change, stream=stream))
        answer = await client.post("/v1/completions", json={**GREEDY, "stream": stream})
        if stream:
            assert "error" in events(answer.content)[-1]
        else:
            assert answer.status_code == 502
        scrape = (await client.get("/metrics")).text
        assert metric(scrape, 'rd2h_proxy_first_token_requests_total{outcome="failed"}') == 1
        assert metric(scrape, 'rd2h_proxy_first_token_requests_total{outcome="continued"}') == 0

    first_token.run(scenario)


def test_a_stream_decode_ended_well_is_counted_continued_once() -> None:
    async def scenario(client: httpx.AsyncClient, engines: first_token.Engines) -> None:
        answer = await client.post("/v1/completions", json={**GREEDY, "stream": True})
        assert events(answer.content)[-1] == "[DONE]"
        scrape = (await client.get("/metrics")).text
        assert metric(scrape, 'rd2h_proxy_first_token_requests_total{outcome="continued"}') == 1
        assert metric(scrape, 'rd2h_proxy_first_token_requests_total{outcome="failed"}') == 0

    first_token.run(scenario)


# -- Decode's max_model_len ------------------------------------------------------------------------


def test_the_length_checked_is_that_of_the_decodes_a_request_may_go_to() -> None:
    """Decodes of different lengths: a request that fits one goes to it, not refused for the
    other's; refused (naming the largest) only when none can take it."""
    async def scenario(client: httpx.AsyncClient, engines: first_token.Engines) -> None:
        served: list[str] = []

        async def handle(request: httpx.Request) -> httpx.Response:
            if request.method == "GET" and request.url.path == "/v1/models":
                return httpx.Response(200, json=listing({"decode": 6, "decode2": 100}[request.url.host]))
            if request.method == "POST" and request.url.host != "prefill":
                served.append(request.url.host)
            return await engines(request)

        proxy = engines_as(client, handle)
        proxy.decode_pool = Pool("decode", ["http://decode", "http://decode2"])
        for _ in range(2):  # the prompt is 3 tokens, max_tokens 4: 7, past decode's 6
            engines.asks.clear()
            answer = await client.post("/v1/completions", json=GREEDY)
            assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == "ABCD", answer.text
        assert served == ["decode2", "decode2"]
        refused = await client.post("/v1/completions", json={**GREEDY, "max_tokens": 98})
        assert refused.status_code == 400 and "maximum context length is 100 tokens" in refused.text, refused.text
        assert served == ["decode2", "decode2"]

    first_token.run(scenario)


def test_a_refusal_needs_every_decode_up_known_too_short() -> None:
    assert refusal(3, 4, {"a": 6, "b": 100}) == (None, frozenset({"a"}))
    assert refusal(3, 4, {"a": 6, "b": None}) == (None, frozenset({"a"}))  # b's length unknown: it may fit
    assert refusal(3, 4, {}) == (None, frozenset())
    message, short = refusal(3, 4, {"a": 6, "b": 5})
    assert short == {"a", "b"} and message is not None and "maximum context length is 6 tokens" in message


def test_a_length_learned_is_asked_again_once_old_behind_the_requests() -> None:
    """A Decode restarted with another length between two health checks keeps its epoch: its
    length is asked again once older than max_age, while the old one still serves (no request
    waits for the listing), and the new one serves from its answer on."""
    async def scenario(client: httpx.AsyncClient, engines: first_token.Engines) -> None:
        now, length, asked = [0.0], [6], []
        refreshing, release = asyncio.Event(), asyncio.Event()

        async def handle(request: httpx.Request) -> httpx.Response:
            if request.method == "GET" and request.url.path == "/v1/models":
                asked.append(length[0])
                if len(asked) == 2:  # the refresh: held until the test lets it answer
                    refreshing.set()
                    await release.wait()
                return httpx.Response(200, json=listing(length[0]))
            return await engines(request)

        async def post() -> httpx.Response:
            engines.asks.clear()
            return await client.post("/v1/completions", json=GREEDY)  # 3 prompt tokens, max_tokens 4: 7

        proxy = engines_as(client, handle)
        proxy.model_lengths = lengths = ModelLengths(max_age=60.0, clock=lambda: now[0])
        assert (await post()).status_code == 400 and asked == [6]
        length[0] = 100  # restarted with a longer context
        now[0] = 59.0
        assert (await post()).status_code == 400 and asked == [6]  # not old yet: not asked
        now[0] = 61.0
        assert (await post()).status_code == 400  # the old length serves while it is asked again
        await asyncio.wait_for(refreshing.wait(), BOUND)
        assert asked == [6, 100]
        release.set()
        await asyncio.wait_for(lengths._asking["http://decode"], BOUND)
        assert (await post()).status_code == 200 and asked == [6, 100]

    first_token.run(scenario)


def test_a_listing_in_flight_ends_when_the_proxy_stops() -> None:
    async def scenario(client: httpx.AsyncClient, engines: first_token.Engines) -> None:
        asked, ended = asyncio.Event(), asyncio.Event()

        async def handle(request: httpx.Request) -> httpx.Response:
            asked.set()
            try:
                await asyncio.Event().wait()  # a Decode that never answers its /v1/models
            finally:
                ended.set()
            raise AssertionError("unreachable")

        proxy = engines_as(client, handle)
        assert proxy.model_lengths.learn(proxy.client, proxy.decode_pool, BOUND, {}) is not None
        await asyncio.wait_for(asked.wait(), BOUND)
        await proxy.stop()
        assert ended.is_set()

    first_token.run(scenario)
