"""The demo's byte pattern: defined for every layer, distinct between neighbours."""

from __future__ import annotations

import numpy as np

from rd2h.cli.demo.workload import pattern


def test_a_layer_past_the_uint32_seed_range_has_a_pattern() -> None:
    positions = np.arange(3)
    big = pattern(4352, 1, 0, positions, 64)  # 4352 * 1_000_003 > 2**32: raised OverflowError before
    assert big.shape == (3, 64)
    assert not np.array_equal(big, pattern(4351, 1, 0, positions, 64))
    assert np.array_equal(big, pattern(4352, 1, 0, positions, 64))  # Prefill's fill and Decode's check agree
