"""``rd2h proxy`` sending Prefill its request at once, with Decode (``ProxyConfig.targets_url``):
Prefill's fields name where its targets come from, and only a signed ask gets them, signed by
the proxy, once every rendezvous is in (rd2h.proxy.early). The engines are test_proxy's."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
from test_proxy import OPERATOR, SECRET, Engines, run

from rd2h.vllm.params import MAX_WAIT, accept_late, accept_later, targets_ask

TARGETS = "/v1/rd2h/targets"
URL = "http://proxy/internal/v1/rd2h/targets"


def ask_for_targets(client: httpx.AsyncClient, engines: Engines, asked: asyncio.Event) -> asyncio.Task[httpx.Response]:
    """Prefill's ask for the targets of the one pending request; ``asked`` is set once its handler waits for them."""
    (pending,) = engines.public_proxy.pending.values()
    mark = pending.mark

    def marked(name: str) -> None:
        mark(name)
        if name == "targets_asked":  # the ask's handler goes on to wait, in this same turn
            asked.set()

    pending.mark = marked  # type: ignore[method-assign]
    rid = engines.prefill_bodies[0]["kv_transfer_params"]["rd2h"]["id"]
    return asyncio.create_task(client.post(TARGETS, json=targets_ask(SECRET, rid, time.time())))


def test_prefill_is_sent_at_once_and_a_signed_ask_gets_its_targets_once_decode_posted() -> None:
    async def scenario(client: httpx.AsyncClient, engines: Engines) -> None:
        engines.decode_hangs = True  # posts its rendezvous, then holds the request
        request = asyncio.create_task(client.post("/v1/completions", json={"model": "m", "prompt": ["a", "b"]}))
        await asyncio.wait_for(engines.prefilled.wait(), 5)
        (prefill,) = engines.prefill_bodies
        later = accept_later(SECRET, prefill["kv_transfer_params"]["rd2h"], "cmpl-x-1-abcdef12", time.time())
        assert later is not None and (later.url, later.prompt, later.wait) == (URL, 1, 60.0)
        answer = await client.post(TARGETS, json=targets_ask(SECRET, later.rid, time.time()))
        assert answer.status_code == 200
        (target,) = accept_late(SECRET, later, answer.json(), "cmpl-x-1-abcdef12", time.time())
        assert (target.ext_id, str(target.endpoint), target.first_block) == (f"{later.rid}-1-0", "127.0.0.1:5600/1", 1)
        record = (await client.get("/v1/rd2h/requests", headers=OPERATOR)).json()[-1]
        assert record["t"]["prefill_sent"] <= record["t"]["rendezvous_all"] <= record["t"]["targets_sent"]
        request.cancel()

    run(scenario, targets_url=URL)


def test_a_rendezvous_timeout_past_what_prefill_accepts_is_signed_as_its_most() -> None:
    async def scenario(client: httpx.AsyncClient, engines: Engines) -> None:
        engines.decode_hangs = True
        request = asyncio.create_task(client.post("/v1/completions", json={"model": "m", "prompt": "a"}))
        await asyncio.wait_for(engines.prefilled.wait(), 5)
        later = accept_later(SECRET, engines.prefill_bodies[0]["kv_transfer_params"]["rd2h"], "x", time.time())
        assert later is not None and later.wait == MAX_WAIT  # refused by Prefill above it
        request.cancel()

    run(scenario, targets_url=URL, rendezvous_timeout=3600)


def test_a_rendezvous_that_never_comes_fails_the_request_and_tells_prefill_no_targets_come() -> None:
    async def scenario(client: httpx.AsyncClient, engines: Engines) -> None:
        engines.decode_hangs = "silent"
        request = asyncio.create_task(client.post("/v1/completions", json={"model": "m", "prompt": "a"}))
        await asyncio.wait_for(engines.prefilled.wait(), 5)  # sent before any rendezvous
        rid = engines.prefill_bodies[0]["kv_transfer_params"]["rd2h"]["id"]
        answer = await client.post(TARGETS, json=targets_ask(SECRET, rid, time.time()))
        assert answer.status_code == 410 and "did not post a rendezvous within 0.2 s" in answer.text
        response = await request
        assert response.status_code == 502 and (await client.get("/health")).json()["pending"] == 0
        late = await client.post(TARGETS, json=targets_ask(SECRET, rid, time.time()))
        assert late.status_code == 404  # the request ended: nothing waits under its id

    run(scenario, targets_url=URL, rendezvous_timeout=0.2)


def test_an_ask_not_signed_with_the_secret_is_refused() -> None:
    async def scenario(client: httpx.AsyncClient, engines: Engines) -> None:
        engines.decode_hangs = True
        request = asyncio.create_task(client.post("/v1/completions", json={"model": "m", "prompt": "a"}))
        await asyncio.wait_for(engines.prefilled.wait(), 5)
        rid = engines.prefill_bodies[0]["kv_transfer_params"]["rd2h"]["id"]
        forged: list[Any] = [
            targets_ask(b"not-the-shared-secret-0123456789", rid, time.time()),
            {k: v for k, v in targets_ask(SECRET, rid, time.time()).items() if k != "sig"},
            {**targets_ask(SECRET, rid, time.time()), "id": "0" * 32},
        ]
        for body in forged:
            answer = await client.post(TARGETS, json=body)
            assert answer.status_code == 403, body
        assert 'rd2h_proxy_errors_total{kind="targets_refused"} 3.0' in (await client.get("/metrics")).text
        request.cancel()

    run(scenario, targets_url=URL)


def test_the_cli_names_prefill_the_internal_listener_only_with_prefill_at_once() -> None:
    import argparse
    import socket

    import pytest

    from rd2h.cli.commands.proxy import add_parser, targets_url
    from rd2h.errors import ConfigError
    from rd2h.proxy.early import TARGETS_PATH

    parser = add_parser(argparse.ArgumentParser().add_subparsers())

    def url(*argv: str) -> str | None:
        return targets_url(parser.parse_args(["--prefill", "http://p:1", "--decode", "http://d:2", *argv]), 8001,
                           TARGETS_PATH)  # fmt: skip

    assert url() is None  # the sequential flow
    assert url("--prefill-at-once") == "http://127.0.0.1:8001" + TARGETS_PATH
    assert url("--prefill-at-once", "--rendezvous-host", "0.0.0.0") == f"http://{socket.getfqdn()}:8001{TARGETS_PATH}"
    assert url("--prefill-at-once", "--rendezvous-host", "fd00::1") == "http://[fd00::1]:8001" + TARGETS_PATH
    assert url("--prefill-at-once", "--internal-url", "http://lb:9/") == "http://lb:9" + TARGETS_PATH
    with pytest.raises(ConfigError, match="only with --prefill-at-once"):
        url("--internal-url", "http://lb:9")  # it would do nothing: refused, not ignored


def test_a_decode_that_fails_while_prefill_asks_for_targets_tells_prefill_no_targets_come() -> None:
    """Decode answers an error while Prefill's ask waits: the request ends, and the ask is
    answered 410 (Prefill frees its blocks), not cut off by the Prefill task's cancellation."""

    async def scenario(client: httpx.AsyncClient, engines: Engines) -> None:
        asked = asyncio.Event()

        async def failing(request: httpx.Request) -> httpx.Response:
            if request.url.host == "decode" and request.method == "POST":
                await asyncio.wait_for(asked.wait(), 5)  # Prefill's ask is in and waits
                return httpx.Response(500, json={"error": {"message": "boom"}})
            return await engines(request)

        proxy = engines.public_proxy
        proxy.client = httpx.AsyncClient(transport=httpx.MockTransport(failing))
        request = asyncio.create_task(client.post("/v1/completions", json={"model": "m", "prompt": "a"}))
        await asyncio.wait_for(engines.prefilled.wait(), 5)
        ask = ask_for_targets(client, engines, asked)
        response = await asyncio.wait_for(request, 5)
        assert response.status_code == 500 and "boom" in response.text
        answer = await asyncio.wait_for(ask, 5)
        assert answer.status_code == 410 and "no targets" in answer.text
        assert (await client.get("/health")).json()["pending"] == 0

    run(scenario, targets_url=URL)
