"""rd2h.decode.peer_limits (pure): peer caps and expiry (issue 9 D3), ids per message counted without
decoding them (D7). The runtime side is tests/integration/test_sink_limits.py."""

from __future__ import annotations

import tracemalloc

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rd2h.decode.peer_limits import PeerBook, PeerLimits, oversized_readiness, oversized_settled
from rd2h.errors import ConfigError
from rd2h.wire import protocol


def never_busy(identity: bytes) -> bool:
    return False


@pytest.mark.parametrize(
    "kwargs",
    [{"max_peers": 0}, {"max_per_source": -1}, {"max_ids_per_message": 1.5}, {"idle_seconds": 0}],
)
def test_bad_limits_are_config_errors(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        PeerLimits(**kwargs)  # type: ignore[arg-type]


def test_one_source_keeps_its_latest_peers() -> None:
    book = PeerBook(PeerLimits(max_per_source=2))
    assert book.admit(b"a", "p1", 0.0, never_busy) == []
    assert book.admit(b"x", "p2", 1.0, never_busy) == []
    assert book.admit(b"b", "p1", 2.0, never_busy) == []
    book.seen(b"a", 3.0)  # a spoke last: b is now the oldest of p1
    assert book.admit(b"c", "p1", 4.0, never_busy) == [b"b"]
    assert b"b" not in book and len(book) == 3


def test_the_cap_in_all_prefers_peers_that_announce_nothing_live() -> None:
    book = PeerBook(PeerLimits(max_peers=2))
    book.admit(b"busy", "p1", 0.0, never_busy)
    book.admit(b"idle", "p2", 1.0, never_busy)
    assert book.admit(b"new", "p3", 2.0, lambda i: i == b"busy") == [b"idle"]
    assert book.admit(b"newer", "p4", 3.0, lambda i: True) == [b"busy"]  # all busy: the oldest


def test_refused_peers_never_push_out_admitted_ones() -> None:
    """Issue 19, item 3: refused identities counted toward max_peers, so 1,100 of them sent in
    4 s evicted an admitted, working Prefill. They have a cap of their own now."""
    book = PeerBook(PeerLimits(max_peers=2, max_refused=3))
    book.admit(b"a", "p1", 0.0, never_busy)
    book.admit(b"b", "p2", 1.0, never_busy)
    evicted = [i for n in range(1100) for i in book.admit(b"cheap%d" % n, None, 2.0 + n, never_busy)]
    assert b"a" in book and b"b" in book and len(evicted) == 1097 and len(book) == 5
    assert book.admit(b"c", "p3", 5000.0, never_busy) == [b"a"]  # admitted peers still share max_peers
    assert book.admit(b"cheap1099", "p4", 5001.0, never_busy) == [b"b"]  # refused, then admitted: now counted as admitted


def test_idle_peers_are_named_once_unless_busy() -> None:
    book = PeerBook(PeerLimits(idle_seconds=10.0))
    book.admit(b"a", "p", 0.0, never_busy)
    book.admit(b"b", "p", 1.0, never_busy)
    book.admit(b"c", "p", 5.0, never_busy)
    assert book.idle(10.5, lambda i: i == b"b") == [b"a"]
    assert book.idle(10.5, never_busy) == []  # a is gone, b spoke 9.5 s ago
    assert book.idle(11.0, never_busy) == [b"b"]
    assert PeerBook(PeerLimits(idle_seconds=None)).idle(1e9, never_busy) == []


def _readiness(reqs: list[tuple[str, int, int]]) -> bytes:
    read_reqs = tuple(protocol.ReadRequest(e, tuple(range(m)), tuple(range(i)), 0, 0) for e, m, i in reqs)
    return protocol.encode(protocol.ReadReadyBatch(3, "layer", read_reqs, ()))


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(0, 70), st.integers(0, 70)), max_size=4),
    st.integers(0, 300),
)
def test_ids_are_counted_exactly(reqs: list[tuple[str, int, int]], limit: int) -> None:
    total = sum(m + i for _, m, i in reqs)
    over = oversized_readiness(_readiness(reqs), limit)
    if total > limit or len(reqs) > limit:  # block ids, or request entries (issue 19: every id is capped)
        assert over is not None and over.ids == total and over.layer_idx == 3 and over.layer_name == "layer"
        assert over.requests == len(reqs)
        named = tuple(dict.fromkeys(e for e, _, _ in reqs)) if len(reqs) <= limit else ()
        assert over.ext_ids == named  # too many to name: the layer is refused whole
    else:
        assert over is None


def test_settled_ids_are_counted_without_decoding_them() -> None:
    """Issue 19, item 4: 5M ids in a 10 MB settled cost Decode +108 MB to decode; they are
    counted from the arrays' headers, the same cap as a readiness's ids."""
    frame = msgpack.packb([b"settled", ["x"] * 3_000_000, ["y"] * 2_000_000, "", ""])
    tracemalloc.start()
    try:
        assert oversized_settled(frame, 1 << 20) == 5_000_000
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 * len(frame)
    small = protocol.encode(protocol.Settled(("a", "b"), ("c",)))
    assert oversized_settled(small, 2) == 3 and oversized_settled(small, 3) is None
    assert oversized_settled(protocol.encode(protocol.ReadDone(1)), 0) is None
    readiness = protocol.encode(protocol.ReadReadyBatch(0, "l", (), tuple("abcdef")))
    over = oversized_readiness(readiness, 5)
    assert over is not None and over.requests == 6 and "6 requests and final ids" in str(over.refusal(5))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300) | st.builds(lambda x: msgpack.packb(x), st.recursive(
    st.none() | st.integers(-(2**63), 2**64 - 1) | st.binary(max_size=20) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=5), max_leaves=30)))
def test_anything_else_is_left_to_the_decoder(data: bytes) -> None:
    over = oversized_readiness(data, 0)
    assert over is None or over.ids > 0 or over.requests > 0


def test_a_huge_readiness_is_judged_without_decoding_its_ids() -> None:
    """D7: one readiness of 20M ids cost 561 MB to decode (~28 bytes per id). Counting them
    here costs a copy of the frame, not the ids: at 2M ids, under 2x the frame."""
    ids = list(range(1_000_000))
    frame = msgpack.packb([b"read_ready_batch", 0, "l0", [["r", ids, ids, 0, 0]], []])
    del ids
    tracemalloc.start()
    try:
        over = oversized_readiness(frame, 1 << 20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert over is not None and over.ids == 2_000_000 and over.ext_ids == ("r",)
    assert peak < 2 * len(frame), f"{peak} bytes to count the ids of a {len(frame)}-byte frame"
