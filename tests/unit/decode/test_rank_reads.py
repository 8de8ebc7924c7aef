"""Decode's share of a readiness (shares.plan_reads, pure): over all ranks and contributors,
main blocks are read once in total and every rank gets the whole indexer."""

from __future__ import annotations

from collections import Counter

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from rd2h.decode.rank_reads import Destinations, MainSplit, plan_reads
from rd2h.layout.topology import Topology
from rd2h.wire.protocol import ReadReadyBatch, ReadRequest

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


def _decoded(layer: int, reqs: tuple[ReadRequest, ...]) -> ReadReadyBatch:
    """A readiness as Decode gets it: through the real codec (which sets reqs_bytes)."""
    from rd2h.wire import protocol
    from rd2h.wire.readiness_decoder import ReadinessDecoder

    batch = ReadinessDecoder().decode(protocol.encode(ReadReadyBatch(layer, f"l{layer}", reqs, (), 0, 1)))
    assert isinstance(batch, ReadReadyBatch) and batch.reqs_bytes
    return batch


def test_step_reads_derives_a_step_once_and_its_bytes_per_block_size() -> None:
    from rd2h.decode.rank_reads import StepReads

    reqs = (ReadRequest("a", (1, 2), (1, 2), 0, 0), ReadRequest("b", (3,), (3,), 0, 0))
    dest = {"a": Destinations.of([10, 11]), "b": Destinations.of([12])}
    steps = StepReads(decode_rank=0, decode_tp=1, main_split=MainSplit.SHARED)
    key0, reads0, refused0 = steps.reads(b"peer", _decoded(0, reqs), dest, (("a", 1), ("b", 2)))
    key1, reads1, _ = steps.reads(b"peer", _decoded(1, reqs), dest, (("a", 1), ("b", 2)))
    assert key0 == key1 and reads1 is reads0 and refused0 == {}  # the second layer: nothing derived
    want, _ = plan_reads(_decoded(0, reqs), dest, decode_rank=0, decode_tp=1)
    assert [(r.ext_req_id, r.dst_main.tolist()) for r in reads0] == [(r.ext_req_id, r.dst_main.tolist()) for r in want]
    _, again, _ = steps.reads(b"peer", _decoded(2, reqs), dest, (("a", 3), ("b", 2)))  # a new instance of "a"
    assert again is not reads0
    _, other, _ = steps.reads(b"other", _decoded(2, reqs), dest, (("a", 1), ("b", 2)))  # another peer
    assert other is not reads0
    assert steps.request_bytes(reads0, (64, 8), {}) == {"a": 2 * (64 + 8), "b": 64 + 8}
    assert steps.request_bytes(reads0, (32, 0), {"b": ValueError("x")}) == {"a": 64}  # type: ignore[dict-item]
    unkeyed = ReadReadyBatch(0, "l0", reqs, (), 0, 1)  # built in memory: no packed bytes to key on
    assert steps.reads(b"peer", unkeyed, dest, ())[0] is None
