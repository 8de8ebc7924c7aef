"""The proxy's warm-up (rd2h.proxy.warmup) and readiness (rd2h.proxy.readiness), in process:
the two ASGI apps over httpx's ASGI transport and engines that behave as vLLM with
RD2HConnector does (``test_proxy.Engines``: Decode posts its signed rendezvous, then waits
for Prefill). The health checks and warm-up rounds are driven by the test (no timer runs),
and every wait is on an event with a timeout."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from test_proxy import OPERATOR, Engines, run

from rd2h.proxy.instances import Instance, Pool
from rd2h.proxy.warmup import MAX_BACKOFF, PairTable, warm_up_pairs


class HeldEngines(Engines):
    """Prefill holds each request until ``release`` is set; ``computes_itself``: Decode answers
    without a rendezvous, as one that refused the proxy's kv_transfer_params does."""

    def __init__(self, proxy: httpx.AsyncClient, **kwargs: Any) -> None:
        super().__init__(proxy, **kwargs)
        self.release = asyncio.Event()
        self.release.set()
        self.prefill_reached = asyncio.Event()
        self.computes_itself = False

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.method == "POST" and request.url.host == "prefill":
            self.prefill_reached.set()
            await asyncio.wait_for(self.release.wait(), 10)
        if request.method == "POST" and request.url.host != "prefill" and self.computes_itself:
            body = json.loads(request.content)
            self.decode_bodies.append(body)
            return self._answer(body, 1, "computed", ready=None)
        return await super().__call__(request)


def run_warm(scenario: Any, **config: Any) -> Any:
    """``run`` with health checks configured (so warm-up is on) and HeldEngines; the scenario
    drives the checks and warm-up rounds itself."""
    async def wrapped(client: httpx.AsyncClient, engines: Engines) -> Any:
        held = HeldEngines(client)
        held.public, held.public_proxy = engines.public, engines.public_proxy
        engines.public_proxy.client = httpx.AsyncClient(transport=httpx.MockTransport(held))
        return await scenario(client, held, engines.public_proxy)

    return run(wrapped, **{"health_interval": 1.0, **config})


def metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_readiness_waits_for_a_warm_up_request_through_the_pair() -> None:
    async def scenario(client: httpx.AsyncClient, engines: HeldEngines, proxy: Any) -> None:
        health = await client.get("/health")
        assert health.status_code == 503 and not health.json()["ready"]  # nothing warmed yet
        await proxy.check_health()
        health = await client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "warming"  # both answer, neither warm
        engines.release.clear()
        warming = asyncio.create_task(warm_up_pairs(proxy))
        await asyncio.wait_for(engines.prefill_reached.wait(), 5)  # the warm-up is on Prefill, held there
        health = await client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "warming"
        assert proxy.decode_pool.pick() is None  # not in rotation while cold
        engines.release.set()
        await asyncio.wait_for(warming, 5)
        health = await client.get("/health")
        assert health.status_code == 200, health.text
        body = health.json()
        assert body["status"] == "ok" and body["warmup"]["ok"] == 1 and body["warmup"]["failed"] == 0
        (pair,) = body["warmup"]["pairs"]
        assert pair["warm"] and pair["warmup_ms"] >= 0
        assert all(i["warm"] for i in body["prefill"] + body["decode"])
        # the warm-up was a P/D request like a client's: Decode first, then Prefill's one token
        (decode,) = engines.decode_bodies
        (prefill,) = engines.prefill_bodies
        assert decode["kv_transfer_params"]["do_remote_prefill"] and prefill["max_tokens"] == 1
        assert "model" not in decode and decode["prompt"].startswith("rd2h warm-up ")
        record = (await client.get("/v1/rd2h/requests", headers=OPERATOR)).json()[-1]
        assert record["warmup"] is True and record["status"] == 200 and record["children"]
        text = (await client.get("/metrics")).text
        assert metric(text, 'rd2h_proxy_warmups_total{result="ok"}') == 1.0
        assert metric(text, "rd2h_proxy_ready") == 1.0
        assert metric(text, "rd2h_proxy_warmup_seconds_count") == 1.0
        assert "rd2h_proxy_requests_total{" not in text  # a warm-up is not a client request
        assert metric(text, "rd2h_proxy_ttft_seconds_count") == 0.0
        # a client's request now goes to the warm pair; only it counts as served
        engines.prefilled.clear()
        assert (await client.post("/v1/completions", json={"prompt": "a"})).status_code == 200
        assert [i.served for i in proxy.decode_pool.instances] == [1]

    run_warm(scenario)


def test_a_warm_up_that_transfers_nothing_fails_is_counted_and_backs_off() -> None:
    """A Decode that answers without posting a rendezvous computed the prompt itself (it refused
    the proxy's signed params: another secret): the pair is not warm, the reason is in /health
    and the log, and it is not tried again before its backoff."""
    async def scenario(client: httpx.AsyncClient, engines: HeldEngines, proxy: Any) -> None:
        engines.computes_itself = True
        await proxy.check_health()
        await asyncio.wait_for(warm_up_pairs(proxy), 5)
        health = await client.get("/health")
        assert health.status_code == 503
        (pair,) = health.json()["warmup"]["pairs"]
        assert not pair["warm"] and pair["failures"] == 1 and "without posting its rendezvous" in pair["error"]
        text = (await client.get("/metrics")).text
        assert metric(text, 'rd2h_proxy_warmups_total{result="failed"}') == 1.0
        assert "rd2h_proxy_errors_total{" not in text  # not a client's error
        record = (await client.get("/v1/rd2h/requests", headers=OPERATOR)).json()[-1]
        assert record["warmup"] and "rendezvous" in record["error"] and not proxy.pending
        await asyncio.wait_for(warm_up_pairs(proxy), 5)  # within the backoff: not tried
        assert len(engines.decode_bodies) == 1
        # past the backoff, with a Decode that now transfers: warm
        engines.computes_itself = False
        for attempts in proxy.warmth.attempts.values():
            attempts.retry_at = 0.0
        await asyncio.wait_for(warm_up_pairs(proxy), 5)
        assert (await client.get("/health")).status_code == 200

    run_warm(scenario)


def test_an_engine_that_went_down_is_warmed_again_before_it_is_back_in_rotation() -> None:
    async def scenario(client: httpx.AsyncClient, engines: HeldEngines, proxy: Any) -> None:
        engines.down_answers = True
        await proxy.check_health()
        await asyncio.wait_for(warm_up_pairs(proxy), 5)
        d1, down, d2 = proxy.decode_pool.instances
        assert d1.in_rotation and down.in_rotation and d2.in_rotation and proxy.warmth.ok == 3
        engines.down_answers = False  # "down" stops answering (a restart): it leaves rotation, cold
        await proxy.check_health()
        assert not down.up and not down.warm
        engines.down_answers = True
        await proxy.check_health()
        assert down.up and not down.in_rotation  # answers again, not warm yet: gets no client request
        assert {proxy.decode_pool.pick().url for _ in range(4)} == {d1.url, d2.url}
        (cold,) = proxy.warmth.cold(proxy.prefill_pool.instances, proxy.decode_pool.instances, 0.0)
        assert cold[1] is down
        before = len(engines.decode_bodies)
        await asyncio.wait_for(warm_up_pairs(proxy), 5)
        assert len(engines.decode_bodies) == before + 1 and engines.decode_hosts[-1] == "down"  # pinned to it
        assert down.in_rotation and proxy.warmth.ok == 4
        assert all(p["warm"] for p in (await client.get("/health")).json()["warmup"]["pairs"])

    engines_answer = {"decode": ("http://d1", "http://down", "http://d2")}
    run_warm(scenario, **engines_answer)


def test_without_health_checks_or_with_warm_up_off_instances_are_in_rotation_when_up() -> None:
    async def scenario(client: httpx.AsyncClient, engines: Engines) -> None:
        health = await client.get("/health")
        assert health.status_code == 200 and health.json()["warmup"] == {"enabled": False, "ok": 0, "failed": 0,
                                                                         "pairs": []}

    run(scenario)  # health_interval 0: no checks, no warm-up
    run(scenario, health_interval=1.0, warmup=False)


def test_the_pair_table_keys_pairs_by_epoch_and_backs_off_to_a_minute() -> None:
    p, d = Instance("prefill", "http://p", warm=False), Instance("decode", "http://d", warm=False)
    table = PairTable(retry_after=2.0)
    assert table.cold([p], [d], 0.0) == [(p, d)]
    delays = [table.failed_once(p, d, "no", now=0.0) for _ in range(8)]
    assert delays[:4] == [2.0, 4.0, 8.0, 16.0] and delays[-1] == MAX_BACKOFF
    assert table.cold([p], [d], MAX_BACKOFF - 1) == [] and table.cold([p], [d], MAX_BACKOFF) == [(p, d)]
    table.succeeded(p, d, 0.5)
    assert table.cold([p], [d], 0.0) == [] and not table.attempts
    pool = Pool("decode", ["http://d"], warm_up=True)
    (d,) = pool.instances
    table.succeeded(p, d, 0.5)
    pool.mark_warm(d)
    pool.mark_down(d, "test")  # a new epoch: that warm-up was for a process that may be gone
    pool.mark_up(d)
    assert not d.warm and table.cold([p], [d], 0.0) == [(p, d)]
    table.succeeded(p, d, 0.5)
    assert len(table.warm) == 1  # older epochs forgotten


def test_cli_refuses_a_warm_up_timeout_that_is_not_positive(capsys: pytest.CaptureFixture[str]) -> None:
    from rd2h.cli.main import main

    code = main(["proxy", "--prefill", "http://p", "--decode", "http://d", "--warmup-timeout", "0"])
    assert code == 2 and "--warmup-timeout must be more than 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["proxy", "--help"])
    assert "--no-warmup" in capsys.readouterr().out


class SlowToStopPrefill(HeldEngines):
    """Prefill's leg, cancelled while held, takes until ``let_stop`` to end (``stopping`` says it began)."""

    def __init__(self, proxy: httpx.AsyncClient, **kwargs: Any) -> None:
        super().__init__(proxy, **kwargs)
        self.stopping, self.let_stop = asyncio.Event(), asyncio.Event()

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        try:
            return await super().__call__(request)
        except asyncio.CancelledError:
            if request.url.host == "prefill":
                self.stopping.set()
                await asyncio.wait_for(self.let_stop.wait(), 10)
            raise


def test_a_warm_up_cancelled_again_while_its_legs_stop_leaves_no_leg_running_and_nothing_pending() -> None:
    """The warm-up task is cancelled (its timeout, the proxy stopping) and cancelled again while it
    waits for Prefill's leg to stop: Decode's leg is stopped all the same and the request ends."""
    async def scenario(client: httpx.AsyncClient, engines: HeldEngines, proxy: Any) -> None:
        slow = SlowToStopPrefill(client)
        slow.public, slow.public_proxy = engines.public, engines.public_proxy
        proxy.client = httpx.AsyncClient(transport=httpx.MockTransport(slow))
        await proxy.check_health()
        slow.release.clear()
        warming = asyncio.create_task(warm_up_pairs(proxy))
        await asyncio.wait_for(slow.prefill_reached.wait(), 5)  # Decode posted, Prefill holds its leg
        (pending,) = proxy.pending.values()
        warming.cancel()
        await asyncio.wait_for(slow.stopping.wait(), 5)  # the cleanup waits for Prefill's leg to stop
        warming.cancel()  # and is cancelled again meanwhile
        slow.let_stop.set()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(warming, 5)
        assert not proxy.pending, "the warm-up request never ended"
        assert pending.record["status"] == 502 and pending.record["warmup"] is True

    run_warm(scenario)
