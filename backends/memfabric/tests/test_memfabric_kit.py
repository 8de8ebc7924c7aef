"""Runs ``inkit/`` (the tests that start memfabric) in a child pytest with the CPU kit's env.

memfabric-hybrid 1.3.0's HOST_TCP path binds every Prefill engine's data port at
127.0.0.1:11000. A run's own peers take it one after another (each test's peer is closed and
reaped before the next starts), but another memfabric run on the same host (a second checkout,
CI beside a developer's pytest) would hold it at any moment, and a peer of this run would fail
with "Address already in use". So the child pytest runs in a network namespace of its own
(``kit_command``, the kit's ``netns-exec``): its port 11000 is out of every other run's reach.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from types import ModuleType

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
KITENV = ROOT / "tests" / "kit" / "memfabric-cpu" / "kitenv.py"
DATA_PORT = 11000  # where memfabric 1.3.0 binds every Prefill engine's data port


def _kitenv() -> ModuleType:
    spec = importlib.util.spec_from_file_location("rd2h_kitenv", KITENV)
    assert spec is not None and spec.loader is not None, f"the CPU test kit is missing: {KITENV}"
    kitenv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kitenv)
    return kitenv


def _kit_env() -> dict[str, str]:
    return _kitenv().kit_env(sys.executable)  # builds the kit when needed; fails loudly without gcc/strings/the wheel


def _in_kit_network(argv: list[str], env: dict[str, str]) -> list[str]:
    """How this file starts memfabric processes: in the run's own network namespace."""
    return _kitenv().kit_command(argv, env)


@pytest.mark.memfabric
@pytest.mark.timeout(1500)
def test_memfabric_suite_under_cpu_kit(tmp_path: Path) -> None:
    env = _kit_env()
    report = tmp_path / "inkit.xml"
    proc = subprocess.run(
        _in_kit_network([sys.executable, "-m", "pytest", str(HERE / "inkit"), "-q", f"--junitxml={report}"], env),
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1400,
    )  # fmt: skip
    out = proc.stdout[-12000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, f"memfabric tests under the CPU kit failed:\n{out}"
    suite = ET.parse(report).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    assert counts["tests"] >= 30 and not counts["failures"] and not counts["errors"], (counts, out)
    skipped = [c.get("name") for c in suite.iter("testcase") if c.find("skipped") is not None]
    print(f"inkit: {counts}; skipped: {skipped}")


# A Decode engine reads from a Prefill peer, the peer is SIGKILLed (and reaped), and a second
# peer must take port 11000 at once and serve a read. Prints one RESULT line.
_KILL_AND_REPLACE = """
import json, numpy as np
from rd2h.interfaces import Region
from rd2h.plugins import load_engine
from rd2h.testing.peer import PeerProcess
OPTIONS = {"store_url": "tcp://127.0.0.1:1", "timeout": 5.0}  # each Prefill serves its own store
STATES = {"01": "ESTABLISHED", "04": "FIN_WAIT1", "05": "FIN_WAIT2", "06": "TIME_WAIT", "08": "CLOSE_WAIT",
          "09": "LAST_ACK", "0A": "LISTEN", "0B": "CLOSING"}
def states_on(port):  # TCP sockets with this local port, from this namespace's table
    with open("/proc/net/tcp") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    return sorted(STATES.get(r[3], r[3]) for r in rows if int(r[1].split(":")[1], 16) == port)
dst = np.zeros(1 << 20, dtype=np.uint8)
e = load_engine("memfabric", "decode", **OPTIONS)
e.register([Region(dst.ctypes.data, dst.nbytes)])
def read_all(peer):
    dst[:] = 0
    one = [np.asarray([v], dtype=np.int64) for v in (dst.ctypes.data, peer.regions[0][0], 64 << 10)]
    e.read_batch(e.connect(peer.metadata), *one)
    return bool(np.array_equal(dst[: 64 << 10], peer.expected(0)[: 64 << 10]))
first = PeerProcess("memfabric", sizes=(1 << 20,), seed=1, options=OPTIONS)
out = {"first_read": read_all(first)}
first.kill()  # SIGKILL and wait: the kernel has closed its listener when this returns
out["left_on_the_port"] = states_on(%(port)d)  # the killed peer's closing connections
with PeerProcess("memfabric", sizes=(1 << 20,), seed=2, options=OPTIONS) as second:
    out["second_session"] = second.session_id
    out["second_read"] = read_all(second)
e.close()
print("RESULT " + json.dumps(out), flush=True)
""" % {"port": DATA_PORT}

# Stands for the host: holds port 11000 as another run's Prefill would, runs the command given
# as JSON in argv[1], and prints its outcome as JSON.
_ANOTHER_RUN_HOLDS_THE_PORT = """
import json, socket, subprocess, sys
with socket.create_server(("127.0.0.1", %(port)d)):
    done = subprocess.run(json.loads(sys.argv[1]), capture_output=True, text=True, timeout=240)
print(json.dumps({"rc": done.returncode, "stdout": done.stdout[-4000:], "stderr": done.stderr[-6000:]}))
""" % {"port": DATA_PORT}


@pytest.mark.memfabric
@pytest.mark.timeout(300)
def test_a_prefill_of_another_run_on_the_host_does_not_collide() -> None:
    """Regression: CI runs failed with "Address already in use" on 127.0.0.1:11000 while another
    memfabric run held the port. The "host" here is a namespace of its own too (made with the
    same launcher), so this test takes port 11000 from nobody outside it."""
    env = _kit_env()
    run = _in_kit_network([sys.executable, "-c", _KILL_AND_REPLACE], env)  # as the suite above is started
    host = [env["RD2H_KIT_NETNS_EXEC"], sys.executable, "-c", _ANOTHER_RUN_HOLDS_THE_PORT, json.dumps(run)]
    done = subprocess.run(host, cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, f"the stand-in host failed ({done.returncode}):\n{done.stderr[-4000:]}"
    child = json.loads(done.stdout.strip().splitlines()[-1])
    lines = [line for line in child["stdout"].splitlines() if line.startswith("RESULT ")]
    bound = "Address already in use" in child["stderr"]
    assert child["rc"] == 0 and lines, f"a run's peers collided with another run (EADDRINUSE: {bound}):\n{child['stderr']}"
    out = json.loads(lines[-1][len("RESULT ") :])
    assert out["first_read"] and out["second_read"], out
    assert out["second_session"].startswith("127.0.0.1:"), out
    print(f"kill and replace under another run's port 11000: {out}")
