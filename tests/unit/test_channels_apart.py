"""One channel plugin does not depend on another: the connection bound's policy both socket
channels use lives in the core (``rd2h.connection_book``), so rd2h-tcp neither declares
rd2h-zmq nor imports it, and works in a process where rd2h_zmq cannot be imported."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[2]

_WITHOUT_ZMQ = """
import sys
sys.modules["rd2h_zmq"] = None  # importing it (or any of its modules) raises ImportError
from rd2h_tcp import TcpChannel
channel = TcpChannel()
listener = channel.listen("tcp://127.0.0.1:0")
dialer = channel.dialer()
try:
    dialer.send(listener.address, b"hello")
    got = listener.recv(30)
    assert got is not None and got[1] == b"hello", got
    listener.send(got[0], b"back")
    assert dialer.recv(30) == (listener.address, b"back")
finally:
    dialer.close()
    listener.close()
print("OK", sorted(m for m, v in sys.modules.items() if v is not None and (m.startswith("rd2h_zmq") or m == "zmq")))
"""


def test_rd2h_tcp_does_not_declare_rd2h_zmq() -> None:
    deps = tomllib.loads((ROOT / "backends/tcp/pyproject.toml").read_text())["project"]["dependencies"]
    assert [d for d in deps if d.replace("_", "-").startswith("rd2h-zmq")] == [], deps


def test_the_tcp_channel_works_where_rd2h_zmq_cannot_be_imported() -> None:
    proc = subprocess.run([sys.executable, "-c", _WITHOUT_ZMQ], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "OK []", proc.stdout
