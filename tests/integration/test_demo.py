"""The whole pull flow across processes: Prefill and Decode TP ranks as real processes,
real zmq sockets, the local engine, every destination byte verified."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rd2h.cli.demo.runner import DemoFailed, run_demo
from rd2h.cli.demo.workload import DemoConfig, Workload
from rd2h.errors import BackendNotFoundError, PortInUseError, TopologyError

pytestmark = pytest.mark.slow

RD2H = str(Path(sys.executable).with_name("rd2h"))


def _small(**overrides: object) -> DemoConfig:
    base = dict(layers=4, requests=3, max_tokens=512, block_size=32, chunk_tokens=256, slots=2, timeout=60.0)
    base.update(overrides)
    return DemoConfig(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 1), (2, 1), (4, 2), (8, 2), (2, 4)])
def test_topologies_verify_every_byte(prefill_tp: int, decode_tp: int, kv_port: int) -> None:
    config = _small(prefill_tp=prefill_tp, decode_tp=decode_tp, kv_port=kv_port)
    result = run_demo(config)
    assert result.problems == []
    assert result.verified
    work = Workload.build(config)
    assert result.bytes == work.main_bytes() + work.indexer_bytes()
    assert result.steps > 1  # chunked prefill took several steps


def test_progress_counts_every_layer_in_fewer_messages(kv_port: int) -> None:
    """Progress reaches the total (every layer of every step) and is batched: not one
    message per layer."""
    config = _small(layers=200, requests=1, max_tokens=32, block_size=32, chunk_tokens=32, slots=1, kv_port=kv_port)
    seen: list[tuple[int, int]] = []
    result = run_demo(config, progress=lambda done, total: seen.append((done, total)))
    assert result.verified, result.problems
    total = config.layers * result.steps
    assert seen[-1] == (total, total)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
    assert len(seen) < total  # one message per layer would make it equal


def test_one_slot_reused_by_every_layer(kv_port: int) -> None:
    result = run_demo(_small(prefill_tp=2, decode_tp=2, layers=6, slots=1, kv_port=kv_port))
    assert result.verified, result.problems


def test_zero_block_ranks_still_acknowledge(kv_port: int) -> None:
    # one-block prompts: a Decode rank owns no main block, a contributor no indexer block
    config = _small(prefill_tp=4, decode_tp=2, max_tokens=8, block_size=32, chunk_tokens=8, kv_port=kv_port)
    assert all(r.num_blocks == 1 for r in Workload.build(config).requests)
    result = run_demo(config)
    assert result.verified, result.problems


def test_a_dying_child_fails_the_demo_fast_and_leaves_no_orphans(kv_port: int) -> None:
    config = _small(prefill_tp=2, decode_tp=2, layers=64, requests=8, max_tokens=8192, kv_port=kv_port)
    outcome: list[BaseException | object] = []
    moving = threading.Event()  # set once a layer was read: the run is under way

    def run() -> None:
        try:
            outcome.append(run_demo(config, progress=lambda done, total: moving.set()))
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            outcome.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    assert moving.wait(60), "the demo never got going"
    victim = next((c for c in multiprocessing.active_children() if c.name == "decode-1"), None)
    assert victim is not None
    killed_at = time.monotonic()
    os.kill(victim.pid, signal.SIGKILL)
    thread.join(30)
    assert not thread.is_alive()
    assert time.monotonic() - killed_at < 10
    assert isinstance(outcome[0], DemoFailed), outcome
    assert "decode rank 1 was killed by signal 9" in str(outcome[0])
    assert multiprocessing.active_children() == []


def test_a_stopped_child_fails_the_demo_naming_it_and_is_killed(kv_port: int) -> None:
    """Issue 9 D1: a SIGSTOPped child stopped the demo for ever: SIGTERM does not reach a
    stopped process, nothing killed it, and the message named the rank that timed out
    waiting for it, not the stopped one."""
    config = _small(prefill_tp=1, decode_tp=1, layers=64, requests=4, max_tokens=2048, kv_port=kv_port)
    outcome: list[BaseException | object] = []

    def run() -> None:
        try:
            outcome.append(run_demo(config))
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            outcome.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    victim = None
    deadline = time.monotonic() + 60
    while victim is None and time.monotonic() < deadline:
        victim = next((c for c in multiprocessing.active_children() if c.name == "prefill-0"), None)
        thread.join(0.01)  # a short wait for the child to appear
    assert victim is not None
    os.kill(victim.pid, signal.SIGSTOP)
    thread.join(60)
    assert not thread.is_alive()
    assert isinstance(outcome[0], DemoFailed), outcome
    assert "prefill rank 0" in str(outcome[0]) and "stopped" in str(outcome[0])
    assert multiprocessing.active_children() == []


def test_bad_input_is_refused_before_any_process_starts(kv_port: int) -> None:
    with pytest.raises(TopologyError, match="divide"):
        DemoConfig(prefill_tp=3, decode_tp=2)
    with pytest.raises(BackendNotFoundError, match="nosuch"):
        run_demo(_small(engine="nosuch", kv_port=kv_port))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", kv_port + 1))
        taken.listen()
        with pytest.raises(PortInUseError, match=f"{kv_port + 1}"):
            run_demo(_small(decode_tp=2, kv_port=kv_port))
    assert multiprocessing.active_children() == []


def test_cli_json_and_exit_status(kv_port: int) -> None:
    args = [RD2H, "demo", "--json", "--prefill-tp", "2", "--decode-tp", "1", "--layers", "3",
            "--requests", "2", "--max-tokens", "256", "--kv-port", str(kv_port)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["verified"] is True and report["bytes"] > 0 and report["gbps"] > 0
    for key in ("seconds", "prefill_tp", "decode_tp", "layers", "requests", "engine"):
        assert key in report
    bad = subprocess.run([RD2H, "demo", "--prefill-tp", "3", "--decode-tp", "2"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2
    assert bad.stderr.startswith("rd2h: error:") and "Traceback" not in bad.stderr


def test_cli_table_shows_the_summary(kv_port: int) -> None:
    args = [RD2H, "demo", "--prefill-tp", "1", "--decode-tp", "1", "--layers", "2",
            "--requests", "1", "--max-tokens", "128", "--kv-port", str(kv_port)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for label in ("verified", "bytes moved", "GB/s", "p50", "p99", "exposed transfer"):
        assert label in done.stdout
    assert "layers announced" in done.stderr  # progress while it ran
