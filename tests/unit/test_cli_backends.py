"""`rd2h backends` through the installed console script, and the CLI's error contract."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import rd2h.cli.main as cli
from rd2h import plugins
from rd2h.errors import BackendError

RD2H = Path(sys.executable).with_name("rd2h")


def rd2h(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    assert RD2H.exists(), f"console script missing: {RD2H}"
    return subprocess.run(
        [str(RD2H), *args], capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})}
    )


def installed(distribution: str) -> bool:
    try:
        importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def test_table_lists_the_default_backends_as_available() -> None:
    done = rd2h("backends")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split() == ["KIND", "NAME", "DISTRIBUTION", "VERSION", "AVAILABLE", "WHY", "NOT"]
    rows = {tuple(line.split()[:2]): line.split() for line in lines[1:]}
    assert rows["channel", "zmq"][2:5] == ["rd2h-zmq", importlib.metadata.version("rd2h-zmq"), "yes"]
    if installed("rd2h-local"):
        local = rows["engine", "local"]
        assert local[2] == "rd2h-local"
        assert local[4] == ("yes" if plugins.engine_class("local").availability().ok else "no")


def test_json_parses_and_matches_the_table() -> None:
    done = rd2h("backends", "--json")
    assert done.returncode == 0, done.stderr
    listed = json.loads(done.stdout)
    assert {"kind", "name", "distribution", "version", "available", "reason"} <= set(listed[0])
    zmq_row = next(b for b in listed if (b["kind"], b["name"]) == ("channel", "zmq"))
    assert zmq_row["available"] is True and zmq_row["reason"] == ""


def test_broken_backend_is_listed_with_why(tmp_path: Path) -> None:
    info = tmp_path / "rd2h_broken-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: rd2h-broken\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[rd2h.transfer_engines]\nbroken = rd2h_broken_mod:Engine\n")
    (tmp_path / "rd2h_broken_mod.py").write_text("import rd2h_missing_thing\n")
    done = rd2h("backends", env={"PYTHONPATH": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    row = next(line for line in done.stdout.splitlines() if line.startswith("engine") and " broken " in line)
    assert row.split()[2:5] == ["rd2h-broken", "1.0", "no"]
    assert "'rd2h_missing_thing'" in row and "pip install rd2h-broken" in row
    listed = json.loads(rd2h("backends", "--json", env={"PYTHONPATH": str(tmp_path)}).stdout)
    assert next(b for b in listed if b["name"] == "broken")["available"] is False


def test_no_command_prints_usage_and_fails() -> None:
    done = rd2h()
    assert done.returncode == 2 and "usage: rd2h" in done.stderr
    assert rd2h("--version").stdout.strip().startswith("rd2h ")


def test_rd2h_error_is_one_line_and_exit_2(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def broken() -> list[plugins.BackendInfo]:
        raise BackendError("the registry is on fire\n(second line)")

    monkeypatch.setattr(plugins, "list_backends", broken)
    assert cli.main(["backends"]) == 2
    captured = capsys.readouterr()
    assert captured.err == "rd2h: error: the registry is on fire (second line)\n"
    assert "Traceback" not in captured.err and captured.out == ""
    for argv in (["--debug", "backends"], ["backends", "--debug"]):
        with pytest.raises(BackendError, match="on fire"):
            cli.main(argv)


def test_other_errors_are_not_swallowed(monkeypatch: pytest.MonkeyPatch) -> None:
    def bug() -> list[plugins.BackendInfo]:
        raise ZeroDivisionError("a bug, not an rd2h error")

    monkeypatch.setattr(plugins, "list_backends", bug)
    with pytest.raises(ZeroDivisionError):
        cli.main(["backends"])


def test_every_listed_command_has_the_two_functions() -> None:
    import importlib

    for name in cli.COMMANDS:
        module = importlib.import_module(f"rd2h.cli.commands.{name}")
        assert callable(module.add_parser) and callable(module.run)
