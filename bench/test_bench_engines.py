"""``rd2h bench`` once at a tiny size, as a correctness test (CI runs bench/ with
--benchmark-disable): every read method is checked byte for byte before it is timed, the
report names every method and ratio, and the plots are written. No timing is asserted.

    rd2h bench --full                       # the figures of docs/performance.md
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from rd2h.cli.bench_source import fill_pattern, pool
from rd2h.cli.benchmark import Descriptors, make_layout
from rd2h.cli.main import main


def test_bench_command_writes_every_method_ratio_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "results"
    code = main(["bench", "--engine", "local", "--layers", "3", "--layer-mib", "0.25", "--repeat", "2",
                 "--block-kib", "16", "--out", str(out), "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report == json.loads((out / "bench.json").read_text())
    assert [c["label"] for c in report["cases"]] == [
        "sfa 16 KiB shared", "sfa 16 KiB thp", "dense 16 KiB shared", "dense 16 KiB thp"]
    for case in report["cases"]:
        assert set(case["gbps"]) == {"memcpy 1t", "memcpy 2t", "local 1t", "local 2t", "bare pvr 1t", "bare pvr 2t"}
        assert all(len(v) == 2 and min(v) > 0 for v in case["samples"].values())
        assert {"local 1t / bare pvr 1t", "local 2t / bare pvr 2t", "local 2t / memcpy 2t"} <= set(case["ratios"])
        assert case["skipped"] == {}
    sfa = report["cases"][0]
    assert sfa["layers"] == 3 and sfa["block_bytes"] == [16384, 2048, 2048, 64]
    assert report["machine"]["nproc"] >= 1 and "kernel" in report["machine"]
    assert (out / "throughput.png").stat().st_size > 0 and (out / "ratios.png").stat().st_size > 0


def test_an_engine_that_cannot_start_is_reported_not_fatal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "--engine", "local", "--engine-option", "local.no_such_option=1", "--layers", "2",
                 "--layer-mib", "0.1", "--repeat", "1", "--layout", "dense", "--block-kib", "16",
                 "--memory", "thp", "--out", str(tmp_path), "--json", "--no-plots"])
    assert code == 0
    (case,) = json.loads(capsys.readouterr().out)["cases"]
    assert "no_such_option" in case["skipped"]["local"]
    assert set(case["gbps"]) == {"memcpy 1t", "memcpy 2t"}


@pytest.mark.parametrize("kind", ["sfa", "dense"])
def test_descriptors_check_finds_one_wrong_byte(kind: str) -> None:
    layout = make_layout(kind, 16, 0.1, layers=2)
    desc = Descriptors(layout, seed=3)
    src = pool(layout.total_bytes, "thp")
    fill_pattern(src)
    dest = pool(layout.total_bytes, "shared")
    for loc, rem in zip(desc.local, desc.remote):  # what a correct read leaves
        for lo, ro, n in zip(loc.tolist(), rem.tolist(), desc.lengths.tolist()):
            dest[lo:lo + n] = src[ro:ro + n]
    desc.check(dest, range(layout.layers))
    last = int(desc.local[1][-1] + desc.lengths[-1] - 1)
    dest[last] ^= 1
    with pytest.raises(AssertionError, match="layer 1"):
        desc.check(dest, [1])
    desc.check(dest, [0])


def test_layouts_keep_deepseek_proportions() -> None:
    sfa = make_layout("sfa", 64, 4)
    assert sfa.layers == 61 and sfa.block_bytes == (65536, 8192, 8192, 256)
    assert sfa.layer_bytes <= 4 << 20 < sfa.layer_bytes + sum(sfa.block_bytes)
    dense = make_layout("dense", 16, 1, layers=8)
    assert dense.blocks == 64 and dense.descriptors == 64
    with pytest.raises(ValueError):
        make_layout("sfa", 1, 1)
    assert np.all(Descriptors(dense).lengths == 16384)


def test_more_descriptors_than_iov_max_are_read_and_checked() -> None:
    from rd2h.cli.benchmark import Case, EngineSpec, Layout, measure_case

    layout = Layout("dense", 2, 2500, (64,))  # 2500 iovecs a layer: the bare loop must chunk them
    result = measure_case(Case(layout, "thp"), [EngineSpec("local", threads=(1, 2))], threads=(1, 2), repeat=1)
    assert result.skipped == {}
    assert set(result.samples) == {"memcpy 1t", "memcpy 2t", "local 1t", "local 2t", "bare pvr 1t", "bare pvr 2t"}
