"""`rd2h bench` measures an engine against memcpy in one run and checks what it read."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

RD2H = str(Path(sys.executable).with_name("rd2h"))


def test_bench_json_reports_ratios_to_memcpy() -> None:
    args = [RD2H, "bench", "--json", "--layers", "3", "--blocks", "32", "--block-kib", "8", "--repeat", "1"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    names = [row["name"] for row in report["rows"]]
    assert names == ["engine local", "memcpy, 1 thread", "memcpy, 2 threads"]
    assert all(row["verified"] and row["gbps"] > 0 for row in report["rows"])
    memcpy = [row["ratio_to_memcpy"] for row in report["rows"][1:]]
    assert max(memcpy) == 1.0  # ratios are to the best memcpy of the same run


def test_bench_table_and_unknown_engine() -> None:
    ok = subprocess.run([RD2H, "bench", "--layers", "2", "--blocks", "16", "--block-kib", "4", "--repeat", "1"],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "x best memcpy" in ok.stdout and "engine local" in ok.stdout
    bad = subprocess.run([RD2H, "bench", "--engine", "nosuch"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "nosuch" in bad.stderr and "Traceback" not in bad.stderr
