"""Decode's coverage check: a contributor's final signal is believed only if every layer of
every chunk it announced was read and the chunks tile the request from its first block to
the end of its destinations."""

from __future__ import annotations

from rd2h.decode.completeness import Coverage

LAYERS = frozenset(("l0", "l1", "l2"))


def _announce(coverage: Coverage, chunk: tuple[int, int, int, int], layers=LAYERS, member: int = 0) -> None:
    for layer in layers:
        coverage.record(member, layer, chunk)


def test_every_layer_of_every_chunk_is_complete() -> None:
    coverage = Coverage((0, 7), (0, 7))
    _announce(coverage, (0, 4, 0, 4))
    _announce(coverage, (4, 0, 4, 0))  # a step that completed no block
    _announce(coverage, (4, 3, 4, 3))
    assert coverage.missing(0, LAYERS) is None


def test_a_missing_layer_is_named() -> None:
    coverage = Coverage((0, 7), (0, 7))
    _announce(coverage, (0, 4, 0, 4))
    _announce(coverage, (4, 3, 4, 3), layers=("l0", "l2"))
    assert "l1" in coverage.missing(0, LAYERS) and "main block 4" in coverage.missing(0, LAYERS)


def test_a_gap_between_chunks_is_named() -> None:
    coverage = Coverage((0, 8), (0, 8))
    _announce(coverage, (0, 4, 0, 4))
    _announce(coverage, (6, 2, 6, 2))
    assert coverage.missing(0, LAYERS) == "contributor 0: main blocks 4..5 were never announced"


def test_coverage_must_reach_the_end_of_what_was_expected() -> None:
    coverage = Coverage((0, 2), (0, 2))
    assert coverage.missing(0, LAYERS) == "contributor 0: main blocks 0..1 were never announced"
    _announce(coverage, (0, 1, 0, 1))
    assert coverage.missing(0, LAYERS) == "contributor 0: main blocks 1..1 were never announced"
    _announce(coverage, (1, 1, 1, 1))
    assert coverage.missing(0, LAYERS) is None


def test_the_span_starts_at_the_first_block_and_indexer_is_checked_apart() -> None:
    coverage = Coverage((2, 4), (1, 2))
    _announce(coverage, (2, 2, 1, 0))
    assert coverage.missing(0, LAYERS) == "contributor 0: indexer blocks 1..1 were never announced"
    _announce(coverage, (4, 0, 1, 1))
    assert coverage.missing(0, LAYERS) is None


def test_contributors_are_checked_apart() -> None:
    coverage = Coverage((0, 2), (0, 2))
    _announce(coverage, (0, 2, 0, 2), member=1)
    assert coverage.missing(1, LAYERS) is None
    assert coverage.missing(0, LAYERS) is not None
