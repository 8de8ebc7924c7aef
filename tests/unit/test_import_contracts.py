"""The import-linter contracts in pyproject.toml hold (`lint-imports`), and they catch a breach."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

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


def test_the_contracts_catch_a_pure_module_using_threads_and_the_cli_using_the_test_suite(tmp_path: Path) -> None:
    copy = tmp_path / "rd2h"
    shutil.copytree(ROOT / "rd2h", copy, ignore=shutil.ignore_patterns("__pycache__"))
    with (copy / "layout" / "layers.py").open("a") as f:
        f.write("\nimport threading  # noqa\n")
    with (copy / "cli" / "peer.py").open("a") as f:
        f.write("\nimport rd2h.testing.engine_suite  # noqa\n")
    result = lint_imports(cwd=tmp_path, pythonpath=str(tmp_path))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "rd2h.layout.layers -> threading" in result.stdout
    assert "rd2h.cli.peer -> rd2h.testing.engine_suite" in result.stdout


def test_the_contracts_catch_one_side_importing_the_other_and_the_wire_importing_a_runtime(tmp_path: Path) -> None:
    copy = tmp_path / "rd2h"
    shutil.copytree(ROOT / "rd2h", copy, ignore=shutil.ignore_patterns("__pycache__"))
    with (copy / "prefill" / "source.py").open("a") as f:
        f.write("\nimport rd2h.decode.sink  # noqa\n")
    with (copy / "wire" / "endpoint.py").open("a") as f:
        f.write("\nimport rd2h.prefill.send_tracker  # noqa\n")
    result = lint_imports(cwd=tmp_path, pythonpath=str(tmp_path))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "rd2h.prefill.source -> rd2h.decode.sink" in result.stdout
    assert "rd2h.wire.endpoint -> rd2h.prefill.send_tracker" in result.stdout
