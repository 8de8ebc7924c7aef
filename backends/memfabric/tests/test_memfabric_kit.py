"""Runs ``inkit/`` (the tests that start memfabric) in a child pytest with the CPU kit's env."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
KITENV = ROOT / "tests" / "kit" / "memfabric-cpu" / "kitenv.py"


def _kit_env() -> dict[str, str]:
    spec = importlib.util.spec_from_file_location("rd2h_kitenv", KITENV)
    assert spec is not None and spec.loader is not None, f"the CPU test kit is missing: {KITENV}"
    kitenv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kitenv)
    return kitenv.kit_env(sys.executable)


@pytest.mark.memfabric
@pytest.mark.timeout(1500)
def test_memfabric_suite_under_cpu_kit(tmp_path: Path) -> None:
    env = _kit_env()  # builds the kit when needed; fails loudly without gcc/strings/the wheel
    report = tmp_path / "inkit.xml"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", str(HERE / "inkit"), "-q", f"--junitxml={report}"],
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
