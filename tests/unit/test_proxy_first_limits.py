"""``rd2h proxy --first-token-from-prefill`` and the model's length: Prefill's leg asks for one
token, so only Decode would refuse a prompt plus ``max_tokens`` past ``max_model_len``, after the
client had its first token. The proxy learns each Decode's length from its ``/v1/models`` (once)
and refuses such a request as vLLM does, before the first token; Prefill's ask gets 410. Where
no length is known, the request goes on as before. The engines are test_proxy_first_token's."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from test_proxy_first_token import GREEDY, Engines, assert_ended, engines_as, events, run

from rd2h.proxy.models import lengths_of, too_long


def listing(length: Any) -> dict[str, Any]:
    card = {"id": "m", "object": "model", "owned_by": "vllm"}
    return {"object": "list", "data": [card if length is None else {**card, "max_model_len": length}]}


def serving(engines: Engines, client: httpx.AsyncClient, length: Any) -> list[str]:
    """Decode lists model "m" with ``length`` (None: no max_model_len); the listings asked are recorded."""
    asked: list[str] = []

    async def handle(request: httpx.Request) -> httpx.Response:
        if request.method == "GET" and request.url.path == "/v1/models":
            asked.append(request.url.host)
            return httpx.Response(200, json=listing(length))
        return await engines(request)

    engines_as(client, handle)
    return asked


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_plus_max_tokens_past_the_models_length_is_refused_before_the_first_token(stream: bool) -> None:
    async def scenario(client: httpx.AsyncClient, engines: Engines) -> None:
        asked = serving(engines, client, 6)  # the prompt is 3 tokens, max_tokens 4: 7
        answer = await client.post("/v1/completions", json={**GREEDY, "stream": stream})
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == 400
        assert "maximum context length is 6 tokens" in error["message"] and "3 input tokens" in error["message"]
        assert engines.decode_bodies == [] and asked == ["decode"]
        await assert_ended(client, engines, "failed")  # Prefill's ask refused: it frees its blocks

    run(scenario)


@pytest.mark.parametrize("length", [7, None, "7"])  # fits; not listed; not a length
def test_a_request_that_fits_or_a_length_not_known_goes_on_and_the_length_is_asked_once(length: Any) -> None:
    async def scenario(client: httpx.AsyncClient, engines: Engines) -> None:
        asked = serving(engines, client, length)
        for _ in range(2):
            engines.asks.clear()
            answer = await client.post("/v1/completions", json={**GREEDY, "stream": True})
            assert [e if e == "[DONE]" else e["choices"][0]["text"] for e in events(answer.content)] == [
                "A", "B", "C", "D", "[DONE]"]  # fmt: skip
        assert asked == ["decode"]  # learned once for this Decode process

    run(scenario)


def test_lengths_are_read_from_vllms_model_cards_and_a_request_is_measured_as_vllm_does() -> None:
    assert lengths_of(listing(4096)) == {"m": 4096}
    assert lengths_of({"data": [{"id": "m", "max_model_len": True}, {"id": "x", "max_model_len": 0}]}) == {}
    assert lengths_of([1]) == {} and lengths_of({"data": 5}) == {}
    assert too_long(3, 4, 7) is None and too_long(3, 4, None) is None
    assert too_long(3, 5, 7) == ("'max_tokens' is too large: 5. This model's maximum context length is 7 tokens "
                                 "and your request has 3 input tokens (5 > 7 - 3).")


def test_a_listing_refused_for_one_clients_key_is_asked_again_with_the_next_clients() -> None:
    """The listing goes with the client's Authorization: a client's wrong key (401) says nothing of
    Decode's length, so it must not leave the length unknown for every later client."""
    async def scenario(client: httpx.AsyncClient, engines: Engines) -> None:
        asked: list[str] = []

        async def handle(request: httpx.Request) -> httpx.Response:
            if request.method == "GET" and request.url.path == "/v1/models":
                asked.append(request.headers.get("authorization", ""))
                if request.headers.get("authorization") != "Bearer good":
                    return httpx.Response(401, json={"error": "invalid api key"})
                return httpx.Response(200, json=listing(6))  # the prompt is 3 tokens, max_tokens 4: 7
            return await engines(request)

        engines_as(client, handle)
        wrong = await client.post("/v1/completions", json=GREEDY, headers={"authorization": "Bearer bad"})
        assert wrong.status_code == 200, wrong.text  # its length not known: Decode's own refusal would follow
        right = await client.post("/v1/completions", json=GREEDY, headers={"authorization": "Bearer good"})
        assert right.status_code == 400 and "maximum context length is 6" in right.text, right.text
        assert asked == ["Bearer bad", "Bearer good"]

    run(scenario)


@pytest.mark.parametrize("via", ["request", "listing"])
def test_a_listing_too_deeply_nested_to_read_leaves_the_length_unknown(via: str) -> None:
    """A Decode's /v1/models that json cannot read for its depth (RecursionError, not ValueError) is no
    listing: a request goes on, the proxy's own /v1/models passes it on as Decode sent it."""
    async def scenario(client: httpx.AsyncClient, engines: Engines) -> None:
        deep = b"[" * 100_000

        async def handle(request: httpx.Request) -> httpx.Response:
            if request.method == "GET" and request.url.path == "/v1/models":
                return httpx.Response(200, content=deep, headers={"content-type": "application/json"})
            return await engines(request)

        engines_as(client, handle)
        if via == "listing":
            answer = await client.get("/v1/models")
            assert answer.status_code == 200 and answer.content == deep
        answer = await client.post("/v1/completions", json=GREEDY)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == "ABCD"

    run(scenario)
