"""TEST-ONLY: the environment a process needs to run memfabric-hybrid's host transports on a CPU box.

The wheel reads its LD_PRELOAD shim and library path at process start, so a test cannot switch the
kit on inside a running interpreter: it starts child processes with ``kit_env()`` instead.

    from kitenv import kit_env
    subprocess.run([sys.executable, "child.py"], env=kit_env())

``kit_env`` builds the kit first when needed (``setup.sh`` skips the build when up to date) and
raises ``KitUnavailable`` with the reason when it cannot (no gcc, no wheel, ...).

memfabric 1.3.0 binds every Prefill engine's data port at 127.0.0.1:11000, so two test runs on
one host would take it from each other. ``kit_command`` runs a command (a whole test run) in a
network namespace of its own, loopback only, where that port is the run's alone:

    env = kit_env()
    subprocess.run(kit_command([sys.executable, "-m", "pytest", "inkit"], env), env=env)
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["KitUnavailable", "kit_env", "kit_command", "KIT_DIR", "DEFAULT_OUT", "SHARED_NETWORK"]

KIT_DIR = Path(__file__).resolve().parent
DEFAULT_OUT = KIT_DIR.parents[2] / ".rd2h-kit"


# Set to 1 to run in the host's network instead (where no namespace can be made: neither root
# nor unprivileged user namespaces). Another memfabric run on the host can then take port 11000.
SHARED_NETWORK = "RD2H_KIT_SHARED_NETWORK"


class KitUnavailable(RuntimeError):
    """The CPU kit cannot be built here; the message says why."""


def kit_env(python: str | None = None, out: str | os.PathLike[str] | None = None,
            base: dict[str, str] | None = None) -> dict[str, str]:
    """Build (if needed) and return ``base`` (default ``os.environ``) with the kit's env.sh applied."""
    python = python or sys.executable
    out = Path(out) if out is not None else DEFAULT_OUT
    setup = subprocess.run(["bash", str(KIT_DIR / "setup.sh"), python, str(out)],
                           capture_output=True, text=True)
    if setup.returncode != 0:
        raise KitUnavailable(f"memfabric CPU kit setup failed ({setup.returncode}): "
                             f"{setup.stderr.strip() or setup.stdout.strip()}")
    env_sh = setup.stdout.strip().splitlines()[-1]
    source = dict(base if base is not None else os.environ)
    dump = subprocess.run(["bash", "-c", 'set -e; source "$1"; env -0', "bash", env_sh],
                          capture_output=True, env=source, check=True)
    env = dict(item.decode().split("=", 1) for item in dump.stdout.split(b"\0") if b"=" in item)
    for key in ("_", "SHLVL", "PWD", "OLDPWD"):  # bash sets these of its own accord
        env.pop(key, None)
        if key in source:
            env[key] = source[key]
    return env


def kit_command(argv: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """``argv`` run in a network namespace of its own (loopback only) by the kit's launcher,
    ``netns-exec``; ``env`` is what ``kit_env`` returned. Everything the command starts shares
    that namespace, and nothing outside it can hold its ports. The launcher exits 125 with the
    reason when it cannot make the namespace."""
    if env.get(SHARED_NETWORK) == "1":
        return list(argv)
    launcher = env.get("RD2H_KIT_NETNS_EXEC")
    if not launcher or not os.access(launcher, os.X_OK):
        raise KitUnavailable(f"the kit's netns-exec launcher is missing ({launcher!r}): rebuild with setup.sh")
    return [launcher, *argv]


if __name__ == "__main__":  # build if needed; print the variables the kit sets
    kit = kit_env()
    print("\n".join(f"{k}={v}" for k, v in sorted(kit.items()) if os.environ.get(k) != v))
