"""tools/system-packages.sh: the Debian packages the tests need, checked by `make setup` and .ci/run.

The script runs for real against dpkg, with a list naming a package that does not exist; `id`,
`sudo` and `apt-get` are stubs on PATH where a test must not install anything.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

import rd2h

ROOT = Path(rd2h.__file__).parent.parent
SCRIPT = ROOT / "tools" / "system-packages.sh"
LIST = ROOT / "tools" / "system-packages.txt"
FAKE = "rd2h-no-such-package"

needs_dpkg = pytest.mark.skipif(shutil.which("dpkg-query") is None, reason="not a Debian system")


def run(
    tmp_path: Path, *args: str, packages: str, stubs: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    listing = tmp_path / "packages.txt"
    listing.write_text(packages)
    env = {**os.environ, "RD2H_SYSTEM_PACKAGES": str(listing)}
    if stubs:
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        for name, body in stubs.items():
            (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
            (bin_dir / name).chmod(0o755)
        env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    return subprocess.run(
        ["bash", str(SCRIPT), *args], env=env, check=False, capture_output=True, text=True, timeout=60
    )


@needs_dpkg
def test_installed_packages_pass_in_silence(tmp_path: Path) -> None:
    result = run(tmp_path, "--check", packages="# comment\n\ndpkg  # always there on Debian\n")
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


@needs_dpkg
def test_check_names_the_missing_package_and_the_command_in_one_line(tmp_path: Path) -> None:
    result = run(tmp_path, "--check", packages=f"dpkg\n{FAKE}  # why\n")
    assert result.returncode == 1
    assert result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"system packages: missing {FAKE} (--check installs nothing)")
    assert "apt-get update && " in line  # each with sudo when not root
    assert line.endswith(f"apt-get install -y {FAKE}")
    assert "dpkg" not in line  # only what is missing


@needs_dpkg
def test_without_root_or_sudo_it_stops_at_once_and_installs_nothing(tmp_path: Path) -> None:
    log = tmp_path / "apt.log"
    stubs = {"id": "echo 1000", "sudo": "exit 1", "apt-get": f'printf "%s\\n" "$*" >> {log}; exit 1'}
    result = run(tmp_path, packages=f"{FAKE}\n", stubs=stubs)
    assert result.returncode == 1
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"system packages: missing {FAKE} (not root, and sudo asks for a password)")
    assert line.endswith(f"install them with: sudo apt-get update && sudo apt-get install -y {FAKE}")
    assert not log.exists()


@needs_dpkg
def test_with_sudo_without_a_password_it_installs_through_sudo(tmp_path: Path) -> None:
    log = tmp_path / "sudo.log"
    # `sudo -n true` succeeds; the apt-get calls are only recorded, so the package stays missing
    stubs = {"id": "echo 1000", "sudo": f'printf "%s\\n" "$*" >> {log}; exit 0'}
    result = run(tmp_path, packages=f"{FAKE}\n", stubs=stubs)
    calls = log.read_text().splitlines()
    assert calls[0] == "-n true"
    assert re.fullmatch(r"-n env DEBIAN_FRONTEND=noninteractive apt-get .*update", calls[1])
    assert re.fullmatch(rf"-n env DEBIAN_FRONTEND=noninteractive apt-get .*install -y -- {FAKE}", calls[2])
    assert result.returncode == 1
    assert result.stderr.splitlines()[-1].startswith(f"system packages: missing {FAKE} (still not installed")


def test_the_scripts_parse() -> None:
    for script in (SCRIPT, ROOT / "tools" / "check-wheels.sh", ROOT / ".ci" / "run"):
        result = subprocess.run(["bash", "-n", str(script)], check=False, capture_output=True, text=True)
        assert result.returncode == 0, f"{script}: {result.stderr}"


def test_make_setup_and_ci_use_the_one_list() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    makefile = (ROOT / "Makefile").read_text()
    for text in (ci, makefile):
        assert "bash tools/system-packages.sh" in text
        assert "apt-get install" not in text  # the script installs; nobody keeps a second list
    wanted = {line.split("#")[0].strip() for line in LIST.read_text().splitlines()} - {""}
    removal = re.search(r"for pkg in ([\w ]+); do", ci)
    assert removal, "the packages .ci/run removes before make setup"
    removed = set(removal.group(1).split())
    assert removed <= wanted, "CI removes packages that make setup would not install again"


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_setup_checks_the_packages_even_when_the_venv_is_up_to_date() -> None:
    stamp = ".venv/.rd2h-installed"
    # Under `make test` the parent make's MAKELEVEL/MAKEFLAGS would make this one print
    # "Entering directory" lines; run it as a user would, from a shell.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS", "MAKEOVERRIDES")}
    fresh = subprocess.run(
        ["make", "--no-print-directory", "-n", "-o", stamp, "setup"],
        cwd=ROOT, env=env, check=False, capture_output=True, text=True,
    )
    assert fresh.stdout.splitlines() == ["bash tools/system-packages.sh"], fresh.stdout + fresh.stderr
    rebuild = subprocess.run(
        ["make", "--no-print-directory", "-n", "-B", "setup"],
        cwd=ROOT, env=env, check=False, capture_output=True, text=True,
    )
    stale = rebuild.stdout.splitlines()
    assert stale[0] == "bash tools/system-packages.sh"  # before anything is built
    assert stale.count("bash tools/system-packages.sh") == 1
