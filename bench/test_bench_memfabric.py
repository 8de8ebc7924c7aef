"""pytest view of bench/memfabric_vs_local.py at a small size (2 layers x 128 x 64 KiB).

    pytest bench/test_bench_memfabric.py                     # once, as a correctness test
    pytest bench/test_bench_memfabric.py --benchmark-enable  # the script's figures in extra_info

The script runs in a child process: memfabric needs its environment from process start, and
the script re-runs itself under the CPU test kit where there is none.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent / "memfabric_vs_local.py"


def test_memfabric_vs_local(benchmark, tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    cmd = [sys.executable, str(SCRIPT), "--layers", "2", "--blocks", "128", "--repeat", "2", "--json", str(out)]

    def run() -> None:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]

    benchmark.pedantic(run, rounds=1, iterations=1)
    result = json.loads(out.read_text())
    gbps = result["case"]["gbps"]
    assert sorted(gbps) == sorted(["memcpy 1t", "memcpy 2t", "local 1t", "memfabric", "bare pvr 1t", "bare pvr 2t"])
    assert all(v > 0 for v in gbps.values())  # every read method was checked byte for byte before timing
    benchmark.extra_info.update(result["ratios"])
