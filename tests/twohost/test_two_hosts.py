"""Prefill and Decode on two "hosts": two network namespaces joined by a veth pair (root only).

For each cross-host engine: an SFA-like multi-layer workload through ``rd2h demo``'s ranks placed
in the namespaces (Prefill TP 2 -> Decode TP 1 and 1 -> 2), every byte verified; then one
long-lived Prefill and one Decode process, a request pulled, the link cut in the middle of the
next one (both sides must fail it within their timeouts), the link restored and a third
request pulled, verified.

CI runs as root, where this must run (it fails loudly if namespaces cannot be made); elsewhere
it is skipped with the reason.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rd2h.cli.demo.runner import run_demo
from rd2h.cli.demo.workload import DemoConfig

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from netns import DEVICE, TwoHosts, why_not  # noqa: E402
from sides import MARK  # noqa: E402

pytestmark = pytest.mark.slow

# Engine options on both sides, then Prefill's and Decode's own (each engine's address).
# nixl: UCX over TCP on the veth (without UCX_TLS it would take cma, which crosses namespaces).
ENGINES: dict[str, Any] = {
    "mooncake": lambda h: (
        {"timeout": 10.0, "transfer_timeout_s": 3, "progress_timeout_s": 2},
        {"hostname": h.prefill_addr},
        {"hostname": h.decode_addr},
    ),
    "nixl": lambda h: ({"timeout": 3.0, "ucx_tls": "tcp"}, {}, {}),
}
ENV = {"UCX_NET_DEVICES": DEVICE}
# The zmq channel refuses a listener off loopback without CURVE; these namespaces are ours alone.
CHANNEL = {"allow_insecure": True}
REPLY_TIMEOUT = 8.0  # Prefill fails a request whose Decode has not replied by then
DECODE_BOUND = 8.0  # Decode must fail a read over a cut link by then (engine timeouts + a probe)


@pytest.fixture(scope="module")
def hosts() -> Iterator[TwoHosts]:
    reason = why_not()
    if reason:
        if os.environ.get("CI"):
            pytest.fail(f"the two-host test must run in CI, but namespaces cannot be made: {reason}")
        pytest.skip(f"two network namespaces cannot be made here: {reason}")
    with TwoHosts(f"{os.getpid() % 100000}", 10 + os.getpid() % 200) as h:
        yield h


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in ENV.items():
        monkeypatch.setenv(key, value)


@pytest.mark.parametrize("tp", [(2, 1), (1, 2)], ids=["p2-d1", "p1-d2"])
@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_sfa_workload_across_hosts(hosts: TwoHosts, env: None, engine: str, tp: tuple[int, int]) -> None:
    both, prefill, decode = ENGINES[engine](hosts)
    config = DemoConfig(
        prefill_tp=tp[0], decode_tp=tp[1], layers=8, requests=4, max_tokens=1024, engine=engine,
        engine_options=both, prefill_engine_options=prefill, decode_engine_options=decode,
        host=hosts.decode_addr, prefill_netns=hosts.prefill, decode_netns=hosts.decode, timeout=60,
        channel_options=CHANNEL,
    )  # fmt: skip
    result = run_demo(config)
    assert result.verified, result.problems[:5]
    assert result.bytes > 0


class Side:
    """A sides.py process in a namespace, driven one JSON line at a time."""

    def __init__(self, hosts: TwoHosts, role: str, conf: dict[str, Any]) -> None:
        ns = hosts.prefill if role == "prefill" else hosts.decode
        argv = [sys.executable, str(HERE / "sides.py"), role, json.dumps(conf)]
        self.proc = subprocess.Popen(
            hosts.command(ns, argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env={**os.environ, **ENV}, text=True,
        )  # fmt: skip
        self.role = role
        self.answer(60)

    def answer(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0 and select.select([self.proc.stdout], [], [], left)[0]:
            line = self.proc.stdout.readline()
            if not line:
                break
            if line.startswith(MARK):
                return json.loads(line[len(MARK) :])
        self.proc.kill()
        raise AssertionError(f"{self.role} side gave no answer within {timeout} s:\n{self.proc.stderr.read()[-3000:]}")

    def ask(self, timeout: float = 30, **msg: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        return self.answer(timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.ask(timeout=20, cmd="exit")
            except (AssertionError, OSError):
                pass
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc.kill()
        self.proc.wait()


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_cut_link_fails_cleanly_and_a_restored_link_serves(hosts: TwoHosts, engine: str) -> None:
    both, prefill_opts, decode_opts = ENGINES[engine](hosts)
    layers, blocks, per = 12, 1024, 320  # blocks per request: 12 x 320 x 19.5 KiB = 73 MiB
    conf = {"layers": layers, "blocks": blocks, "block_size": 16, "engine": engine, "kv_port": 5800,
            "decode_host": hosts.decode_addr, "reply_timeout": REPLY_TIMEOUT, "request_timeout": 60.0,
            "channel_options": CHANNEL}
    decode = Side(hosts, "decode", {**conf, "engine_options": {**both, **decode_opts}})
    prefill = None
    try:
        prefill = Side(hosts, "prefill", {**conf, "engine_options": {**both, **prefill_opts}})
        src = {r: list(range(i * per, (i + 1) * per)) for i, r in enumerate(("r1", "r2", "r3"))}
        dst = {r: list(reversed(ids)) for r, ids in src.items()}

        def pull(rid: str) -> None:
            decode.ask(cmd="expect", id=rid, blocks=dst[rid])
            assert prefill.ask(cmd="send", id=rid, blocks=src[rid])["sent"]

        pull("r1")
        assert decode.ask(cmd="wait", id="r1", within=30)["ok"]
        assert prefill.ask(cmd="wait", id="r1", within=30)["ok"]
        assert decode.ask(cmd="verify", id="r1", blocks=dst["r1"], src=src["r1"])["verified"]

        before = decode.ask(cmd="bytes")["bytes"]
        pull("r2")
        deadline = time.monotonic() + 10
        while decode.ask(cmd="bytes")["bytes"] == before:  # cut once the first layer of r2 moved
            assert time.monotonic() < deadline, "r2 never started"
        hosts.cut()
        try:
            d = decode.ask(cmd="wait", id="r2", within=DECODE_BOUND + 5, timeout=DECODE_BOUND + 15)
            p = prefill.ask(cmd="wait", id="r2", within=REPLY_TIMEOUT + 10, timeout=REPLY_TIMEOUT + 20)
        finally:
            hosts.restore()
        print(f"{engine}: cut link: Decode {d}; Prefill {p}")  # the measured failure behaviour (pytest -s)
        assert d["state"] == "failed" and d["seconds"] < DECODE_BOUND, d
        assert p["state"] == "failed" and p["seconds"] < REPLY_TIMEOUT + 5, p
        moved = decode.ask(cmd="bytes")["bytes"] - before
        assert 0 < moved, "the cut came before r2 moved"

        pull("r3")
        d3 = decode.ask(cmd="wait", id="r3", within=60, timeout=70)
        assert d3["ok"], d3
        assert prefill.ask(cmd="wait", id="r3", within=60, timeout=70)["ok"]
        assert decode.ask(cmd="verify", id="r3", blocks=dst["r3"], src=src["r3"])["verified"]
    finally:
        for side in (prefill, decode):
            if side is not None:
                side.close()


def test_operator_reproduces_it_with_rd2h_demo(hosts: TwoHosts, env: None) -> None:
    """The command line an operator runs for the same placement (docs/backends.md shows it)."""
    argv = [
        str(Path(sys.executable).with_name("rd2h")), "demo", "--json", "--engine", "mooncake",
        "--prefill-tp", "2", "--decode-tp", "1", "--layers", "4", "--requests", "2", "--max-tokens", "512",
        "--host", hosts.decode_addr, "--prefill-netns", hosts.prefill, "--decode-netns", hosts.decode,
        "--channel-option", "allow_insecure=true",
        "--engine-option", "timeout=10", "--engine-option", "transfer_timeout_s=3", "--engine-option", "progress_timeout_s=2",
        "--prefill-option", f"hostname={hosts.prefill_addr}", "--decode-option", f"hostname={hosts.decode_addr}",
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["verified"] and result["engine"] == "mooncake" and result["bytes"] > 0


def test_each_side_gets_its_own_engine_options_over_the_shared_ones() -> None:
    config = DemoConfig(
        engine_options={"timeout": 5, "hostname": "10.0.0.9"},
        prefill_engine_options={"hostname": "10.231.9.1"}, decode_engine_options={"extra": 1},
    )  # fmt: skip
    assert config.options_for("prefill") == {"timeout": 5, "hostname": "10.231.9.1"}
    assert config.options_for("decode") == {"timeout": 5, "hostname": "10.0.0.9", "extra": 1}


def test_bench_cross_host_runs_once_at_a_tiny_size(hosts: TwoHosts, tmp_path: Path) -> None:
    """bench/cross_host.py (its own namespaces) completes, verifies and writes its JSON."""
    out = tmp_path / "cross.json"
    argv = [sys.executable, str(HERE.parents[1] / "bench" / "cross_host.py"), "--repeat", "1", "--layers", "2",
            "--requests", "1", "--max-tokens", "256", "--iperf-seconds", "1", "--json", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["iperf3_gbps"]["median"] > 0
    assert set(report["engines"]) == {"mooncake", "nixl"}
    assert all(e["read_gbps"] > 0 and e["runs"][0]["bytes"] > 0 for e in report["engines"].values())
