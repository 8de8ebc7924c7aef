"""``rd2h proxy`` in process: its two ASGI apps over httpx's ASGI transport, the engines as
httpx mock transports that behave as vLLM with RD2HConnector does (Decode posts its
rendezvous to the internal app, then answers once Prefill was called). No sockets.

``client`` sends ``/v1/rd2h/*`` and ``/metrics`` to the internal app and the rest to the
public one, as an operator's network would; ``engines.public`` reaches only the public app."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest

from rd2h.proxy import ProxyConfig, create_apps
from rd2h.proxy.bodies import children_of, prefill_body, shape_of
from rd2h.proxy.instances import Pool
from rd2h.vllm.params import accept_prefill
from rd2h.vllm.vouch import sign, token, verify

PREFILL, DECODE = "http://prefill", "http://decode"
SECRET = b"rd2h-proxy-test-secret-012345678"
RENDEZVOUS = "/v1/rd2h/rendezvous"
OPERATOR = {"Authorization": f"Bearer {token(SECRET, 'requests')}"}


class Engines:
    """Decode posts one signed rendezvous per prompt (its sample 0 pulls, its
    ``kv_load_failure_policy`` said), then waits for Prefill (a streamed answer sends its
    headers first, then posts, as vLLM does); a plain request (no kv_transfer_params) it answers at once.
    Prefill records."""

    def __init__(self, proxy: httpx.AsyncClient, *, prefill_fails: bool = False, policy: str = "fail") -> None:
        self.proxy, self.prefill_fails, self.policy = proxy, prefill_fails, policy
        self.prefill_bodies: list[dict[str, Any]] = []
        self.decode_bodies: list[dict[str, Any]] = []
        self.decode_hosts: list[str] = []
        self.prefilled = asyncio.Event()
        self.decode_seen = asyncio.Event()
        self.requests: list[httpx.Request] = []  # every request an engine received
        self.down_answers = False  # "down" refuses connections until this is set
        self.decode_hangs: bool | str = False  # a pulled request: rendezvous posted, then no answer at all

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.host == "down" and not self.down_answers:
            raise httpx.ConnectError("connection refused")
        self.requests.append(request)
        if request.method == "GET":  # health checks, /v1/models
            return httpx.Response(200, json={"object": "list", "data": [{"id": "tiny"}]})
        body = json.loads(request.content)
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

        async def post_rendezvous() -> None:
            for prompt in range(ours["prompts"]):
                rendezvous = {"ext_id": f"{ours['id']}-{prompt}-0", "endpoint": "127.0.0.1:5600/1",
                              "first_block": prompt, "on_load_failure": self.policy}
                answer = await self.proxy.post(RENDEZVOUS, json=sign(SECRET, rendezvous, time.time()))
                assert answer.status_code == 200

        if self.decode_hangs:  # a Decode slower than Prefill's failure: cancelled, never answers
            if self.decode_hangs != "silent":  # "silent": it does not even post its rendezvous
                await post_rendezvous()
            await asyncio.Event().wait()
        if not body.get("stream"):
            await post_rendezvous()
            await asyncio.wait_for(self.prefilled.wait(), 5)
        return self._answer(body, children, "decoded", ready=self.prefilled, first=post_rendezvous)

    def _answer(self, body: dict[str, Any], children: int, text: str, ready: asyncio.Event | None,
                first: Any = None) -> httpx.Response:
        choices = [{"index": i, "text": text} for i in range(children)]
        if not body.get("stream"):
            return httpx.Response(200, json={"choices": choices})

        async def events() -> Any:
            if first is not None:  # as vLLM: a stream's headers go out before the engine schedules it
                await first()
            if ready is not None:  # nothing before the KV is whole
                await asyncio.wait_for(ready.wait(), 5)
            yield f"data: {json.dumps({'choices': choices})}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return httpx.Response(200, content=events(), headers={"content-type": "text/event-stream"})


INTERNAL = ("/v1/rd2h/", "/metrics")


class Split(httpx.AsyncBaseTransport):
    """The operator's view: internal paths to the internal listener, the rest to the public one."""

    def __init__(self, public: Any, internal: Any) -> None:
        self.public, self.internal = httpx.ASGITransport(app=public), httpx.ASGITransport(app=internal)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        internal = request.url.path.startswith(INTERNAL)
        return await (self.internal if internal else self.public).handle_async_request(request)


def run(coro_fn: Any, *, prefill_fails: bool = False, decode: tuple[str, ...] = (DECODE,), policy: str = "fail",
        **config: Any) -> Any:
    async def main() -> Any:
        settings = {"retries": 1, "backoff": 0.01, "health_interval": 0, **config}
        public, internal = create_apps(ProxyConfig(prefill=[PREFILL], decode=list(decode), secret=SECRET, **settings))
        async with httpx.AsyncClient(transport=Split(public, internal), base_url="http://proxy") as client:
            engines = Engines(client, prefill_fails=prefill_fails, policy=policy)
            engines.public = httpx.AsyncClient(transport=httpx.ASGITransport(app=public), base_url="http://proxy")
            engines.public_proxy = public.state.proxy
            public.state.proxy.client = httpx.AsyncClient(transport=httpx.MockTransport(engines))
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
        health = (await client.get("/health")).json()
        assert (health["status"], health["pending"], health["recomputed"]) == ("ok", 0, 0)

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
        forged = {"do_remote_prefill": True, "rd2h": {"id": "ab" * 16}}
        response = await client.post("/v1/completions", json={**body, "kv_transfer_params": forged})
        assert response.status_code == 200
        assert "computed" in response.text and "error" not in response.text
        pulled, computed = engines.decode_bodies
        assert "kv_transfer_params" in pulled and computed == body  # the client's request, its own params dropped
        health = (await client.get("/health")).json()  # the Prefill that dropped the request is out of rotation
        assert (health["status"], health["pending"], health["recomputed"]) == ("unavailable", 0, 1)
        record = (await client.get("/v1/rd2h/requests", headers=OPERATOR)).json()[-1]
        assert record["status"] == 200 and "Server disconnected" in record["recomputed"]

    run(scenario, prefill_fails=True, policy="recompute")


def test_a_prefill_failing_before_decodes_headers_is_recomputed_once_in_a_stream() -> None:
    """Prefill failed while Decode had not answered yet: the proxy recomputes on a Decode at
    once; the stream it then relays must not see Prefill's failure again and recompute twice."""
    async def scenario(client: httpx.AsyncClient, engines: Engines) -> None:
        engines.decode_hangs = True
        response = await client.post("/v1/completions", json={"model": "m", "prompt": "a", "stream": True})
        assert response.status_code == 200 and "computed" in response.text and "error" not in response.text
        assert len(engines.decode_bodies) == 2 and (await client.get("/health")).json()["recomputed"] == 1

    run(scenario, prefill_fails=True, policy="recompute")


def test_a_decode_that_never_posts_its_rendezvous_fails_the_request_at_the_deadline() -> None:
    async def scenario(client: httpx.AsyncClient, engines: Engines) -> None:
        engines.decode_hangs = "silent"
        response = await client.post("/v1/completions", json={"model": "m", "prompt": ["a", "b"]})
        assert response.status_code == 502 and "did not post a rendezvous within 0.05 s" in response.text
        assert engines.prefill_bodies == [] and (await client.get("/health")).json()["pending"] == 0
        text = (await client.get("/metrics")).text
        assert 'rd2h_proxy_errors_total{kind="rendezvous_timeout"} 1.0' in text

    run(scenario, rendezvous_timeout=0.05)


def test_a_failed_prefill_under_decodes_fail_policy_ends_a_stream_with_an_error_event() -> None:
    async def scenario(client: httpx.AsyncClient, engines: Engines) -> None:
        body = {"model": "m", "prompt": "a", "max_tokens": 4, "stream": True}
        response = await client.post("/v1/completions", json=body)
        assert response.status_code == 200  # the headers went out before Prefill failed
        events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
        error = events[-1]["error"]  # OpenAI's error shape, and no [DONE]: the stream failed
        assert error["type"] == "rd2h_proxy_error" and error["code"] == 502 and "param" in error and error["message"]
        assert "[DONE]" not in response.text
        assert len(engines.decode_bodies) == 1 and (await client.get("/health")).json()["recomputed"] == 0
        record = (await client.get("/v1/rd2h/requests", headers=OPERATOR)).json()[-1]
        assert record["status"] == 502 and record["error"]  # logged as failed, not as the 200 it began as

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


def test_the_rendezvous_and_operator_routes_are_not_on_the_public_listener() -> None:
    async def scenario(client: httpx.AsyncClient, engines: Engines) -> None:
        public = engines.public
        body = sign(SECRET, {"ext_id": f"{'ab' * 16}-0-0", "endpoint": "127.0.0.1:5600/1"}, time.time())
        assert (await public.post(RENDEZVOUS, json=body)).status_code == 404
        assert (await public.get("/v1/rd2h/requests", headers=OPERATOR)).status_code == 404
        assert (await public.get("/metrics")).status_code == 404
        assert (await client.get("/metrics")).status_code == 200  # the internal listener has them

    run(scenario)


def test_authorization_and_request_id_reach_both_legs_and_the_id_comes_back() -> None:
    async def scenario(client: httpx.AsyncClient, engines: Engines) -> None:
        headers = {"Authorization": "Bearer engine-key", "X-Request-Id": "client-42", "X-Other": "no"}
        response = await client.post("/v1/completions", json={"model": "m", "prompt": "a"}, headers=headers)
        assert response.status_code == 200 and response.headers["x-request-id"] == "client-42"
        for leg in engines.requests:
            assert leg.headers["authorization"] == "Bearer engine-key" and leg.headers["x-request-id"] == "client-42"
            assert "x-other" not in leg.headers
        record = (await client.get("/v1/rd2h/requests", headers=OPERATOR)).json()[-1]
        assert record["x_request_id"] == "client-42"
        made = await client.post("/v1/completions", json={"model": "m", "prompt": "a"})  # none sent: one is made
        assert len(made.headers["x-request-id"]) == 32 and engines.requests[-1].headers["x-request-id"] == made.headers[
            "x-request-id"]

    run(scenario)


def test_models_come_from_a_decode_with_the_clients_authorization() -> None:
    async def scenario(client: httpx.AsyncClient, engines: Engines) -> None:
        response = await client.get("/v1/models", headers={"Authorization": "Bearer k"})
        assert response.status_code == 200 and response.json()["data"][0]["id"] == "tiny"
        assert engines.requests[-1].url.host == "decode" and engines.requests[-1].headers["authorization"] == "Bearer k"

    run(scenario)


@pytest.mark.parametrize(
    ("raw", "headers", "status", "why"),
    [
        (b"x" * 2048, {}, 413, "more than the 1024"),
        (b'{"prompt": "\xff\xfe"}', {}, 400, "not UTF-8"),
        (b'{"prompt": ', {}, 400, "not JSON"),
        (b"[1, 2]", {}, 400, "JSON object"),
        (b'{"prompt": ' + b"[" * 5000, {}, 400, "nested too deeply"),
        (json.dumps({"model": "m", "prompt": ["a"] * 5000}).encode(), {}, 400, "4096"),
    ],
)
def test_limits_answer_a_clear_4xx_before_anything_is_sent(raw: bytes, headers: dict[str, str], status: int,
                                                           why: str) -> None:
    async def scenario(client: httpx.AsyncClient, engines: Engines) -> None:
        response = await client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert response.status_code == status and why in response.json()["error"]["message"], response.text
        assert response.json()["error"]["code"] == status and not engines.requests

    run(scenario, max_body_bytes=1024 if status == 413 else 1 << 20)


def test_a_body_sent_without_a_length_is_cut_off_at_the_limit() -> None:
    async def scenario(client: httpx.AsyncClient, engines: Engines) -> None:
        async def chunks() -> Any:
            for _ in range(64):
                yield b"x" * 64
        response = await client.post("/v1/completions", content=chunks())
        assert response.status_code == 413 and not engines.requests

    run(scenario, max_body_bytes=1024)


def test_the_up_instance_with_fewest_outstanding_requests_is_picked_ties_in_turn() -> None:
    pool = Pool("decode", ["http://a", "http://b", "http://c"])
    a, b, c = pool.instances
    a.outstanding, b.outstanding, c.outstanding = 2, 1, 1
    assert {pool.pick().url for _ in range(4)} == {"http://b", "http://c"}  # ties in turn
    pool.mark_down(b, "test")
    assert pool.pick().url == "http://c" and pool.pick({"http://c"}).url == "http://a"
    assert pool.pick({"http://a", "http://c"}) is None
    assert pool.pick({"http://a", "http://c"}, include_down=True).url == "http://b"  # a restart not seen yet
    pool.mark_up(b)
    assert pool.any_up() and b.why_down == ""


def test_a_dead_decode_leaves_rotation_at_once_and_a_health_check_brings_it_back() -> None:
    """"down" refuses connections: the request goes to the next instance, "down" is out of
    rotation (no request tries it again) until a health check answers."""
    async def scenario(client: httpx.AsyncClient, engines: Engines) -> None:
        proxy = engines.public_proxy
        for _ in range(6):
            engines.prefilled.clear()
            assert (await client.post("/v1/completions", json={"model": "m", "prompt": "c"})).status_code == 200
        (down,) = (i for i in proxy.decode_pool.instances if i.url == "http://down")
        assert not down.up and "ConnectError" in down.why_down
        assert sorted(engines.decode_hosts) == ["d1"] * 3 + ["d2"] * 3  # tried once, then never
        assert all(i.outstanding == 0 for i in proxy.decode_pool.instances)
        health = (await client.get("/health")).json()
        assert [i["up"] for i in health["decode"]] == [True, False, True]
        engines.down_answers = True
        await proxy.check_health()
        assert down.up
        metrics = (await client.get("/metrics")).text
        assert 'rd2h_proxy_instance_up{instance="http://down",role="decode"} 1.0' in metrics

    run(scenario, decode=("http://d1", "http://down", "http://d2"))


def test_metrics_count_requests_errors_and_time_to_first_token() -> None:
    async def scenario(client: httpx.AsyncClient, engines: Engines) -> None:
        assert (await client.post("/v1/completions", json={"model": "m", "prompt": "a"})).status_code == 200
        assert (await client.post("/v1/completions", json={"model": "m", "prompt": "a", "n": 0})).status_code == 400
        text = (await client.get("/metrics")).text
        assert 'rd2h_proxy_requests_total{route="/v1/completions",status="200"} 1.0' in text
        assert 'rd2h_proxy_requests_total{route="/v1/completions",status="400"} 1.0' in text
        assert 'rd2h_proxy_errors_total{kind="refused"} 1.0' in text
        for series in ("ttft_seconds", "rendezvous_seconds", "prefill_seconds", "decode_first_byte_seconds"):
            assert f"rd2h_proxy_{series}_count 1.0" in text, series

    run(scenario)


@pytest.mark.parametrize("stream", [False, True])
def test_the_request_record_marks_each_hop_on_the_monotonic_clock(stream: bool) -> None:
    """``t_origin`` (time.monotonic(), one clock for every process on the host, so engines'
    timestamps line up with it) and ``t``: when the request passed each hop, ms from it, in
    the order a P/D request meets them (bench/vllm_pd.py cuts TTFT at these)."""
    async def scenario(client: httpx.AsyncClient, engines: Engines) -> None:
        before = time.monotonic()
        response = await client.post("/v1/completions", json={"model": "m", "prompt": ["a", "b"], "stream": stream})
        after = time.monotonic()
        assert response.status_code == 200
        record = (await client.get("/v1/rd2h/requests", headers=OPERATOR)).json()[-1]
        assert before <= record["t_origin"] <= after
        t = record["t"]
        hops = ["begun", "decode_sent", "rendezvous_0", "rendezvous_1", "rendezvous_all", "prefill_sent", "first_byte",
                "end"]
        assert set(t) == {*hops, "decode_answered", "prefill_answered"}
        assert [t[h] for h in hops] == sorted(t[h] for h in hops)
        assert 0 <= t["begun"] and t["end"] <= (after - record["t_origin"]) * 1e3
        assert t["decode_sent"] <= t["decode_answered"] <= t["end"] and t["prefill_sent"] <= t["prefill_answered"]

    run(scenario)


def test_a_draining_proxy_refuses_new_requests_with_503() -> None:
    async def scenario(client: httpx.AsyncClient, engines: Engines) -> None:
        engines.public_proxy.draining = True
        response = await client.post("/v1/completions", json={"model": "m", "prompt": "a"})
        assert response.status_code == 503 and "shutting down" in response.json()["error"]["message"]
        assert (await client.get("/health")).status_code == 503 and not engines.requests

    run(scenario)
