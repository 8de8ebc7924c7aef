"""``rd2h proxy`` as operators run it: the real command, real sockets on loopback, engines
played by small HTTP servers in this process. What only a process with listeners can show:
slow clients are cut off, SIGTERM drains, the two listeners are apart."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

SECRET = "rd2h-proxy-server-test-secret-0123"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Engine(ThreadingHTTPServer):
    """An engine that answers /health and holds each POST until ``release`` is set."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.received = threading.Event()
        self.release = threading.Event()
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: Engine

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self._answer({"status": "ok"})

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.server.received.set()
        self.server.release.wait(60)
        self._answer({"choices": [{"index": 0, "text": "decoded"}]})

    def _answer(self, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def start_proxy(engines: dict[str, Engine], log_path: Path, *args: str, internal: int | None = None) -> dict[str, Any]:
    port, internal = free_port(), internal or free_port()
    argv = [sys.executable, "-m", "rd2h.cli.main", "proxy", "--port", str(port), "--rendezvous-port", str(internal),
            "--prefill", engines["prefill"].url, "--decode", engines["decode"].url, "--header-timeout", "1",
            "--health-interval", "0.2", "--drain-timeout", "30", *args]
    log = open(log_path, "wb")  # noqa: SIM115 - closed by stop_proxy
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "RD2H_SECRET": SECRET})
    return {"url": f"http://127.0.0.1:{port}", "internal": f"http://127.0.0.1:{internal}", "port": port,
            "proc": proc, "log": log, "log_path": log_path, **engines}


def poll_health(proxy: dict[str, Any], until: Any, timeout: float = 30) -> httpx.Response:
    """``GET /health`` until ``until(response)`` (a bounded poll; fails if the proxy exits)."""
    tick = threading.Event()
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2) as client:
        while True:
            assert proxy["proc"].poll() is None, proxy["log_path"].read_text()
            try:
                response = client.get(proxy["url"] + "/health")
                if until(response):
                    return response
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, proxy["log_path"].read_text()
            tick.wait(0.05)


def stop_proxy(proxy: dict[str, Any]) -> None:
    for role in ("prefill", "decode"):
        proxy[role].release.set()
    proxy["proc"].kill()
    proxy["proc"].wait(10)
    proxy["log"].close()
    for role in ("prefill", "decode"):
        proxy[role].shutdown()


class PDEngine(Engine):
    """An engine that plays its part of a P/D request as vLLM with RD2HConnector does. Decode
    posts the request's signed rendezvous to the proxy's internal listener and answers once
    Prefill was called; Prefill holds each request until ``release`` is set."""

    def __init__(self, role: str, internal: str = "", peer: Engine | None = None) -> None:
        super().__init__()
        self.RequestHandlerClass = _PDHandler
        self.role, self.internal, self.peer = role, internal, peer


class _PDHandler(_Handler):
    server: PDEngine

    def do_POST(self) -> None:  # noqa: N802
        from rd2h.vllm.vouch import sign, verify

        body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
        self.server.received.set()
        if self.server.role == "prefill":
            self.server.release.wait(60)
            self._answer({"choices": [{"index": 0, "text": "x"}]})
            return
        ours = verify(SECRET.encode(), body["kv_transfer_params"]["rd2h"], time.time())
        rendezvous = sign(SECRET.encode(), {"ext_id": f"{ours['id']}-0-0", "endpoint": "127.0.0.1:5600/1",
                                            "first_block": 0}, time.time())
        assert httpx.post(self.server.internal + "/v1/rd2h/rendezvous", json=rendezvous, timeout=10).status_code == 200
        assert self.server.peer is not None and self.server.peer.received.wait(60)  # Prefill was called
        self._answer({"choices": [{"index": 0, "text": "decoded"}]})


def test_the_proxy_says_ready_only_after_a_warm_up_went_through_the_pair(tmp_path: Path) -> None:
    """Issue 21 item 4, as operators see it: /health stays 503 ("warming") while the warm-up
    request is on its way through the pair (held on Prefill here), and the log's 'rd2h proxy
    ready' line comes after the warm-up's own line."""
    internal = free_port()
    prefill = PDEngine("prefill")
    decode = PDEngine("decode", f"http://127.0.0.1:{internal}", peer=prefill)
    proxy = start_proxy({"prefill": prefill, "decode": decode}, tmp_path / "proxy.log", internal=internal)
    try:
        assert prefill.received.wait(30), proxy["log_path"].read_text()  # the warm-up reached Prefill
        health = poll_health(proxy, lambda r: True)
        assert health.status_code == 503 and health.json()["status"] == "warming", health.text
        assert "rd2h proxy ready" not in proxy["log_path"].read_text()
        prefill.release.set()
        health = poll_health(proxy, lambda r: r.status_code == 200)
        assert health.json()["warmup"]["ok"] == 1 and health.json()["warmup"]["pairs"][0]["warm"]
        log = proxy["log_path"].read_text()
        warmed = log.index(f"warm-up {prefill.url} -> {decode.url}: ")
        assert warmed < log.index("rd2h proxy ready: prefill " + prefill.url)
        metrics = httpx.get(proxy["internal"] + "/metrics", timeout=5).text
        assert 'rd2h_proxy_warmups_total{result="ok"} 1.0' in metrics and "rd2h_proxy_ready 1.0" in metrics
    finally:
        stop_proxy(proxy)


@pytest.fixture
def proxy(tmp_path: Path) -> Iterator[dict[str, Any]]:
    # these engines answer no rendezvous: no warm-up (test_proxy_warmup's engines do)
    proxy = start_proxy({"prefill": Engine(), "decode": Engine()}, tmp_path / "proxy.log", "--no-warmup")
    try:
        poll_health(proxy, lambda r: r.status_code == 200)
        yield proxy
    finally:
        stop_proxy(proxy)


def test_a_connection_that_does_not_finish_its_headers_is_closed_with_408(proxy: dict[str, Any]) -> None:
    with socket.create_connection(("127.0.0.1", proxy["port"]), timeout=20) as slow:
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and nothing more
        answer = slow.recv(1024)  # the header deadline (1 s) answers; the socket timeout is only a bound
        assert answer.startswith(b"HTTP/1.1 408")
        assert slow.recv(1024) == b""  # and closed
    with httpx.Client(timeout=5) as client:  # others are served meanwhile
        assert client.get(proxy["url"] + "/health").status_code == 200


def test_the_listeners_are_apart(proxy: dict[str, Any]) -> None:
    with httpx.Client(timeout=5) as client:
        assert client.post(proxy["url"] + "/v1/rd2h/rendezvous", json={}).status_code == 404
        assert client.post(proxy["internal"] + "/v1/rd2h/rendezvous", json={}).status_code == 403  # unsigned
        assert client.post(proxy["internal"] + "/v1/completions", json={}).status_code == 404
        assert "rd2h_proxy_requests_total" in client.get(proxy["internal"] + "/metrics").text


def test_sigterm_drains_what_is_in_flight_then_exits(proxy: dict[str, Any]) -> None:
    result: dict[str, Any] = {}

    def client() -> None:
        body = {"model": "m", "prompt": "a", "max_tokens": 2}
        result["response"] = httpx.post(proxy["url"] + "/v1/completions", json=body, timeout=60)

    thread = threading.Thread(target=client)
    thread.start()
    assert proxy["decode"].received.wait(30)  # the request is in flight on Decode
    proxy["proc"].send_signal(signal.SIGTERM)
    with httpx.Client(timeout=5) as probe:
        for _ in range(600):  # a bounded poll: the internal listener says it drains
            health = probe.get(proxy["internal"] + "/health")
            if health.json()["status"] == "draining":
                break
            proxy["decode"].received.wait(0.05)
        assert health.status_code == 503
        try:  # nothing new is taken: refused with 503 until the listener closes, then not connected
            refused = probe.post(proxy["url"] + "/v1/completions", json={"model": "m", "prompt": "b"})
        except httpx.ConnectError:
            pass
        else:
            assert refused.status_code == 503 and "shutting down" in refused.text
    assert proxy["proc"].poll() is None  # still serving what it holds
    proxy["decode"].release.set()
    thread.join(30)
    assert result["response"].status_code == 200 and result["response"].json()["choices"][0]["text"] == "decoded"
    assert proxy["proc"].wait(30) == 0
