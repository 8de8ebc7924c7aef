"""``rd2h proxy`` in process: the ASGI app over httpx's ASGI transport, the engines as
httpx mock transports that behave as vLLM with RD2HConnector does (Decode posts its
rendezvous, then answers once Prefill was called). No sockets."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from rd2h.proxy import ProxyConfig, create_app
from rd2h.proxy.app import children_of

PREFILL, DECODE = "http://prefill", "http://decode"


class Engines:
    """Decode posts one rendezvous per child, then waits for Prefill; Prefill records."""

    def __init__(self, proxy: httpx.AsyncClient, *, prefill_fails: bool = False) -> None:
        self.proxy, self.prefill_fails = proxy, prefill_fails
        self.prefill_bodies: list[dict[str, Any]] = []
        self.decode_bodies: list[dict[str, Any]] = []
        self.decode_hosts: list[str] = []
        self.prefilled = asyncio.Event()

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if request.url.host == "down":
            raise httpx.ConnectError("connection refused")
        if request.url.host == "prefill":
            self.prefill_bodies.append(body)
            if self.prefill_fails:
                raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
            self.prefilled.set()
            return httpx.Response(200, json={"choices": [{"index": 0, "text": "x"}]})
        self.decode_bodies.append(body)
        self.decode_hosts.append(request.url.host)
        ours = body["kv_transfer_params"]["rd2h"]
        for child in range(ours["children"]):
            answer = await self.proxy.post(ours["metaserver"], json={
                "id": ours["id"], "child": child, "endpoint": "127.0.0.1:5600/1", "first_block": child,
            })
            assert answer.status_code == 200
        await asyncio.wait_for(self.prefilled.wait(), 5)
        return httpx.Response(200, json={"choices": [{"index": i, "text": "decoded"} for i in range(ours["children"])]})


def run(coro_fn: Any, *, prefill_fails: bool = False, decode: tuple[str, ...] = (DECODE,)) -> Any:
    async def main() -> Any:
        app = create_app(ProxyConfig(prefill=[PREFILL], decode=list(decode), retries=1, backoff=0.01))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as client:
            engines = Engines(client, prefill_fails=prefill_fails)
            app.state.proxy.client = httpx.AsyncClient(transport=httpx.MockTransport(engines))
            return await coro_fn(client, engines)

    return asyncio.run(main())


def test_decode_first_then_prefill_once_for_a_prompt_list() -> None:
    async def scenario(client: httpx.AsyncClient, engines: Engines) -> None:
        body = {"model": "m", "prompt": ["a", "b", "c"], "max_tokens": 9, "stream_options": {"x": 1}}
        response = await client.post("/v1/completions", json=body)
        assert response.status_code == 200 and len(response.json()["choices"]) == 3
        (decode,) = engines.decode_bodies
        assert decode["max_tokens"] == 9 and decode["kv_transfer_params"]["do_remote_prefill"]
        (prefill,) = engines.prefill_bodies
        assert prefill["max_tokens"] == 1 and prefill["stream"] is False and "stream_options" not in prefill
        params = prefill["kv_transfer_params"]
        assert params["do_remote_decode"] and params["rd2h"]["children"] == 3
        assert params["rd2h"]["targets"]["2"] == {"endpoint": "127.0.0.1:5600/1", "first_block": 2}
        record = (await client.get("/v1/rd2h/requests")).json()[-1]
        assert record["status"] == 200 and [c["first_block"] for c in record["children"]] == [0, 1, 2]
        assert (await client.get("/health")).json() == {"status": "ok", "pending": 0}

    run(scenario)


def test_prefill_failure_is_a_502_and_nothing_stays_pending() -> None:
    async def scenario(client: httpx.AsyncClient, engines: Engines) -> None:
        response = await client.post("/v1/completions", json={"model": "m", "prompt": "a", "max_tokens": 4})
        assert response.status_code == 502
        assert response.json()["error"]["type"] == "rd2h_proxy_error"
        assert len(engines.prefill_bodies) == 1  # sent once: it had the request, no retry
        assert (await client.get("/health")).json()["pending"] == 0

    run(scenario, prefill_fails=True)


def test_metaserver_refuses_unknown_ids_and_bad_bodies() -> None:
    async def scenario(client: httpx.AsyncClient, engines: Engines) -> None:
        assert (await client.post("/v1/rd2h/rendezvous", json={"id": "nope", "endpoint": "h:1/1"})).status_code == 404
        assert (await client.post("/v1/rd2h/rendezvous", content=b"{")).status_code == 400
        assert (await client.post("/v1/rd2h/rendezvous", json=[1])).status_code == 400
        assert (await client.post("/v1/completions", content=b"not json")).status_code == 400

    run(scenario)


@pytest.mark.parametrize(
    ("body", "path", "n"),
    [({"prompt": "a"}, "/v1/completions", 1), ({"prompt": ["a", "b"]}, "/v1/completions", 2),
     ({"prompt": [1, 2, 3]}, "/v1/completions", 1), ({"prompt": [[1], [2]]}, "/v1/completions", 2),
     ({"messages": []}, "/v1/chat/completions", 1)],
)
def test_children_of(body: dict[str, Any], path: str, n: int) -> None:
    assert children_of(body, path) == n


def test_proxy_help_documents_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    from rd2h.cli.main import main

    with pytest.raises(SystemExit):
        main(["proxy", "--help"])
    text = capsys.readouterr().out
    for option in ("--host", "--port", "--prefill", "--decode", "--metaserver-url", "--rendezvous-timeout",
                   "--request-timeout", "--retries", "--backoff", "--log-level"):
        assert option in text


def test_round_robin_skips_an_instance_that_refuses_connections() -> None:
    async def scenario(client: httpx.AsyncClient, engines: Engines) -> None:
        for _ in range(2):
            engines.prefilled.clear()
            response = await client.post("/v1/completions", json={"model": "m", "prompt": "a", "max_tokens": 2})
            assert response.status_code == 200
        # the first goes to d1; the second meets "down", which refuses, and is retried on d2
        assert engines.decode_hosts == ["d1", "d2"]

    run(scenario, decode=("http://d1", "http://down", "http://d2"))
