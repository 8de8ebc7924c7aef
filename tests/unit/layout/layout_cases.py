"""Layouts and helpers shared by the layout and planning tests."""

from __future__ import annotations

from rd2h.layout.layers import LayerLayout, TensorLayout

T = TensorLayout


def layer(main=((0x1000, 64, 16), (0x9000, 64, 16)), indexer=(0x20000, 16, 8), scale=(0x30000, 4, 8)):
    return LayerLayout(
        tuple(T(*m) for m in main),
        None if indexer is None else T(*indexer),
        None if scale is None else T(*scale),
    )


def naive_inside(pairs, addr, length):
    """Walk the original (unmerged) regions byte range by byte range."""
    if length <= 0 or addr < 0:
        return False
    pos, end = addr, addr + length
    while pos < end:
        nxt = max((a + n for a, n in pairs if a <= pos < a + n), default=None)
        if nxt is None:
            return False
        pos = nxt
    return True
