"""The import-linter contracts in pyproject.toml hold (`lint-imports`), and they catch each kind of breach."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import rd2h

ROOT = Path(rd2h.__file__).parent.parent
PYPROJECT = ROOT / "pyproject.toml"
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(*, cwd: Path, pythonpath: str | None = None) -> subprocess.CompletedProcess[str]:
    # PYTHONPATH puts a package copy ahead of the installed rd2h
    env = None if pythonpath is None else {**os.environ, "PYTHONPATH": pythonpath}
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(PYPROJECT), "--no-cache"],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip


def test_the_import_contracts_hold() -> None:
    result = lint_imports(cwd=ROOT)
    assert result.returncode == 0, f"lint-imports failed:\n{result.stdout}\n{result.stderr}"
    assert "0 broken" in result.stdout


BREACHES = {
    "a pure module using threads, the cli using the test suite": {
        ("layout", "layers.py"): "threading", ("cli", "peer.py"): "rd2h.testing.engine_suite",
    },
    "one side importing the other, the wire importing a runtime": {
        ("prefill", "source.py"): "rd2h.decode.sink", ("wire", "endpoint.py"): "rd2h.prefill.send_tracker",
    },
}


@pytest.mark.parametrize("breach", list(BREACHES))
def test_the_contracts_catch_a_breach(tmp_path: Path, breach: str) -> None:
    copy = tmp_path / "rd2h"
    shutil.copytree(ROOT / "rd2h", copy, ignore=shutil.ignore_patterns("__pycache__"))
    for (package, module), imported in BREACHES[breach].items():
        with (copy / package / module).open("a") as f:
            f.write(f"\nimport {imported}  # noqa\n")
    result = lint_imports(cwd=tmp_path, pythonpath=str(tmp_path))
    assert result.returncode == 1, result.stdout + result.stderr
    for (package, module), imported in BREACHES[breach].items():
        assert f"rd2h.{package}.{module[:-3]} -> {imported}" in result.stdout
