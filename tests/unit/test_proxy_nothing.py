"""``rd2h proxy`` when Decode loads nothing of a prompt (rd2h.vllm.nothing): its signed rendezvous
says ``nothing`` and names no endpoint. The prompt counts as heard; a request Decode loads nothing
of sends no Prefill leg, or cancels the one sent at once, whose ask for targets gets 410. Before,
the proxy refused such a rendezvous and waited out ``rendezvous_timeout``. The engines are
test_proxy's, with a Decode that posts ``nothing`` for the prompts it is told to."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
from test_proxy import OPERATOR, RENDEZVOUS, SECRET, Engines, run

from rd2h.vllm.params import accept_later, accept_prefill, targets_ask
from rd2h.vllm.vouch import sign, verify

TARGETS = "/v1/rd2h/targets"
URL = "http://proxy/internal/v1/rd2h/targets"


class NothingEngines(Engines):
    """Decode posts ``nothing`` for the prompts in ``nothing`` and a pull rendezvous for the others;
    it answers once Prefill was called when some prompt pulls, else at once, or never (``hold``).
    A Prefill asked at once (``prefill_holds``) holds its leg until the proxy cancels it."""

    def __init__(self, proxy: httpx.AsyncClient, nothing: set[int]) -> None:
        super().__init__(proxy)
        self.nothing, self.hold, self.prefill_holds = nothing, False, False
        self.prefill_cancelled = asyncio.Event()
        self.answers: list[int] = []  # the proxy's status for each rendezvous

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.method == "POST" else {}
        if request.url.host == "prefill" and self.prefill_holds:
            self.prefill_bodies.append(body)
            self.prefilled.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.prefill_cancelled.set()
                raise
        if request.url.host != "decode" or "kv_transfer_params" not in body:
            return await super().__call__(request)
        self.decode_bodies.append(body)
        self.decode_seen.set()
        ours = verify(SECRET, body["kv_transfer_params"]["rd2h"], time.time())
        for prompt in range(ours["prompts"]):
            ext_id = f"{ours['id']}-{prompt}-0"
            said = ({"ext_id": ext_id, "nothing": "short_prompt", "num_tokens": 1, "mode": "dense"}
                    if prompt in self.nothing else
                    {"ext_id": ext_id, "endpoint": "127.0.0.1:5600/1", "first_block": prompt, "num_tokens": 40})
            self.answers.append((await self.proxy.post(RENDEZVOUS, json=sign(SECRET, said, time.time()))).status_code)
        if self.hold:
            await asyncio.Event().wait()
        if len(self.nothing) < ours["prompts"]:
            await asyncio.wait_for(self.prefilled.wait(), 5)
        return self._answer(body, ours["prompts"], "decoded", ready=None)


def run_nothing(scenario: Any, nothing: set[int], **config: Any) -> Any:
    async def wrapped(client: httpx.AsyncClient, _engines: Engines) -> Any:
        engines = NothingEngines(client, nothing)
        engines.public_proxy = _engines.public_proxy
        engines.public_proxy.client = httpx.AsyncClient(transport=httpx.MockTransport(engines))
        return await scenario(client, engines)

    return run(wrapped, **config)


async def _record(client: httpx.AsyncClient) -> dict[str, Any]:
    return (await client.get("/v1/rd2h/requests", headers=OPERATOR)).json()[-1]


def test_a_request_decode_loads_nothing_of_gets_no_prefill_leg_and_no_timeout() -> None:
    """The rendezvous timeout is far off: a proxy that waited for it would not answer in time."""
    async def scenario(client: httpx.AsyncClient, engines: NothingEngines) -> None:
        response = await asyncio.wait_for(client.post("/v1/completions", json={"model": "m", "prompt": "a"}), 30)
        assert response.status_code == 200 and engines.answers == [200]
        assert engines.prefill_bodies == []  # nothing to compute for Decode: Prefill never asked
        record = await _record(client)
        assert record["status"] == 200 and record["prefill"] == "skipped: Decode loads nothing"
        assert record["children"] == [{"nothing": "short_prompt", "num_tokens": 1}]
        text = (await client.get("/metrics")).text
        assert "rd2h_proxy_prefill_skipped_total 1.0" in text and "rendezvous_refused" not in text
        assert (await client.get("/health")).json()["pending"] == 0

    run_nothing(scenario, {0}, rendezvous_timeout=3600)


def test_a_prompt_list_sends_prefill_targets_only_for_the_prompts_decode_pulls() -> None:
    async def scenario(client: httpx.AsyncClient, engines: NothingEngines) -> None:
        response = await client.post("/v1/completions", json={"model": "m", "prompt": ["a", "b"]})
        assert response.status_code == 200 and engines.answers == [200, 200]
        (prefill,) = engines.prefill_bodies
        fields = prefill["kv_transfer_params"]["rd2h"]
        assert accept_prefill(SECRET, fields, "cmpl-x-0-abcdef12", time.time()) == []  # computed, sent nowhere
        (target,) = accept_prefill(SECRET, fields, "cmpl-x-1-abcdef12", time.time())
        assert (str(target.endpoint), target.first_block) == ("127.0.0.1:5600/1", 1)
        assert "prefill" not in await _record(client)

    run_nothing(scenario, {0})


def test_prefill_asked_at_once_is_cancelled_and_its_ask_for_targets_gets_410() -> None:
    async def scenario(client: httpx.AsyncClient, engines: NothingEngines) -> None:
        engines.prefill_holds = True
        response = await client.post("/v1/completions", json={"model": "m", "prompt": "a"})
        assert response.status_code == 200
        await asyncio.wait_for(engines.prefill_cancelled.wait(), 5)  # vLLM aborts it: its blocks are freed
        assert (await _record(client))["prefill"] == "cancelled: Decode loads nothing"

    run_nothing(scenario, {0}, targets_url=URL, rendezvous_timeout=3600)


def test_a_prefill_that_asks_for_targets_decode_will_never_pull_gets_410() -> None:
    async def scenario(client: httpx.AsyncClient, engines: NothingEngines) -> None:
        engines.hold = True  # Decode posted ``nothing``, then holds the request
        request = asyncio.create_task(client.post("/v1/completions", json={"model": "m", "prompt": "a"}))
        await asyncio.wait_for(engines.prefilled.wait(), 5)
        later = accept_later(SECRET, engines.prefill_bodies[0]["kv_transfer_params"]["rd2h"], "x", time.time())
        assert later is not None
        ask = client.post(TARGETS, json=targets_ask(SECRET, later.rid, time.time()))
        answer = await asyncio.wait_for(ask, 30)  # the rendezvous timeout is far off
        assert answer.status_code == 410 and "Decode loads nothing" in answer.text  # not held until the wait
        request.cancel()

    run_nothing(scenario, {0}, targets_url=URL, rendezvous_timeout=3600)


def test_a_nothing_rendezvous_is_heard_only_signed_and_well_formed() -> None:
    async def scenario(client: httpx.AsyncClient, engines: NothingEngines) -> None:
        engines.hold, engines.nothing = True, set()
        request = asyncio.create_task(client.post("/v1/completions", json={"model": "m", "prompt": "a"}))
        await asyncio.wait_for(engines.decode_seen.wait(), 5)
        rid = verify(SECRET, engines.decode_bodies[0]["kv_transfer_params"]["rd2h"], time.time())["id"]
        said = {"ext_id": f"{rid}-0-0", "nothing": "short_prompt"}
        for forged in (sign(b"not-the-shared-secret-0123456789", said, time.time()),
                       sign(SECRET, {**said, "nothing": 1}, time.time())):
            assert (await client.post(RENDEZVOUS, json=forged)).status_code == 403
        assert 'rd2h_proxy_errors_total{kind="rendezvous_refused"} 2.0' in (await client.get("/metrics")).text
        assert (await client.post(RENDEZVOUS, json=sign(SECRET, said, time.time()))).status_code == 200  # signed
        request.cancel()

    run_nothing(scenario, set(), rendezvous_timeout=3600)

