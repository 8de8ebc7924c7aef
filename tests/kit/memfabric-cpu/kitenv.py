"""TEST-ONLY: the environment a process needs to run memfabric-hybrid's host transports on a CPU box.

The wheel reads its LD_PRELOAD shim and library path at process start, so a test cannot switch the
kit on inside a running interpreter: it starts child processes with ``kit_env()`` instead.

    from kitenv import kit_env
    subprocess.run([sys.executable, "child.py"], env=kit_env())

``kit_env`` builds the kit first when needed (``setup.sh`` skips the build when up to date) and
raises ``KitUnavailable`` with the reason when it cannot (no gcc, no wheel, ...).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

__all__ = ["KitUnavailable", "kit_env", "KIT_DIR", "DEFAULT_OUT"]

KIT_DIR = Path(__file__).resolve().parent
DEFAULT_OUT = KIT_DIR.parents[2] / ".rd2h-kit"


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


if __name__ == "__main__":  # build if needed; print the variables the kit sets
    kit = kit_env()
    print("\n".join(f"{k}={v}" for k, v in sorted(kit.items()) if os.environ.get(k) != v))
