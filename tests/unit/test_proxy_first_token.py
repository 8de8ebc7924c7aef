"""``rd2h proxy --first-token-from-prefill``: which requests take the mode (and the reasons the
others are counted under), the answers assembled from Prefill's first token and Decode's rest,
streamed and not, and the flow through the proxy's real apps with engines that behave as vLLM
with RD2HConnector does (rd2h.proxy.first_token, rd2h.proxy.first_flow). No sockets."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest
from test_proxy import OPERATOR, SECRET, Split

from rd2h.proxy import ProxyConfig, create_apps
from rd2h.proxy.bodies import event
from rd2h.proxy.first_token import (
    REASONS,
    StreamRewriter,
    decode_leg,
    ends_at_first,
    first_chunks,
    first_of,
    merged_body,
    prefill_only_body,
    why_not,
)  # fmt: skip
from rd2h.vllm.params import accept_decode_leg, accept_later, targets_ask
from rd2h.vllm.vouch import sign, verify

URL = "http://proxy/internal/v1/rd2h/targets"
GREEDY = {"model": "m", "prompt": "hello", "max_tokens": 4, "temperature": 0}
PROMPT_IDS, FIRST_ID, REST_IDS = [1, 2, 3], 7, [8, 9, 10]


def prefill_answer(finish: str = "length", text: str = "A") -> dict[str, Any]:
    return {"id": "cmpl-p", "object": "text_completion", "created": 11, "model": "m", "kv_transfer_params": None,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None,
                         "prompt_token_ids": PROMPT_IDS, "token_ids": [FIRST_ID]}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}  # fmt: skip


# -- which requests take the mode ----------------------------------------------------------------


@pytest.mark.parametrize(("path", "change", "reason"), [
    ("/v1/completions", {}, None),
    ("/v1/completions", {"prompt": [5, 6, 7], "return_token_ids": True, "stream": True}, None),
    ("/v1/completions", {"ignore_eos": True, "stop_token_ids": [2], "top_k": 1, "top_p": 0.5, "min_p": 0.1}, None),
    ("/v1/completions", {"user": "u", "logit_bias": {"5": -100}, "skip_special_tokens": False, "priority": 1}, None),
    ("/v1/completions", {"stream": True, "stream_options": {"include_usage": True}, "repetition_penalty": 1.2}, None),
    ("/v1/completions", {"max_tokens": None}, "max_tokens"),  # vLLM's default (16 in 0.32): not one less of it
    ("/v1/completions", {"stream_options": {"include_usage": True}}, "other_field"),  # vLLM: only with stream
    ("/v1/completions", {"stream": True, "stream_options": {"include_usage": "x"}}, "other_field"),
    ("/v1/completions", {"stream": True, "stream_options": {"usage": True}}, "other_field"),
    ("/v1/completions", {"stream": True, "stream_options": [1]}, "other_field"),
    ("/v1/completions", {"suffix": "x"}, "other_field"),
    ("/v1/completions", {"include_stop_str_in_output": True}, "other_field"),
    ("/v1/completions", {"truncate_prompt_tokens": 2}, "other_field"),  # Prefill's prompt ids are the whole prompt
    ("/v1/completions", {"prompt_embeds": "eA=="}, "other_field"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, "chat"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "prompt_list"),
    ("/v1/completions", {"prompt": [[1, 2]]}, "prompt_list"),
    ("/v1/completions", {"n": 2}, "n"),
    ("/v1/completions", {"best_of": 2}, "n"),
    ("/v1/completions", {"temperature": 0.7}, "sampling"),
    ("/v1/completions", {"temperature": None}, "sampling"),  # the model's default may sample
    ("/v1/completions", {"seed": 3}, "seed"),
    ("/v1/completions", {"logprobs": 1}, "logprobs"),
    ("/v1/completions", {"echo": True}, "echo"),
    ("/v1/completions", {"stop": ["\n"]}, "stop"),
    ("/v1/completions", {"frequency_penalty": 0.5}, "penalties"),
    ("/v1/completions", {"min_tokens": 2}, "min_tokens"),
    ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"response_format": {"type": "json_object"}}, "other_field"),
    ("/v1/completions", {"bad_words": ["x"]}, "other_field"),
])  # fmt: skip
def test_only_greedy_completions_of_one_prompt_take_the_mode(path: str, change: dict[str, Any],
                                                             reason: str | None) -> None:
    body = {**GREEDY, **change}
    if "temperature" in change and change["temperature"] is None:
        del body["temperature"]
    assert why_not(path, body) == reason
    assert reason is None or reason in REASONS


def test_decodes_leg_is_the_prompts_token_ids_and_the_first_token_one_token_shorter() -> None:
    first = first_of(prefill_answer())
    leg = decode_leg({**GREEDY, "kv_transfer_params": {"do_remote_prefill": True}, "add_special_tokens": True}, first)
    assert leg["prompt"] == [*PROMPT_IDS, FIRST_ID] and leg["max_tokens"] == 3
    assert "kv_transfer_params" not in leg and "add_special_tokens" not in leg  # a client's steer nothing
    assert decode_leg({k: v for k, v in GREEDY.items() if k != "max_tokens"}, first)["max_tokens"] == 15


def test_the_first_token_ends_the_request_at_one_token_or_a_stop() -> None:
    assert not ends_at_first(first_of(prefill_answer()), GREEDY)
    assert ends_at_first(first_of(prefill_answer()), {**GREEDY, "max_tokens": 1})
    assert ends_at_first(first_of(prefill_answer("stop")), GREEDY)  # an end-of-text or stop token


@pytest.mark.parametrize("answer", [
    {"choices": []}, {"choices": [{"text": "A", "token_ids": [7]}]},  # no prompt ids: a vLLM without them
    {"choices": [{"prompt_token_ids": [1], "token_ids": [7, 8]}]}, "not an object",
])  # fmt: skip
def test_a_prefill_answer_without_its_tokens_is_refused(answer: Any) -> None:
    with pytest.raises(ValueError):
        first_of(answer)


# -- the answers ------------------------------------------------------------------------------


def test_the_whole_answer_is_the_first_token_then_decodes_counted_as_one_engine() -> None:
    first = first_of(prefill_answer())
    decode = {"id": "cmpl-d", "created": 12, "model": "m", "choices": [
        {"index": 0, "text": "BCD", "finish_reason": "length", "prompt_token_ids": [*PROMPT_IDS, FIRST_ID],
         "token_ids": REST_IDS}], "usage": {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}}
    body = merged_body(first, decode, {**GREEDY, "return_token_ids": True})
    (choice,) = body["choices"]
    assert (body["id"], body["created"], choice["text"], choice["finish_reason"]) == ("cmpl-p", 11, "ABCD", "length")
    assert choice["prompt_token_ids"] == PROMPT_IDS and choice["token_ids"] == [FIRST_ID, *REST_IDS]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    plain = merged_body(first, {**decode, "choices": [{**decode["choices"][0], "prompt_token_ids": None,
                                                        "token_ids": None}]}, GREEDY)  # fmt: skip
    assert plain["choices"][0]["token_ids"] is None and plain["choices"][0]["prompt_token_ids"] is None
    alone = prefill_only_body(first, GREEDY)  # the ids were asked by the proxy, not the client
    assert alone["choices"][0]["token_ids"] is None and alone["choices"][0]["text"] == "A"


def events(raw: bytes) -> list[Any]:
    return [b if b == "[DONE]" else json.loads(b) for b in
            (e.removeprefix("data: ") for e in raw.decode().split("\n\n") if e)]  # fmt: skip


def test_the_first_streamed_event_is_one_engines_chunk_and_a_last_one_ends_the_stream() -> None:
    first = first_of(prefill_answer())
    (chunk,) = events(first_chunks(first, {**GREEDY, "stream": True, "return_token_ids": True}, last=False))
    assert chunk["id"] == "cmpl-p" and chunk["object"] == "text_completion" and "usage" not in chunk
    assert chunk["choices"] == [{"index": 0, "text": "A", "logprobs": None, "finish_reason": None,
                                 "stop_reason": None, "prompt_token_ids": PROMPT_IDS, "token_ids": [FIRST_ID]}]
    options = {"include_usage": True, "continuous_usage_stats": True}
    last = events(first_chunks(first_of(prefill_answer("stop")), {**GREEDY, "stream_options": options}, last=True))
    assert [e if e == "[DONE]" else (e["choices"], e.get("usage")) for e in last] == [
        ([{"index": 0, "text": "A", "logprobs": None, "finish_reason": "stop", "stop_reason": None,
           "prompt_token_ids": None, "token_ids": None}],
         {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}),
        ([], {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}), "[DONE]"]  # fmt: skip


def test_decodes_stream_is_rewritten_event_by_event_however_it_is_cut() -> None:
    first = first_of(prefill_answer())
    decode = [
        {"id": "cmpl-d", "created": 12, "object": "text_completion", "model": "m", "choices": [
            {"index": 0, "text": "B", "prompt_token_ids": [*PROMPT_IDS, FIRST_ID], "token_ids": [8]}]},
        {"id": "cmpl-d", "created": 12, "object": "text_completion", "model": "m", "choices": [
            {"index": 0, "text": "C", "prompt_token_ids": None, "token_ids": [9], "finish_reason": "length"}]},
        {"id": "cmpl-d", "created": 12, "object": "text_completion", "model": "m", "choices": [],
         "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}},
        {"error": {"message": "x"}},
    ]
    raw = b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in decode) + b"data: [DONE]\n\n"
    for cut in (1, 7, 50, len(raw)):
        rewriter = StreamRewriter(first)
        out = b"".join(rewriter.feed(raw[i:i + cut]) for i in range(0, len(raw), cut)) + rewriter.flush()
        got = events(out)
        assert [e.get("id") for e in got[:3]] == ["cmpl-p"] * 3 and got[3] == decode[3] and got[4] == "[DONE]"
        assert got[0]["choices"][0]["prompt_token_ids"] is None and got[0]["choices"][0]["token_ids"] == [8]
        assert got[2]["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}


# -- the flow through the proxy -----------------------------------------------------------------


class Engines:
    """Prefill answers its leg with the prompt's token ids and its first token, then asks the
    proxy for its targets (signed, as its connector does); Decode posts its rendezvous, waits
    for Prefill's targets to be answered (its KV came), then answers its own tokens."""

    def __init__(self, proxy: httpx.AsyncClient, finish: str = "length") -> None:
        self.proxy, self.finish, self.text = proxy, finish, "A"
        self.prefill_bodies: list[dict[str, Any]] = []
        self.decode_bodies: list[dict[str, Any]] = []
        self.asks: list[asyncio.Task[httpx.Response]] = []
        self.every_ask: list[asyncio.Task[httpx.Response]] = []  # ended before the proxy's client closes
        self.client_has_first = asyncio.Event()  # set by a test that reads the first event
        self.wait_for_client = False

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            return httpx.Response(200, json={})
        body = json.loads(request.content)
        if request.url.host == "prefill":
            self.prefill_bodies.append(body)
            rid = body["kv_transfer_params"]["rd2h"]["id"]
            ask = targets_ask(SECRET, rid, time.time())
            self.asks.append(asyncio.ensure_future(self.proxy.post("/v1/rd2h/targets", json=ask)))
            self.every_ask.append(self.asks[-1])
            return httpx.Response(200, json=prefill_answer(self.finish, self.text))
        self.decode_bodies.append(body)
        if "kv_transfer_params" not in body:  # the normal flow's plain leg, or a fallback's Decode leg
            return httpx.Response(200, json={"choices": [{"index": 0, "text": "plain"}]})
        ours = verify(SECRET, body["kv_transfer_params"]["rd2h"], time.time())
        if self.wait_for_client:  # nothing from Decode before the client had its first token
            await asyncio.wait_for(self.client_has_first.wait(), 5)
        rendezvous = {"ext_id": f"{ours['id']}-0-0", "endpoint": "127.0.0.1:5600/1", "first_block": 0}
        assert (await self.proxy.post("/v1/rd2h/rendezvous", json=sign(SECRET, rendezvous, time.time()))).is_success
        if self.asks:
            assert (await asyncio.wait_for(self.asks[-1], 5)).status_code == 200  # Prefill had its targets
        usage = {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
        choice = {"index": 0, "text": "BCD", "finish_reason": "length", "stop_reason": None, "logprobs": None,
                  "prompt_token_ids": body["prompt"], "token_ids": REST_IDS}
        if not body.get("stream"):
            return httpx.Response(200, json={"id": "cmpl-d", "created": 12, "model": "m", "choices": [choice],
                                             "usage": usage})  # fmt: skip

        async def stream() -> Any:
            for i, (text, token) in enumerate(zip("BCD", REST_IDS)):
                delta = {**choice, "text": text, "token_ids": [token], "finish_reason": "length" if i == 2 else None,
                         "prompt_token_ids": None if i else body["prompt"]}  # fmt: skip
                yield f"data: {json.dumps({'id': 'cmpl-d', 'created': 12, 'choices': [delta]})}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return httpx.Response(200, content=stream(), headers={"content-type": "text/event-stream"})


def run(scenario: Any, **config: Any) -> Any:
    async def main() -> Any:
        settings = {"retries": 1, "backoff": 0.01, "health_interval": 0, "first_token_url": URL, **config}
        public, internal = create_apps(ProxyConfig(prefill=["http://prefill"], decode=["http://decode"], secret=SECRET,
                                                   **settings))  # fmt: skip
        async with httpx.AsyncClient(transport=Split(public, internal), base_url="http://proxy") as client:
            engines = Engines(client)
            public.state.proxy.client = httpx.AsyncClient(transport=httpx.MockTransport(engines))
            try:
                return await scenario(client, engines)
            finally:  # an ask a test did not wait for must not outlive the client it posts with
                await asyncio.gather(*engines.every_ask, return_exceptions=True)

    return asyncio.run(main())


def metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def engines_as(client: httpx.AsyncClient, handler: Any) -> Any:
    """The proxy behind ``client``, its engines now ``handler`` (which may hand on to the test's Engines)."""
    proxy = client._transport.public.app.state.proxy  # type: ignore[attr-defined]
    proxy.client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return proxy


async def assert_ended(client: httpx.AsyncClient, engines: Engines, outcome: str) -> None:
    """The request ended, counted under ``outcome``, nothing pending, and Prefill's ask for targets
    refused: 410 if it came first, 404 after the request ended; either frees its blocks (rd2h.vllm.later)."""
    assert (await asyncio.wait_for(engines.asks[0], 5)).status_code in (404, 410)
    scrape = (await client.get("/metrics")).text
    assert metric(scrape, f'rd2h_proxy_first_token_requests_total{{outcome="{outcome}"}}') == 1
    assert (await client.get("/health")).json()["pending"] == 0


def test_a_greedy_request_gets_prefills_token_then_decodes_and_prefill_its_targets() -> None:
    async def scenario(client: httpx.AsyncClient, engines: Engines) -> None:
        answer = await client.post("/v1/completions", json={**GREEDY, "return_token_ids": True,
                                                             "kv_transfer_params": {"do_remote_prefill": False}})
        assert answer.status_code == 200, answer.text
        (choice,) = answer.json()["choices"]
        assert (choice["text"], choice["token_ids"], choice["prompt_token_ids"]) == ("ABCD", [7, 8, 9, 10], [1, 2, 3])
        assert answer.json()["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
        (prefill,), (decode,) = engines.prefill_bodies, engines.decode_bodies
        assert prefill["max_tokens"] == 1 and prefill["return_token_ids"] is True
        later = accept_later(SECRET, prefill["kv_transfer_params"]["rd2h"], "cmpl-x", time.time())
        assert later is not None and later.first and later.url == URL
        assert decode["prompt"] == [1, 2, 3, 7] and decode["max_tokens"] == 3
        ext_id, _, _, tail = accept_decode_leg(SECRET, decode["kv_transfer_params"]["rd2h"], "cmpl-x", time.time())
        assert tail == 1 and ext_id == f"{later.rid}-0-0"  # the same request on both engines
        record = (await client.get("/v1/rd2h/requests", headers=OPERATOR)).json()[-1]
        t = record["t"]
        assert record["first_token"] == "continued" and record["status"] == 200 and "prefill_ms" in record
        assert t["prefill_sent"] <= t["prefill_answered"] <= t["decode_sent"] <= t["targets_sent"]
        scrape = (await client.get("/metrics")).text
        assert metric(scrape, 'rd2h_proxy_first_token_requests_total{outcome="continued"}') == 1
        assert metric(scrape, "rd2h_proxy_prefill_seconds_count") == 1  # Prefill's leg timed as in the normal flow

    run(scenario)


def test_a_stream_sends_the_first_token_before_decode_answers_anything(monkeypatch: pytest.MonkeyPatch) -> None:
    from rd2h.proxy import first_flow

    async def scenario(client: httpx.AsyncClient, engines: Engines) -> None:
        engines.wait_for_client = True  # Decode says nothing until the first event went to the client
        sent = first_flow._first_out

        def first_out(proxy: Any, pending: Any) -> None:  # right after the first event was handed to the server
            sent(proxy, pending)
            engines.client_has_first.set()

        monkeypatch.setattr(first_flow, "_first_out", first_out)
        answer = await client.post("/v1/completions", json={**GREEDY, "stream": True, "return_token_ids": True})
        got = events(answer.content)
        assert [e if e == "[DONE]" else e["choices"][0]["text"] for e in got] == ["A", "B", "C", "D", "[DONE]"]
        assert [t for e in got[:-1] for t in e["choices"][0]["token_ids"]] == [7, 8, 9, 10]
        assert [e["choices"][0]["prompt_token_ids"] for e in got[:-1]] == [[1, 2, 3], None, None, None]
        assert {e["id"] for e in got[:-1]} == {"cmpl-p"}
        record = (await client.get("/v1/rd2h/requests", headers=OPERATOR)).json()[-1]
        assert record["t"]["first_token_out"] <= record["t"]["decode_answered"] and record["status"] == 200

    run(scenario)


@pytest.mark.parametrize(("change", "finish"), [({"max_tokens": 1}, "length"), ({}, "stop")])
@pytest.mark.parametrize("stream", [False, True])
def test_a_first_token_that_ends_the_request_is_the_answer_and_prefill_hears_no_targets_come(
        change: dict[str, Any], finish: str, stream: bool) -> None:
    async def scenario(client: httpx.AsyncClient, engines: Engines) -> None:
        engines.finish = finish
        answer = await client.post("/v1/completions", json={**GREEDY, **change, "stream": stream})
        assert answer.status_code == 200 and engines.decode_bodies == []
        if stream:
            assert [e if e == "[DONE]" else e["choices"][0]["finish_reason"] for e in events(answer.content)] == [
                finish, "[DONE]"]  # fmt: skip
        else:
            assert answer.json()["choices"][0]["text"] == "A" and answer.json()["choices"][0]["token_ids"] is None
        await assert_ended(client, engines, "ended_at_first")

    run(scenario)


def test_what_the_mode_cannot_serve_takes_the_normal_flow_counted_by_reason() -> None:
    async def scenario(client: httpx.AsyncClient, engines: Engines) -> None:
        for change in ({"temperature": 1.0}, {"stop": ["x"]}, {"temperature": 1.0}):
            engines.asks.clear()
            answer = await client.post("/v1/completions", json={**GREEDY, **change})
            assert answer.status_code == 200
        scrape = (await client.get("/metrics")).text
        assert metric(scrape, 'rd2h_proxy_first_token_fallbacks_total{reason="sampling"}') == 2
        assert metric(scrape, 'rd2h_proxy_first_token_fallbacks_total{reason="stop"}') == 1
        assert metric(scrape, "rd2h_proxy_first_token_requests_total") == 0
        assert all("tail" not in verify(SECRET, d["kv_transfer_params"]["rd2h"], time.time())
                   for d in engines.decode_bodies)  # fmt: skip
        assert all(p["max_tokens"] == 1 and "first_token" not in p["kv_transfer_params"]["rd2h"]
                   for p in engines.prefill_bodies)  # fmt: skip

    run(scenario)


def test_a_prefill_that_fails_its_leg_is_a_502_and_decode_never_hears_of_it() -> None:
    async def scenario(client: httpx.AsyncClient, engines: Engines) -> None:
        async def broken(request: httpx.Request) -> httpx.Response:
            if request.url.host == "prefill":
                return httpx.Response(200, json={"choices": [{"index": 0, "text": "A"}]})  # no token ids
            return await engines(request)

        engines_as(client, broken)
        answer = await client.post("/v1/completions", json=GREEDY)
        assert answer.status_code == 502 and "prompt_token_ids" in answer.text and engines.decode_bodies == []
        assert (await client.get("/health")).json()["pending"] == 0

    run(scenario)


def test_the_cli_option_gives_first_token_requests_a_targets_url_and_the_others_their_own_flow() -> None:
    import argparse

    from rd2h.cli.commands.proxy import add_parser, targets_url
    from rd2h.errors import ConfigError

    parse = add_parser(argparse.ArgumentParser().add_subparsers()).parse_args
    args = parse(["--prefill", "http://p", "--decode", "http://d", "--first-token-from-prefill"])
    assert targets_url(args, 8001, "/v1/rd2h/targets", flag="first_token_from_prefill") == \
        "http://127.0.0.1:8001/v1/rd2h/targets"  # fmt: skip
    assert targets_url(args, 8001, "/v1/rd2h/targets") is None  # fallbacks: sequential unless --prefill-at-once
    args = parse(["--prefill", "http://p", "--decode", "http://d", "--first-token-from-prefill",
                  "--internal-url", "http://proxy:9"])  # fmt: skip
    assert targets_url(args, 8001, "/t", flag="first_token_from_prefill") == "http://proxy:9/t"
    with pytest.raises(ConfigError):
        targets_url(parse(["--prefill", "http://p", "--decode", "http://d", "--internal-url", "http://x"]), 1, "/t")


@pytest.mark.parametrize(("stream", "text"), [(False, "\ufffd"), (True, "\ufffd"), (False, ""), (True, "")])
def test_a_first_token_that_is_part_of_a_character_lets_decode_generate_every_token(stream: bool, text: str) -> None:
    """vLLM writes nothing (or U+FFFD) for a token inside a character; one engine writes it with
    the next token, and a Decode given that token as its prompt's last writes other text (the
    prompt's again): Decode gets the client's request (Prefill at once), its answer relayed."""
    async def scenario(client: httpx.AsyncClient, engines: Engines) -> None:
        engines.text = text
        answer = await client.post("/v1/completions", json={**GREEDY, "stream": stream})
        assert answer.status_code == 200
        got = events(answer.content)[:-1] if stream else [answer.json()]
        assert "".join(e["choices"][0]["text"] for e in got) == "BCD" and {e["id"] for e in got} == {"cmpl-d"}
        (decode,) = engines.decode_bodies
        assert decode["prompt"] == "hello" and decode["max_tokens"] == 4
        assert accept_decode_leg(SECRET, decode["kv_transfer_params"]["rd2h"], "cmpl-x", time.time())[3] == 0
        assert (await asyncio.wait_for(engines.asks[0], 5)).status_code == 200  # Prefill's KV still serves Decode
        scrape = (await client.get("/metrics")).text
        assert metric(scrape, 'rd2h_proxy_first_token_fallbacks_total{reason="split_character"}') == 1
        assert metric(scrape, "rd2h_proxy_first_token_requests_total") == 0

    run(scenario)


@pytest.mark.parametrize("stream", [False, True])
def test_a_decode_that_fails_after_the_first_token_ends_the_request_with_an_error(stream: bool) -> None:
    async def scenario(client: httpx.AsyncClient, engines: Engines) -> None:
        async def failing(request: httpx.Request) -> httpx.Response:
            if request.url.host == "decode" and request.method == "POST":
                return httpx.Response(500, json={"error": {"message": "boom"}})
            return await engines(request)

        engines_as(client, failing)
        answer = await client.post("/v1/completions", json={**GREEDY, "stream": stream})
        if stream:  # the first token went out with the headers: an error event follows, no [DONE]
            got = events(answer.content)
            assert got[0]["choices"][0]["text"] == "A" and "error" in got[-1] and "[DONE]" not in got
            assert "Decode answered 500" in got[-1]["error"]["message"]
        else:
            assert answer.status_code == 500 and "boom" in answer.text
        await assert_ended(client, engines, "failed")

    run(scenario)


def test_no_rendezvous_in_time_fails_the_request_after_its_first_token() -> None:
    async def scenario(client: httpx.AsyncClient, engines: Engines) -> None:
        async def silent(request: httpx.Request) -> httpx.Response:
            if request.url.host == "decode" and request.method == "POST":
                await asyncio.Event().wait()  # never posts, never answers
            return await engines(request)

        engines_as(client, silent)
        answer = await client.post("/v1/completions", json={**GREEDY, "stream": True})
        got = events(answer.content)
        assert got[0]["choices"][0]["text"] == "A" and "did not post a rendezvous" in got[-1]["error"]["message"]
        await assert_ended(client, engines, "failed")

    run(scenario, rendezvous_timeout=0.2)


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_gone_before_decode_answered_ends_the_request_and_prefill_hears_no_targets_come(
        stream: bool) -> None:
    async def scenario(client: httpx.AsyncClient, engines: Engines) -> None:
        decode_seen = asyncio.Event()

        async def silent(request: httpx.Request) -> httpx.Response:
            if request.url.host == "decode" and request.method == "POST":
                decode_seen.set()
                await asyncio.Event().wait()  # never posts, never answers
            return await engines(request)

        proxy = engines_as(client, silent)
        if stream:  # as the server does when the client hangs up: the stream is closed after its first event
            from rd2h.proxy.first_flow import first_token_answer

            answer = await first_token_answer(proxy, "/v1/completions", {**GREEDY, "stream": True},
                                              {"x-request-id": "r"}, time.monotonic())  # fmt: skip
            chunks = answer.body_iterator  # type: ignore[union-attr]
            assert b'"text":"A"' in await chunks.__anext__()  # type: ignore[union-attr]
            await asyncio.wait_for(decode_seen.wait(), 5)
            await chunks.aclose()  # type: ignore[union-attr]
        else:
            request = asyncio.create_task(client.post("/v1/completions", json=GREEDY))
            await asyncio.wait_for(decode_seen.wait(), 5)
            request.cancel()  # the client went away (the server cancels its handler)
            with pytest.raises(asyncio.CancelledError):
                await request
        assert (await asyncio.wait_for(engines.asks[0], 5)).status_code in (404, 410)  # Prefill frees its blocks
        assert (await client.get("/health")).json()["pending"] == 0
        record = (await client.get("/v1/rd2h/requests", headers=OPERATOR)).json()[-1]
        assert record["status"] == 499

    run(scenario, rendezvous_timeout=30)


def test_a_stream_whose_headers_never_went_out_ends_the_request_and_cancels_decodes_leg() -> None:
    """The client gone before the headers went out: the generator never ran, so on_close alone
    ends the request (499) and closes Decode's leg (vLLM aborts it)."""
    async def scenario(client: httpx.AsyncClient, engines: Engines) -> None:
        decode_seen, cancelled = asyncio.Event(), []

        async def silent(request: httpx.Request) -> httpx.Response:
            if request.url.host == "decode" and request.method == "POST":
                decode_seen.set()
                try:
                    await asyncio.Event().wait()  # never posts, never answers
                except asyncio.CancelledError:
                    cancelled.append("decode")
                    raise
            return await engines(request)

        from starlette.requests import ClientDisconnect

        from rd2h.proxy.first_flow import first_token_answer

        proxy = engines_as(client, silent)
        answer = await first_token_answer(proxy, "/v1/completions", {**GREEDY, "stream": True},
                                          {"x-request-id": "r"}, time.monotonic())  # fmt: skip
        await asyncio.wait_for(decode_seen.wait(), 5)

        async def receive() -> dict[str, Any]:
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            raise OSError("the client's connection is closed")

        with pytest.raises(ClientDisconnect):
            await answer({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)  # type: ignore[misc]
        assert cancelled == ["decode"]
        assert (await asyncio.wait_for(engines.asks[0], 5)).status_code in (404, 410)  # Prefill frees its blocks
        assert (await client.get("/health")).json()["pending"] == 0
        record = (await client.get("/v1/rd2h/requests", headers=OPERATOR)).json()[-1]
        assert record["status"] == 499

    run(scenario, rendezvous_timeout=30)


def test_prefills_transfer_params_never_reach_the_client() -> None:
    answer = prefill_answer()
    answer["kv_transfer_params"] = {"do_remote_prefill": True, "rd2h": {"leg": "handoff", "sig": "x"}}
    assert prefill_only_body(first_of(answer), GREEDY)["kv_transfer_params"] is None


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("how", ["timeout", "refused"])
def test_a_prefill_that_times_out_or_refuses_before_the_first_token_ends_the_request_once(
        how: str, stream: bool) -> None:
    """Prefill asked for its targets, then timed out (httpx's read timeout: ``request_timeout``) or
    answered an error: the client gets one error answer (nothing was streamed yet), Decode never
    hears of the request, and Prefill's ask is refused (it frees the blocks it held)."""

    async def scenario(client: httpx.AsyncClient, engines: Engines) -> None:
        async def failing(request: httpx.Request) -> httpx.Response:
            if request.url.host == "prefill":
                await engines(request)  # it took the request and asked for its targets
                if how == "timeout":
                    raise httpx.ReadTimeout("timed out", request=request)
                return httpx.Response(400, json={"error": {"message": "too long"}})
            return await engines(request)

        engines_as(client, failing)
        answer = await client.post("/v1/completions", json={**GREEDY, "stream": stream})
        if how == "timeout":
            assert answer.status_code == 502 and "ReadTimeout" in answer.json()["error"]["message"]
        else:
            assert answer.status_code == 400 and "too long" in answer.text  # Prefill's own answer
        assert engines.decode_bodies == []
        await assert_ended(client, engines, "failed")

    run(scenario)


MALFORMED = {  # what Decode may send that is not an engine's answer, and what the client is told of it
    "not_an_object": (lambda e: [e], "not a JSON object but list"),
    "choices_not_a_list": (lambda e: {**e, "choices": {"0": e["choices"][0]}}, "not one choice"),
    "text_not_a_string": (lambda e: {**e, "choices": [{**e["choices"][0], "text": 5}]}, "text is not a string"),
    "token_ids_not_a_list": (lambda e: {**e, "choices": [{**e["choices"][0], "token_ids": 5}]}, "token_ids is not"),
    "usage_not_counts": (lambda e: {**e, "usage": {"prompt_tokens": "4"}}, "usage is not token counts"),
}


def decode_mangled(engines: Any, change: Any, *, stream: bool) -> Any:
    """A handler for :func:`engines_as`: ``engines``' answers, Decode's POST answer (each event of
    it when streamed, ``[DONE]`` aside) passed through ``change``."""
    async def odd(request: httpx.Request) -> httpx.Response:
        answer = await engines(request)
        if request.url.host != "decode" or request.method != "POST":
            return answer
        if not stream:
            return httpx.Response(200, json=change(answer.json()))

        async def mangled() -> Any:
            async for raw in answer.stream:  # type: ignore[union-attr]
                yield raw if raw == b"data: [DONE]\n\n" else event(change(json.loads(raw[6:])))

        return httpx.Response(200, content=mangled(), headers={"content-type": "text/event-stream"})

    return odd


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("shape", sorted(MALFORMED))
def test_a_decode_answer_of_another_shape_is_a_502_naming_it_not_a_proxy_fault(shape: str, stream: bool) -> None:
    """It comes from an engine: a clear 502 (an error event after the first token when streamed),
    counted as Decode's failure, and Prefill's ask was answered (Decode had its KV)."""
    change, said = MALFORMED[shape]
    if stream and shape == "choices_not_a_list":
        said = "choices are not a list"

    async def scenario(client: httpx.AsyncClient, engines: Engines) -> None:
        engines_as(client, decode_mangled(engines, change, stream=stream))
        answer = await client.post("/v1/completions", json={**GREEDY, "return_token_ids": True, "stream": stream})
        if stream:  # the first token went out with the headers: an error event follows, no [DONE]
            got = events(answer.content)
            assert got[0]["choices"][0]["text"] == "A" and len(got) == 2 and "error" in got[-1]
            message = got[-1]["error"]["message"]
        else:
            assert answer.status_code == 502, answer.text
            message = answer.json()["error"]["message"]
        assert message.startswith("Decode") and said in message, message
        record = (await client.get("/v1/rd2h/requests", headers=OPERATOR)).json()[-1]
        assert record["status"] == 502 and record["error"] == message
        scrape = (await client.get("/metrics")).text
        assert metric(scrape, 'rd2h_proxy_errors_total{kind="decode_failed"}') == 1
        assert metric(scrape, 'rd2h_proxy_errors_total{kind="proxy_failed"}') == 0
        assert (await client.get("/health")).json()["pending"] == 0
        assert (await asyncio.wait_for(engines.asks[0], 5)).status_code == 200

    run(scenario)


@pytest.mark.parametrize("decode", [
    [{"choices": []}], {"choices": [{"text": "B"}, {"text": "C"}]}, {"choices": ["B"]},
    {"choices": [{"text": ["B"]}]}, {"choices": [{"text": "B", "token_ids": [8, "9"]}]},
    {"choices": [{"text": "B", "token_ids": [True]}]}, {"choices": [{"text": "B"}], "usage": [1]},
])  # fmt: skip
def test_merging_an_answer_of_another_shape_is_a_value_error(decode: Any) -> None:
    with pytest.raises(ValueError, match="^Decode's answer"):
        merged_body(first_of(prefill_answer()), decode, {**GREEDY, "return_token_ids": True})


@pytest.mark.parametrize("raw", [
    b"data: [1]\n\n", b"data: {\"choices\": 5}\n\n", b"data: {\"choices\": [5]}\n\n",
    b"data: {\"choices\": [{\"text\": 5}]}\n\n", b"data: not json\n\n", b"data: " + b"[" * 100_000 + b"\n\n",
])  # fmt: skip
def test_rewriting_an_event_of_another_shape_is_a_value_error(raw: bytes) -> None:
    with pytest.raises(ValueError, match="^Decode's stream"):
        StreamRewriter(first_of(prefill_answer())).feed(raw)


def test_a_proxy_fault_before_the_first_token_is_counted_a_failure_not_a_client_gone() -> None:
    async def scenario(client: httpx.AsyncClient, engines: Engines) -> None:
        async def faulty(request: httpx.Request) -> httpx.Response:
            if request.url.host == "prefill":
                await engines(request)  # it took the request and asked for its targets
                raise RuntimeError("a fault of the proxy's own")  # not a transport error: nothing maps it
            return await engines(request)

        proxy = engines_as(client, faulty)
        from rd2h.proxy.first_flow import first_token_answer

        with pytest.raises(RuntimeError):
            await first_token_answer(proxy, "/v1/completions", GREEDY, {"x-request-id": "r"}, time.monotonic())
        record = (await client.get("/v1/rd2h/requests", headers=OPERATOR)).json()[-1]
        assert record["status"] == 500 and "RuntimeError" in record["error"]
        scrape = (await client.get("/metrics")).text
        assert metric(scrape, 'rd2h_proxy_errors_total{kind="proxy_failed"}') == 1
        await assert_ended(client, engines, "failed")

    run(scenario)
