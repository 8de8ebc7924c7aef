"""Fixtures shared by the test suite."""

from __future__ import annotations

import random
import socket

import pytest


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
