"""`rd2h probe --engine mooncake` through the installed console script: every check passes, and
the JSON report keeps stdout for itself although mooncake logs from native code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from rd2h.cli.probe import CHECKS

RD2H = Path(sys.executable).with_name("rd2h")


def test_probe_passes_every_check() -> None:
    done = subprocess.run(
        [str(RD2H), "probe", "--json", "--size-mib", "8", "--engine", "mooncake",
         "--engine-option", "timeout=5", "--engine-option", "progress_timeout_s=2", "--engine-option", "transfer_timeout_s=2"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["engine"] == "mooncake" and report["ok"] is True and report["gbps"] > 0
    assert [(c["name"], c["ok"]) for c in report["checks"]] == [(name, True) for name in CHECKS]
    assert "PeerGoneError" in report["checks"][-1]["detail"]
