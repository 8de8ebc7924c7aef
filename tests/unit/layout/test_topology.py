"""Topology, ports and the work split: properties over random topologies and chunk lists."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rd2h.errors import ConfigError, PortError, TopologyError
from rd2h.layout.topology import (
    MAX_PORT,
    Topology,
    base_port,
    decode_ports,
    indexer_share,
    main_share,
    rank_port,
    remote_port,
    share,
)

# -- strategies ---------------------------------------------------------------------------


@st.composite
def topologies(draw: st.DrawFn) -> Topology:
    """Supported topologies up to 64 ranks a side, fan-in and fan-out."""
    small = draw(st.integers(1, 64))
    factor = draw(st.integers(1, 64 // small))
    big = small * factor
    if draw(st.booleans()):
        return Topology(prefill_tp=big, decode_tp=small)
    return Topology(prefill_tp=small, decode_tp=big)


@st.composite
def chunk_lists(draw: st.DrawFn) -> list[int]:
    """Chunk sizes of one request's chunked prefill (zero-block chunks allowed)."""
    return draw(st.lists(st.integers(0, 40), min_size=1, max_size=6))


def chunk_starts(sizes: list[int]) -> list[int]:
    starts, s = [], 0
    for n in sizes:
        starts.append(s)
        s += n
    return starts


# -- topology -----------------------------------------------------------------------------


@given(topologies())
def test_every_prefill_rank_maps_to_the_right_decode_ranks(topo: Topology) -> None:
    senders: dict[int, list[int]] = {d: [] for d in range(topo.decode_tp)}
    for p in range(topo.prefill_tp):
        for d in topo.decode_ranks_of(p):
            senders[d].append(p)
    for d in range(topo.decode_tp):
        contributors = topo.contributors_of(d)
        assert len(contributors) == topo.ratio
        assert sorted(senders[d]) == list(contributors)
        # member indices of a group are exactly 0..ratio-1, in order
        assert [topo.member_of(p) for p in contributors] == list(range(topo.ratio))
    assert topo.ratio * topo.decode_tp == max(topo.prefill_tp, topo.decode_tp)
    assert topo.fan_out * topo.prefill_tp == max(topo.prefill_tp, topo.decode_tp)
    assert topo.ratio == 1 or topo.fan_out == 1


def test_spec_mapping_fan_in() -> None:
    topo = Topology(prefill_tp=8, decode_tp=2)
    assert topo.ratio == 4 and topo.fan_out == 1
    assert [topo.decode_ranks_of(p) for p in range(8)] == [(0,)] * 4 + [(1,)] * 4
    assert [topo.member_of(p) for p in range(8)] == [0, 1, 2, 3] * 2
    assert topo.contributors_of(1) == (4, 5, 6, 7)


def test_fan_out_mapping() -> None:
    topo = Topology(prefill_tp=2, decode_tp=8)
    assert topo.ratio == 1 and topo.fan_out == 4
    assert topo.decode_ranks_of(1) == (4, 5, 6, 7)
    assert topo.member_of(1) == 0
    assert [topo.contributors_of(d) for d in range(8)] == [(0,)] * 4 + [(1,)] * 4


@given(st.integers(1, 64), st.integers(1, 64))
def test_unsupported_topologies_raise(p_tp: int, d_tp: int) -> None:
    if p_tp % d_tp == 0 or d_tp % p_tp == 0:
        Topology(p_tp, d_tp)
    else:
        with pytest.raises(TopologyError, match=f"prefill_tp={p_tp} and decode_tp={d_tp}"):
            Topology(p_tp, d_tp)


@pytest.mark.parametrize("bad", [(0, 1), (1, 0), (-2, 2), (1.5, 1), (True, 1), ("2", 1)])
def test_bad_sizes_raise(bad: tuple[object, object]) -> None:
    with pytest.raises(TopologyError):
        Topology(*bad)  # type: ignore[arg-type]


def test_rank_arguments_out_of_range_raise() -> None:
    topo = Topology(4, 2)
    for call, arg in [
        (topo.decode_ranks_of, 4),
        (topo.decode_ranks_of, -1),
        (topo.member_of, 4),
        (topo.contributors_of, 2),
        (topo.contributors_of, -1),
    ]:
        with pytest.raises(TopologyError, match="out of range"):
            call(arg)


def test_topology_errors_are_config_and_value_errors() -> None:
    with pytest.raises(ValueError):
        Topology(3, 2)
    assert issubclass(TopologyError, ConfigError) and issubclass(PortError, ConfigError)


# -- ports --------------------------------------------------------------------------------


def test_ports_follow_the_spec() -> None:
    assert base_port(30000, 3, 4) == 30012
    assert rank_port(30012, 2) == 30014
    assert decode_ports(30000, 1, 4) == [30004, 30005, 30006, 30007]
    assert remote_port(30004, 3, 4) == 30007


def test_highest_decode_port_is_checked() -> None:
    assert decode_ports(65532, 0, 4)[-1] == MAX_PORT
    expected = r"65537 = kv_port 65530 \+ global_dp_rank 1 \* tp_size 4 \+ tp_rank 3"
    with pytest.raises(PortError, match=expected):
        decode_ports(65530, 1, 4)


def test_base_port_above_range_raises() -> None:
    with pytest.raises(PortError, match=r"base port 65545 = kv_port 65500 \+ global_dp_rank 5"):
        base_port(65500, 5, 9)


def test_rank_port_above_range_raises() -> None:
    with pytest.raises(PortError, match="65536 = base_port 65535 \\+ tp_rank 1"):
        rank_port(65535, 1)


def test_remote_port_is_checked() -> None:
    assert remote_port(65534, 1, 2) == MAX_PORT
    with pytest.raises(PortError, match="advertised Decode base port 65535 \\+ d_rank 1"):
        remote_port(65535, 1, 2)
    with pytest.raises(TopologyError, match="d_rank 2 is out of range"):
        remote_port(30000, 2, 2)
    with pytest.raises(PortError):
        remote_port(0, 0, 2)


@pytest.mark.parametrize("kv_port", [0, -1, 65536, 70000])
def test_kv_port_must_be_a_port(kv_port: int) -> None:
    with pytest.raises(PortError, match=f"kv_port {kv_port} is outside"):
        base_port(kv_port, 0, 1)
    with pytest.raises(PortError):
        decode_ports(kv_port, 0, 1)


@given(st.integers(1, MAX_PORT), st.integers(0, 300), st.integers(1, 64))
def test_decode_ports_valid_or_port_error(kv_port: int, dp: int, tp: int) -> None:
    try:
        ports = decode_ports(kv_port, dp, tp)
    except PortError:
        assert kv_port + dp * tp + tp - 1 > MAX_PORT
        return
    assert ports == [rank_port(base_port(kv_port, dp, tp), r) for r in range(tp)]
    assert [remote_port(ports[0], r, tp) for r in range(tp)] == ports
    assert max(ports) <= MAX_PORT


# -- work split ---------------------------------------------------------------------------


def test_split_rule_examples() -> None:
    # 10 blocks over 4 sharers starting at 0: parts 3, 3, 2, 2
    assert [share(10, 4, r, 0) for r in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    # start 1: rank 1 takes position 0
    assert [share(10, 4, r, 1) for r in range(4)] == [(8, 10), (0, 3), (3, 6), (6, 8)]
    # one block lands on the rank that owns the start position
    assert [share(1, 4, r, 6) for r in range(4)] == [(1, 1), (1, 1), (0, 1), (1, 1)]


@given(st.integers(0, 200), st.integers(1, 64), st.integers(0, 10_000))
def test_shares_are_disjoint_contiguous_and_complete(n: int, sharers: int, start: int) -> None:
    parts = sorted(share(n, sharers, r, start) for r in range(sharers))
    cursor = 0
    for lo, hi in parts:
        assert lo == cursor and hi >= lo
        cursor = hi
    assert cursor == n
    lengths = sorted(hi - lo for lo, hi in parts)
    assert lengths[-1] - lengths[0] <= 1


@given(topologies(), chunk_lists(), st.integers(0, 50))
def test_chunked_prefill_reads_each_block_exactly_as_required(
    topo: Topology, sizes: list[int], offset: int
) -> None:
    """Across the chunks of one request: main read once overall, indexer once per Decode rank."""
    starts = [offset + s for s in chunk_starts(sizes)]
    total = sum(sizes)
    main_reads = np.zeros(total, dtype=np.int64)
    for d in range(topo.decode_tp):
        index_reads = np.zeros(total, dtype=np.int64)
        for p in topo.contributors_of(d):
            member = topo.member_of(p)
            for n, s in zip(sizes, starts):
                lo, hi = main_share(n, s, topo.decode_tp, d, member)
                if member != 0:
                    assert (lo, hi) == (0, 0)
                main_reads[s - offset + lo : s - offset + hi] += 1
                lo, hi = indexer_share(n, s, topo.ratio, member)
                index_reads[s - offset + lo : s - offset + hi] += 1
        assert (index_reads == 1).all()
    assert (main_reads == 1).all()


@given(topologies())
def test_fan_out_gets_the_full_indexer_from_one_contributor(topo: Topology) -> None:
    if topo.fan_out == 1:
        return
    for d in range(topo.decode_tp):
        (p,) = topo.contributors_of(d)
        assert d in topo.decode_ranks_of(p)
        assert indexer_share(17, 5, topo.ratio, topo.member_of(p)) == (0, 17)


@given(st.integers(2, 64), st.data())
def test_small_chunks_rotate_over_ranks(sharers: int, data: st.DataObject) -> None:
    n = data.draw(st.integers(1, sharers - 1))
    owners_seen: set[int] = set()
    for start in range(3 * sharers):
        spans = [share(n, sharers, r, start) for r in range(sharers)]
        owners = {r for r, (lo, hi) in enumerate(spans) if hi > lo}
        # the n one-block shares go to the n ranks from the start position on, wrapping
        assert owners == {(start + i) % sharers for i in range(n)}
        owners_seen |= owners
    assert owners_seen == set(range(sharers))  # not always rank 0


def test_bad_split_arguments_raise() -> None:
    with pytest.raises(TopologyError, match="rank 4 is out of range"):
        share(10, 4, 4, 0)
    with pytest.raises(TopologyError, match="sharers must be >= 1"):
        share(10, 0, 0, 0)
    with pytest.raises(TopologyError, match="n=-1"):
        share(-1, 4, 0, 0)
    with pytest.raises(TopologyError, match="start=-3"):
        indexer_share(5, -3, 2, 0)
    with pytest.raises(TopologyError, match="member must be >= 0"):
        main_share(5, 0, 2, 0, -1)
    with pytest.raises(TopologyError, match="out of range"):
        main_share(5, 0, 2, 2, 1)  # rank checked even for members that read nothing
