"""Small layers of random (or zero) blocks for the single-process integration tests."""

from __future__ import annotations

import numpy as np

from rd2h.api import LayerTensors


def layer_tensors(fill: bool, seed: int = 0, *, blocks: int = 8, main_bytes: int = 64, indexer_bytes: int = 16) -> LayerTensors:
    """One main tensor and an indexer of ``blocks`` blocks: random non-zero bytes, or zeros."""
    rng = np.random.default_rng(seed)

    def make(width: int) -> np.ndarray:
        if fill:
            return rng.integers(1, 255, (blocks, width), dtype=np.uint8)
        return np.zeros((blocks, width), np.uint8)

    return LayerTensors(main=[make(main_bytes)], indexer=make(indexer_bytes))
