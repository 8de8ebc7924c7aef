"""`rd2h probe` through the installed console script: the local engine passes every check, a
faulty engine (published by a test distribution, built by name at both ends) fails the checks
it should and nothing else, and argument errors exit 2 before anything starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rd2h.cli.probe import CHECKS

RD2H = Path(sys.executable).with_name("rd2h")

# A local engine with one fault: "flip" corrupts one byte of every batched read, "hang" never
# returns from one. Single-descriptor reads (single read, out-of-region, dead peer) are untouched.
FAULTY = '''
import ctypes, threading
from rd2h_local import LocalEngine

class FaultyEngine(LocalEngine):
    name = "faulty"

    def __init__(self, role, *, fault="flip", **options):
        super().__init__(role, **options)
        self.fault = fault

    def read_batch(self, session, local_addrs, remote_addrs, lengths):
        if self.fault == "hang" and len(lengths) > 1:
            threading.Event().wait()
        super().read_batch(session, local_addrs, remote_addrs, lengths)
        if self.fault == "flip" and len(lengths) > 1:
            ctypes.c_uint8.from_address(int(local_addrs[-1])).value ^= 0xFF
'''


def probe(*args: str, pythonpath: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    assert RD2H.exists(), f"console script missing: {RD2H}"
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH")]))
    return subprocess.run([str(RD2H), "probe", *args], capture_output=True, text=True, timeout=timeout, env=env)


def checks(done: subprocess.CompletedProcess[str]) -> dict[str, dict[str, Any]]:
    report = json.loads(done.stdout)
    assert [c["name"] for c in report["checks"]] == list(CHECKS), report
    return {c["name"]: c for c in report["checks"]}


def publish_faulty(root: Path) -> Path:
    info = root / "rd2h_faulty-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: rd2h-faulty\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[rd2h.transfer_engines]\nfaulty = rd2h_faulty_mod:FaultyEngine\n")
    (root / "rd2h_faulty_mod.py").write_text(FAULTY)
    return root


def test_local_engine_passes_every_check() -> None:
    done = probe("--size-mib", "8")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    rows = [line.split() for line in lines if line.startswith("  ")]
    assert [(r[0], r[1]) for r in rows] == [("PASS", name) for name in CHECKS], done.stdout
    assert lines[-1] == f"all {len(CHECKS)} checks passed"
    assert lines[-2].startswith("bandwidth: ") and lines[-2].endswith(" GB/s")


def test_json_report() -> None:
    done = probe("--json", "--size-mib", "4", "--engine", "local", "--engine-option", "threads=2")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert set(report) == {"engine", "checks", "gbps", "ok"}
    assert report["engine"] == "local" and report["ok"] is True and report["gbps"] > 0
    found = checks(done)
    assert all(c["ok"] and c["seconds"] >= 0 and c["detail"] for c in found.values())
    assert found["dead_peer"]["detail"].startswith("PeerGoneError")
    assert "RegionError" in found["out_of_region"]["detail"]


def test_corrupt_reads_fail_their_checks_and_exit_1(tmp_path: Path) -> None:
    done = probe("--json", "--engine", "faulty", "--size-mib", "4", pythonpath=publish_faulty(tmp_path))
    assert done.returncode == 1, done.stdout + done.stderr
    found = checks(done)
    failed = {name for name, c in found.items() if not c["ok"]}
    assert failed == {"batched_read", "bandwidth"}, found
    assert "1 bytes differ" in found["batched_read"]["detail"]
    assert json.loads(done.stdout)["gbps"] is None  # a rate for bytes that were wrong is not reported


def test_a_hung_read_is_a_bounded_failure(tmp_path: Path) -> None:
    started = time.monotonic()
    done = probe("--json", "--engine", "faulty", "--engine-option", "fault=hang", "--size-mib", "4",
                 "--timeout", "2", pythonpath=publish_faulty(tmp_path), timeout=60)
    took = time.monotonic() - started
    assert done.returncode == 1, done.stdout + done.stderr
    found = checks(done)
    assert [c["ok"] for c in found.values()] == [True, True, True, False, False, False, False]
    assert found["batched_read"]["detail"] == "batched read: no answer within 2 s"
    assert all(c["detail"].startswith("not run: batched read is still running") for c in list(found.values())[4:])
    assert "still running inside the engine: batched read" in done.stderr
    assert took < 20, f"the probe took {took:.1f} s with a 2 s bound"


def test_unknown_engine_and_bad_arguments_exit_2_before_starting_anything() -> None:
    for args, says in [
        (["--engine", "nosuch"], "no transfer engine named 'nosuch'"),
        (["--engine-option", "nosuch=1"], "nosuch"),
        (["--size-mib", "0"], "size_mib"),
    ]:
        done = probe(*args)
        assert done.returncode == 2, (args, done.stdout, done.stderr)
        assert done.stdout == "" and done.stderr.startswith("rd2h: error: ") and says in done.stderr, done.stderr
        assert len(done.stderr.splitlines()) == 1 and "Traceback" not in done.stderr
