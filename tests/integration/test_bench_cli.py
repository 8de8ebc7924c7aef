"""`rd2h bench` from the command line: a name that is no installed engine is a usage error.

(What it measures and checks is tested in bench/test_bench_engines.py.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

RD2H = str(Path(sys.executable).with_name("rd2h"))


def test_an_unknown_engine_is_refused_at_once(tmp_path: Path) -> None:
    bad = subprocess.run([RD2H, "bench", "--engine", "nosuch", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2, bad.stdout + bad.stderr
    assert "nosuch" in bad.stderr and "installed: local" in bad.stderr and "Traceback" not in bad.stderr
    assert not any(tmp_path.iterdir())  # nothing measured, nothing written
