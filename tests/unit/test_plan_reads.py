"""Decode's share of a readiness (shares.plan_reads, pure): over all ranks and contributors,
main blocks are read once in total and every rank gets the whole indexer."""

from __future__ import annotations

from collections import Counter

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from rd2h.protocol import ReadReadyBatch, ReadRequest
from rd2h.shares import Destinations, plan_reads
from rd2h.topology import Topology

TOPOLOGIES = [(p, d) for p in (1, 2, 3, 4, 8, 16) for d in (1, 2, 4, 8) if p % d == 0 or d % p == 0]


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(TOPOLOGIES), st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), max_size=4))
def test_every_block_lands_once_where_it_should(topology: tuple[int, int], chunks: list[tuple[int, int]]) -> None:
    p_tp, d_tp = topology
    topo = Topology(p_tp, d_tp)
    dest = {f"r{i}": Destinations.of(1000 + np.arange(s + n) * 3) for i, (s, n) in enumerate(chunks)}
    main_hits: Counter[tuple[int, int]] = Counter()
    index_hits: Counter[tuple[int, int, int]] = Counter()
    for p_rank in range(p_tp):
        for d_rank in topo.decode_ranks_of(p_rank):
            batch = ReadReadyBatch(0, "l", tuple(
                ReadRequest(f"r{i}", tuple(range(s, s + n)), tuple(range(s, s + n)), s, s)
                for i, (s, n) in enumerate(chunks)
            ), (), topo.member_of(p_rank), topo.ratio)
            reads, refused = plan_reads(batch, dest, decode_rank=d_rank, decode_tp=d_tp)
            assert refused == {}
            for read in reads:
                # source block b (position b) always lands in destination position b
                assert np.array_equal(read.dst_main, 1000 + read.src_main * 3)
                assert np.array_equal(read.dst_indexer, 1000 + read.src_indexer * 3)
                main_hits.update((int(read.ext_req_id[1:]), int(b)) for b in read.src_main)
                index_hits.update((d_rank, int(read.ext_req_id[1:]), int(b)) for b in read.src_indexer)
    assert set(main_hits) == {(i, b) for i, (s, n) in enumerate(chunks) for b in range(s, s + n)}
    assert all(v == 1 for v in main_hits.values())
    every = {(i, b) for i, (s, n) in enumerate(chunks) for b in range(s, s + n)}
    assert set(index_hits) == {(d, i, b) for d in range(d_tp) for i, b in every}
    assert all(v == 1 for v in index_hits.values())


def test_short_destinations_are_refused_alone_and_requests_without_destinations_skipped() -> None:
    batch = ReadReadyBatch(3, "l", (
        ReadRequest("ok", (1, 2), (1, 2), 0, 0),
        ReadRequest("short", (1, 2), (1, 2), 1, 1),
        ReadRequest("ghost", (5,), (5,), 0, 0),
    ))
    dest = {"ok": Destinations.of([7, 8]), "short": Destinations.of([9, 10])}
    reads, refused = plan_reads(batch, dest, decode_rank=0, decode_tp=1)
    assert [r.ext_req_id for r in reads] == ["ok"]
    assert set(refused) == {"short"} and "beyond the 2 blocks" in str(refused["short"])
    # (an id with no destinations was refused by the receive tracker before planning)
