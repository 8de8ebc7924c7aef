"""``--json`` commands print the JSON document alone on stdout, whatever native code prints.

CI found ``rd2h demo --json --engine memfabric`` unparsable: memfabric's library logs a port-bind
retry to file descriptor 1 from inside the command. A ``sitecustomize`` stands in for such a
library here: every Python process of the command writes to descriptor 1 when it exits (the
command itself after the JSON was written), and the demo's spawned rank processes also when
they start. (Probe's source process has its own stdout pipe, read by the probe.)
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

RD2H = str(Path(sys.executable).with_name("rd2h"))

_NOISY_NATIVE_LIBRARY = """
import atexit, os, sys
if "--multiprocessing-fork" in sys.argv:
    os.write(1, b"[native] child started\\n")
atexit.register(os.write, 1, b"[native] bind ipv4 tcp port failed\\n")
"""


def _noisy_env(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "sitecustomize.py").write_text(_NOISY_NATIVE_LIBRARY)
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("command", [
    ["demo", "--prefill-tp", "1", "--decode-tp", "1", "--layers", "2", "--requests", "1", "--max-tokens", "128"],
    ["probe", "--engine", "local", "--size-mib", "4"],
    ["backends"],
], ids=["demo", "probe", "backends"])
def test_stdout_holds_the_json_alone_and_native_output_goes_to_stderr(command: list[str], tmp_path: Path) -> None:
    args = [RD2H, *command, "--json"]
    if command[0] == "demo":
        args += ["--kv-port", str(_free_port())]
    done = subprocess.run(args, capture_output=True, text=True, timeout=180, env=_noisy_env(tmp_path))
    assert done.returncode == 0, done.stderr[-4000:]
    json.loads(done.stdout)  # the whole of stdout is one JSON document
    assert "[native] bind ipv4 tcp port failed" in done.stderr  # the noise was not lost, only moved
    if command[0] == "demo":
        assert "[native] child started" in done.stderr  # the rank processes inherit the redirection


def test_in_process_the_json_goes_to_the_callers_stdout_and_no_descriptor_moves(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A program (or a test) that runs ``rd2h.cli.main`` itself with ``sys.stdout`` replaced gets
    the JSON there; descriptor 1 of its process is left where it was (CI found the bench tests'
    capsys empty and the JSON on the process's descriptor 1)."""
    from rd2h.cli.main import main

    before = os.fstat(1)
    assert main(["backends", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert any(b["name"] == "local" for b in listed)
    after = os.fstat(1)
    assert (after.st_dev, after.st_ino) == (before.st_dev, before.st_ino)
