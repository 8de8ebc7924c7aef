"""Decode's coverage check: a contributor's final signal is believed only if every layer of
every chunk it announced was read and the chunks tile the request from block 0."""

from __future__ import annotations

from rd2h.coverage import CoverageTracker

LAYERS = ("l0", "l1", "l2")


def _announce(tracker: CoverageTracker, chunk: tuple[int, int, int, int], layers=LAYERS, member: int = 0) -> None:
    for layer in layers:
        tracker.record("r", member, layer, chunk)


def test_every_layer_of_every_chunk_is_complete() -> None:
    tracker = CoverageTracker(LAYERS)
    _announce(tracker, (0, 4, 0, 4))
    _announce(tracker, (4, 0, 4, 0))  # a step that completed no block
    _announce(tracker, (4, 3, 4, 3))
    assert tracker.missing("r", 0) is None


def test_a_missing_layer_is_named() -> None:
    tracker = CoverageTracker(LAYERS)
    _announce(tracker, (0, 4, 0, 4))
    _announce(tracker, (4, 3, 4, 3), layers=("l0", "l2"))
    assert "l1" in tracker.missing("r", 0) and "main block 4" in tracker.missing("r", 0)


def test_a_gap_between_chunks_is_named() -> None:
    tracker = CoverageTracker(LAYERS)
    _announce(tracker, (0, 4, 0, 4))
    _announce(tracker, (6, 2, 6, 2))
    assert tracker.missing("r", 0) == "contributor 0: main blocks 4..5 were never announced"


def test_contributors_are_checked_apart_and_forgotten() -> None:
    tracker = CoverageTracker(LAYERS)
    _announce(tracker, (0, 2, 0, 2), member=1)
    assert tracker.missing("r", 1) is None
    assert tracker.missing("r", 0) is None  # nothing announced: nothing claimed
    _announce(tracker, (1, 1, 1, 1), member=0)
    assert "blocks 0..0" in tracker.missing("r", 0)
    tracker.forget("r")
    assert tracker.missing("r", 0) is None
