"""`rd2h probe --engine memfabric` passes every check on the real wheel (HOST_TCP under the CPU kit).

Runs the console script as a child: this process has the kit's environment already and the
child inherits it, and memfabric's process-wide engine stays out of this process. The probe's
source is the host's only Prefill engine while it runs (HOST_TCP binds port 11000 for one).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from rd2h.cli.probe import CHECKS

RD2H = Path(sys.executable).with_name("rd2h")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(120)
def test_probe_passes_every_check() -> None:
    args = [
        str(RD2H), "probe", "--engine", "memfabric", "--json", "--size-mib", "16", "--timeout", "10",
        "--engine-option", f"store_url=tcp://127.0.0.1:{_free_port()}", "--engine-option", "timeout=5",
        "--decode-option", "start_store=true",  # as the conformance suite: the reading side starts the store
    ]  # fmt: skip
    done = subprocess.run(args, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr[-6000:]}"
    report = json.loads(done.stdout)  # memfabric's own printing to stdout does not reach it
    assert report["engine"] == "memfabric" and report["ok"] is True and report["gbps"] > 0
    found = {c["name"]: c for c in report["checks"]}
    assert list(found) == list(CHECKS) and all(c["ok"] for c in found.values()), found
    assert found["dead_peer"]["detail"].startswith("PeerGoneError"), found["dead_peer"]
    assert "RegionError" in found["out_of_region"]["detail"]
    timings = ", ".join(f"{name} {c['seconds']:.2f} s" for name, c in found.items())
    print(f"memfabric probe: {report['gbps']:.2f} GB/s; {timings}")
