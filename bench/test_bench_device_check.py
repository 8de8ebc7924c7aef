"""bench/device_check.py as a test: the host stand-in runs the same two-process logic as on a
GPU (staging on both sides, every byte checked) at a tiny size; without CUDA and without
``--cpu-stand-in`` it stops at once. No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import device_check
import pytest
import torch


def test_the_stand_in_moves_and_verifies_every_byte(tmp_path: Path) -> None:
    out = tmp_path / "device.json"
    argv = ["--cpu-stand-in", "--layers", "3", "--requests", "2", "--tokens", "130", "--rounds", "1", "--copies", "1",
            "--json", str(out)]  # fmt: skip
    assert device_check.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["machine"] == "host stand-in (no device)"
    local = report["engines"]["local"]
    assert local["verified"] and local["bytes_per_step"] == 2 * 3 * 64 * (656 + 128 + 4) * 3
    assert local["copy"]["ratio"] > 0 and local["pull_gbps"] > 0 and local["exposed_ms"] >= 0
    assert "staging only" in report["engines"]["nixl"]["skipped"]


def test_a_wrong_byte_fails_the_check() -> None:
    args = device_check.parse(["--cpu-stand-in", "--layers", "1", "--requests", "1", "--tokens", "64", "--rounds", "1"])
    plan = device_check.Plan(args)
    src = device_check.tensors(torch, plan.prefill_blocks, 64, {r: ("cpu", False) for r, _ in device_check.ROLES}, 1, True)
    dst = device_check.tensors(torch, plan.decode_blocks, 64, {r: ("cpu", False) for r, _ in device_check.ROLES}, 1, False)
    (p_ids,), (d_ids,) = plan.rounds[0]
    for a, b in zip((dst["model.layers.0"].main[0], dst["model.layers.0"].indexer, dst["model.layers.0"].scale),
                    (src["model.layers.0"].main[0], src["model.layers.0"].indexer, src["model.layers.0"].scale)):  # fmt: skip
        a[d_ids] = b[p_ids]
    assert device_check.check(torch, dst, plan.rounds[0], 64)
    dst["model.layers.0"].scale[d_ids[0], 3, 1] ^= 1
    assert not device_check.check(torch, dst, plan.rounds[0], 64)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_without_a_cuda_device_it_stops_at_once() -> None:
    script = Path(device_check.__file__)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "no CUDA device" in done.stdout
