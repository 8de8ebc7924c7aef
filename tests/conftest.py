"""Fixtures shared by the test suite."""

from __future__ import annotations

import random
import socket
import sys
from pathlib import Path

import pytest

# the test-only vLLM connector (tests/kit/vllm/rd2h_test_connector.py), for the worker tests
VLLM_KIT = Path(__file__).parent / "kit" / "vllm"
sys.path.insert(0, str(VLLM_KIT))


def _free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_base_port(count: int) -> int:
    """A base port with ``count`` consecutive free ports above it (Decode TP ranks)."""
    for _ in range(200):
        base = random.randrange(20000, 60000 - count)
        if all(_free(base + i) for i in range(count)):
            return base
    raise RuntimeError("no free port range found")


@pytest.fixture
def kv_port() -> int:
    return free_base_port(8)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[object]) -> object:
    """On a failed end-to-end test, the tails of every engine's and the proxy's log go into the
    report: a 500 from an engine says nothing by itself, and CI keeps no temporary files."""
    report = yield
    clusters = sys.modules.get("vllm_cluster")  # loaded only where tests/e2e runs
    if report.failed and clusters is not None:
        for cluster in clusters.live_clusters():
            for name, tail in cluster.log_tails(lines=80).items():
                report.sections.append((f"log {name}", tail))
    return report
