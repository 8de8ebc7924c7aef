"""``rd2h proxy`` in process: the ASGI app over httpx's ASGI transport, the engines as
httpx mock transports that behave as vLLM with RD2HConnector does (Decode posts its
rendezvous, then answers once Prefill was called). No sockets."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest

from rd2h.proxy import ProxyConfig, create_app
from rd2h.proxy.app import children_of, prefill_body, shape_of
from rd2h.vllm.params import accept_prefill
from rd2h.vllm.vouch import sign, token, verify

PREFILL, DECODE = "http://prefill", "http://decode"
SECRET = b"rd2h-proxy-test-secret-012345678"
RENDEZVOUS = "/v1/rd2h/rendezvous"
OPERATOR = {"Authorization": f"Bearer {token(SECRET, 'requests')}"}


class Engines:
    """Decode posts one signed rendezvous per prompt (its sample 0 pulls, its
    ``kv_load_failure_policy`` said), then waits for Prefill (a streamed answer sends its
    headers first, as vLLM does); a plain request (no kv_transfer_params) it answers at once.
    Prefill records."""

    def __init__(self, proxy: httpx.AsyncClient, *, prefill_fails: bool = False, policy: str = "fail") -> None:
        self.proxy, self.prefill_fails, self.policy = proxy, prefill_fails, policy
        self.prefill_bodies: list[dict[str, Any]] = []
        self.decode_bodies: list[dict[str, Any]] = []
        self.decode_hosts: list[str] = []
        self.prefilled = asyncio.Event()
        self.decode_seen = asyncio.Event()

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
        self.decode_seen.set()
        self.decode_hosts.append(request.url.host)
        if "kv_transfer_params" not in body:  # computed here
            return self._answer(body, 1, "computed", ready=None)
        ours = verify(SECRET, body["kv_transfer_params"]["rd2h"], time.time())
        children = ours["prompts"] * ours["samples"]
        for prompt in range(ours["prompts"]):
            rendezvous = {"ext_id": f"{ours['id']}-{prompt}-0", "endpoint": "127.0.0.1:5600/1", "first_block": prompt,
                          "on_load_failure": self.policy}
            answer = await self.proxy.post(RENDEZVOUS, json=sign(SECRET, rendezvous, time.time()))
            assert answer.status_code == 200
        if not body.get("stream"):
            await asyncio.wait_for(self.prefilled.wait(), 5)
        return self._answer(body, children, "decoded", ready=self.prefilled)

    def _answer(self, body: dict[str, Any], children: int, text: str, ready: asyncio.Event | None) -> httpx.Response:
        choices = [{"index": i, "text": text} for i in range(children)]
        if not body.get("stream"):
            return httpx.Response(200, json={"choices": choices})

        async def events() -> Any:
            if ready is not None:  # nothing before the KV is whole
                await asyncio.wait_for(ready.wait(), 5)
            yield f"data: {json.dumps({'choices': choices})}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return httpx.Response(200, content=events(), headers={"content-type": "text/event-stream"})


def run(coro_fn: Any, *, prefill_fails: bool = False, decode: tuple[str, ...] = (DECODE,), policy: str = "fail") -> Any:
    async def main() -> Any:
        app = create_app(ProxyConfig(prefill=[PREFILL], decode=list(decode), secret=SECRET, retries=1, backoff=0.01))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as client:
            engines = Engines(client, prefill_fails=prefill_fails, policy=policy)
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
        assert params["do_remote_decode"] and params["rd2h"]["prompts"] == 3
        (target,) = accept_prefill(SECRET, params["rd2h"], "cmpl-x-2-abcdef12", time.time())  # signed for Prefill
        assert (str(target.endpoint), target.first_block) == ("127.0.0.1:5600/1", 2)
        assert (await client.get("/v1/rd2h/requests")).status_code == 401  # in-flight ids: operators only
        record = (await client.get("/v1/rd2h/requests", headers=OPERATOR)).json()[-1]
        assert record["status"] == 200 and [c["first_block"] for c in record["children"]] == [0, 1, 2]
        assert (await client.get("/health")).json() == {"status": "ok", "pending": 0, "recomputed": 0}

    run(scenario)


def test_prefill_failure_is_a_502_and_nothing_stays_pending() -> None:
    async def scenario(client: httpx.AsyncClient, engines: Engines) -> None:
        response = await client.post("/v1/completions", json={"model": "m", "prompt": "a", "max_tokens": 4})
        assert response.status_code == 502
        assert response.json()["error"]["type"] == "rd2h_proxy_error"
        assert len(engines.prefill_bodies) == 1  # sent once: it had the request, no retry
        assert (await client.get("/health")).json()["pending"] == 0

    run(scenario, prefill_fails=True)


@pytest.mark.parametrize("stream", [False, True])
def test_a_failed_prefill_under_decodes_recompute_policy_is_computed_on_decode(stream: bool) -> None:
    """Decode's rendezvous said kv_load_failure_policy=recompute: Prefill's failure costs the
    client nothing but time; a Decode computes the prompt (a plain request), once."""
    async def scenario(client: httpx.AsyncClient, engines: Engines) -> None:
        body = {"model": "m", "prompt": "a", "max_tokens": 4, "stream": stream}
        response = await client.post("/v1/completions", json=body)
        assert response.status_code == 200
        assert "computed" in response.text and "error" not in response.text
        pulled, computed = engines.decode_bodies
        assert "kv_transfer_params" in pulled and computed == body  # the client's own request, as sent
        assert (await client.get("/health")).json() == {"status": "ok", "pending": 0, "recomputed": 1}
        record = (await client.get("/v1/rd2h/requests", headers=OPERATOR)).json()[-1]
        assert record["status"] == 200 and "Server disconnected" in record["recomputed"]

    run(scenario, prefill_fails=True, policy="recompute")


def test_a_failed_prefill_under_decodes_fail_policy_ends_a_stream_with_an_error_event() -> None:
    async def scenario(client: httpx.AsyncClient, engines: Engines) -> None:
        body = {"model": "m", "prompt": "a", "max_tokens": 4, "stream": True}
        response = await client.post("/v1/completions", json=body)
        events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
        assert events and events[-1]["error"]["type"] == "rd2h_proxy_error"
        assert len(engines.decode_bodies) == 1 and (await client.get("/health")).json()["recomputed"] == 0

    run(scenario, prefill_fails=True, policy="fail")


def test_metaserver_refuses_unknown_ids_unsigned_and_bad_bodies() -> None:
    async def scenario(client: httpx.AsyncClient, engines: Engines) -> None:
        unknown = sign(SECRET, {"ext_id": "ab" * 16 + "-0-0", "endpoint": "h:1/1"}, time.time())
        assert (await client.post(RENDEZVOUS, json=unknown)).status_code == 404
        unsigned = {"ext_id": "ab" * 16 + "-0-0", "endpoint": "h:1/1"}
        assert (await client.post(RENDEZVOUS, json=unsigned)).status_code == 403
        forged = sign(b"not-the-proxy-secret-0123456789", unsigned, time.time())
        assert (await client.post(RENDEZVOUS, json=forged)).status_code == 403
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
    for option in ("--host", "--port", "--prefill", "--decode", "--secret-file", "--rendezvous-timeout",
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


def test_a_client_cannot_hijack_another_clients_rendezvous() -> None:
    """The attack of issue 18: a client posts its own endpoint for a request in flight. Without
    the secret its rendezvous is refused, and Prefill is given the Decode's endpoint only."""
    async def scenario(client: httpx.AsyncClient, engines: Engines) -> None:
        victim = asyncio.create_task(client.post("/v1/completions", json={"model": "m", "prompt": "a", "max_tokens": 2}))
        await asyncio.wait_for(engines.decode_seen.wait(), 5)
        rid = verify(SECRET, engines.decode_bodies[0]["kv_transfer_params"]["rd2h"], time.time())["id"]
        forged = {"ext_id": f"{rid}-0-0", "endpoint": "attacker.example:6666/1", "id": rid, "child": 0}
        assert (await client.post(RENDEZVOUS, json=forged, headers={"Host": "attacker.example"})).status_code == 403
        assert (await victim).status_code == 200
        (prefill,) = engines.prefill_bodies
        (target,) = accept_prefill(SECRET, prefill["kv_transfer_params"]["rd2h"], "cmpl-a-0-abcdef12", time.time())
        assert str(target.endpoint) == "127.0.0.1:5600/1"

    run(scenario)


def test_n_samples_pull_once_per_prompt_and_prefill_computes_one_sample() -> None:
    async def scenario(client: httpx.AsyncClient, engines: Engines) -> None:
        body = {"model": "m", "prompt": ["a", "b"], "n": 2, "max_tokens": 3, "min_tokens": 2, "best_of": 2}
        response = await client.post("/v1/completions", json=body)
        assert response.status_code == 200 and len(response.json()["choices"]) == 4
        (decode,) = engines.decode_bodies
        assert (decode["n"], decode["min_tokens"]) == (2, 2)  # Decode serves the client as asked
        (prefill,) = engines.prefill_bodies
        assert "n" not in prefill and "min_tokens" not in prefill and "best_of" not in prefill
        (target,) = accept_prefill(SECRET, prefill["kv_transfer_params"]["rd2h"], "cmpl-x-1-abcdef12", time.time())
        assert target.first_block == 1 and target.ext_id.endswith("-1-0")  # prompt 1, its sample 0
        sample_1 = sign(SECRET, {"ext_id": target.ext_id[:-1] + "1", "endpoint": "h:1/1"}, time.time())
        assert (await client.post(RENDEZVOUS, json=sample_1)).status_code in (400, 404)  # samples > 0 never post

    run(scenario)


@pytest.mark.parametrize(
    ("body", "why"),
    [({"prompt": "a", "n": 0}, "n must be"), ({"prompt": "a", "n": "2"}, "n must be"),
     ({"prompt": ["a"] * 3000, "n": 2}, "more than"), ({"prompt": "a", "prompt_logprobs": 1}, "prompt_logprobs"),
     ({"prompt": "a", "echo": True, "logprobs": 1}, "prompt_logprobs")],
)
def test_what_rd2h_cannot_serve_is_a_clear_400(body: dict[str, Any], why: str) -> None:
    with pytest.raises(ValueError, match=why):
        shape_of(body, "/v1/completions")

    async def scenario(client: httpx.AsyncClient, engines: Engines) -> None:
        response = await client.post("/v1/completions", json=body)
        assert response.status_code == 400 and why in response.json()["error"]["message"]
        assert not engines.decode_bodies and not engines.prefill_bodies

    run(scenario)


def test_the_prefill_leg_changes_only_what_it_must() -> None:
    body = {"prompt": "a", "max_tokens": 9, "min_tokens": 8, "n": 2, "stream": True, "stream_options": {},
            "seed": 3, "stop": ["x"], "logprobs": 2, "response_format": {"type": "json_object"}}
    leg = prefill_body(body)
    assert leg == {"prompt": "a", "max_tokens": 1, "stream": False, "seed": 3, "stop": ["x"], "logprobs": 2,
                   "response_format": {"type": "json_object"}}
