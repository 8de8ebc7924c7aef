"""`rd2h demo --engine memfabric` on a CPU machine: the whole pull flow over memfabric's host
TCP path, Decode ranks as processes initiating reads, every byte verified.

memfabric 1.3.0's host TCP path binds every Prefill engine's data port at 11000, so one
Prefill rank per host: the demo runs Prefill TP 1 -> Decode TP 2.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path


def _free_port(count: int = 1) -> int:
    """A port with ``count - 1`` free ports after it (one per Decode rank)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port + count <= 65535 and all(_bindable(port + i) for i in range(1, count)):
            return port


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_demo_over_memfabric_verifies_every_byte() -> None:
    rd2h = str(Path(sys.executable).with_name("rd2h"))
    args = [rd2h, "demo", "--json", "--engine", "memfabric", "--prefill-tp", "1", "--decode-tp", "2",
            "--layers", "4", "--requests", "3", "--max-tokens", "512", "--chunk-tokens", "256",
            "--engine-option", f"store_url=tcp://127.0.0.1:{_free_port()}",
            "--kv-port", str(_free_port(2)), "--timeout", "60"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout)
    assert report["verified"] and report["engine"] == "memfabric" and report["steps"] == 2
    assert report["bytes"] > 0 and report["problems"] == []
