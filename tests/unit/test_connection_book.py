"""The listener's connection bound as pure logic (issue 19, item 3): which connection to close.

Without it every connection cost Decode an fd for as long as its peer kept it (1,100
refused peers: 27 -> 1,129 fds). Times are passed in; no sockets.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rd2h.connection_book import ConnectionBook, Standing

HOST = ("host", "127.0.0.1")
OTHER = ("host", "127.0.0.2")


def closed_all(book: ConnectionBook, now: float) -> list[int]:
    fds = []
    while (chosen := book.next_to_close(now)) is not None:
        book.closed(chosen[0].fd)
        fds.append(chosen[0].fd)
    return fds


def test_the_bound_must_be_a_positive_int() -> None:
    for bad in (0, -1, 1.5, True, "8"):
        with pytest.raises(ValueError, match="max_unadmitted"):
            ConnectionBook(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="grace"):
        ConnectionBook(8, grace=-1)


def test_within_a_quarter_of_the_bound_nothing_is_closed() -> None:
    book = ConnectionBook(16, grace=1.0)
    for fd in range(4):
        book.accepted(fd, HOST, None, 0.0)
        book.disown(b"p%d" % fd, 0.0)
    assert closed_all(book, 100.0) == []


def test_silent_connections_go_after_their_grace_and_refused_ones_at_once() -> None:
    """A connection's first message may still be on its way (a burst of connections delays
    libzmq's handshakes): a silent one is closed once its grace is over; one whose peer was
    refused has had its chance."""
    book = ConnectionBook(16, grace=1.0)  # soft: 4
    for fd in range(6):
        book.accepted(fd, HOST, None, 0.0)
    book.carried(5, b"refused", 0.0)
    book.disown(b"refused", 0.0)
    assert closed_all(book, 0.5) == [5]  # refused: at once; silent ones are young
    assert closed_all(book, 1.0) == [0]  # back to the soft bound, oldest first
    assert book.unadmitted == 4


def test_a_peer_still_deciding_is_closed_only_past_the_bound() -> None:
    book = ConnectionBook(8, grace=0.0)  # soft: 2
    for fd in range(8):
        book.accepted(fd, HOST, None, 0.0)
        book.carried(fd, b"p%d" % fd, 0.0)  # each spoke; none admitted or refused yet
    assert closed_all(book, 100.0) == []
    book.accepted(8, HOST, None, 1.0)
    assert closed_all(book, 1.0) == [8]  # past the bound: the silent one goes first
    book.accepted(9, HOST, None, 2.0)
    book.carried(9, b"p9", 2.0)
    assert closed_all(book, 2.0) == [0]  # then the longest undecided


def test_an_admitted_peer_is_never_closed() -> None:
    book = ConnectionBook(1, grace=0.0)
    book.accepted(3, HOST, None, 0.0)
    book.carried(3, b"good", 0.0)
    book.vouch(b"good", 0.0)
    for fd in range(10, 50):
        book.accepted(fd, HOST, None, 1.0)
        closed_all(book, 1.0)
    assert book.standing(3) is Standing.VOUCHED
    book.disown(b"good", 2.0)  # forgotten by Decode: a stranger again, first to go
    book.accepted(60, HOST, None, 2.0)
    assert 3 in closed_all(book, 2.0)


def test_a_reconnection_leaves_the_old_connection_first_in_line() -> None:
    """A DEALER that reconnects with its routing id (ROUTER_HANDOVER) leaves the old
    connection open and unroutable: it goes first, even if its peer was admitted."""
    book = ConnectionBook(4, grace=0.0)  # soft: 1
    book.accepted(3, HOST, None, 0.0)
    book.carried(3, b"good", 0.0)
    book.vouch(b"good", 0.0)
    book.accepted(4, HOST, None, 1.0)
    book.carried(4, b"good", 1.0)  # the same identity over a new connection
    assert book.standing(4) is Standing.VOUCHED
    assert book.standing(3) is Standing.DISOWNED
    book.accepted(5, HOST, None, 2.0)
    assert closed_all(book, 2.0) == [3]


def test_a_refused_peer_reconnecting_is_first_in_line_again() -> None:
    book = ConnectionBook(4, grace=10.0)
    book.accepted(3, HOST, None, 0.0)
    book.carried(3, b"bad", 0.0)
    book.disown(b"bad", 0.0)
    book.closed(3)
    book.accepted(3, HOST, None, 1.0)  # the same fd number, a new connection
    assert book.standing(3) is Standing.SILENT
    book.carried(3, b"bad", 1.0)
    assert book.standing(3) is Standing.DISOWNED


def test_the_host_holding_the_most_pays() -> None:
    """A flood from one host never closes another host's connection."""
    book = ConnectionBook(8, grace=0.0)
    book.accepted(3, OTHER, None, 0.0)  # the oldest silent connection, alone on its host
    for fd in range(10, 40):
        book.accepted(fd, HOST, None, 1.0)
        closed_all(book, 1.0)
    assert book.standing(3) is Standing.SILENT
    assert book.unadmitted == 2  # the soft bound: this host's one and the other's


def test_a_connection_being_closed_is_not_revived_by_a_late_message() -> None:
    book = ConnectionBook(1, grace=0.0)
    book.accepted(3, HOST, None, 0.0)
    book.accepted(4, HOST, None, 0.0)
    (conn, was), = [book.next_to_close(0.0)]  # type: ignore[misc]
    assert (conn.fd, was) == (3, Standing.SILENT)
    book.carried(3, b"late", 0.0)
    book.vouch(b"late", 0.0)
    assert book.standing(3) is Standing.CLOSING
    assert book.unadmitted == 1


ops = st.lists(
    st.tuples(
        st.sampled_from(["accept", "close", "carry", "vouch", "disown", "enforce"]),
        st.integers(0, 11),  # fd
        st.integers(0, 5),  # identity
        st.integers(0, 2),  # source
    ),
    max_size=120,
)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_any_sequence_keeps_the_bound_and_never_closes_an_admitted_carrier(steps: list) -> None:
    book = ConnectionBook(4, grace=0.5)
    now = 0.0
    for op, fd, who, source in steps:
        now += 0.1
        identity = b"p%d" % who
        if op == "accept":
            book.accepted(fd, source, None, now)
        elif op == "close":
            book.closed(fd)
        elif op == "carry":
            book.carried(fd, identity, now)
        elif op == "vouch":
            book.vouch(identity, now)
        elif op == "disown":
            book.disown(identity, now)
        else:
            while (chosen := book.next_to_close(now)) is not None:
                conn, was = chosen
                assert was is not Standing.VOUCHED
                assert conn.identity is None or conn.identity not in book._vouched or book._carrier.get(
                    conn.identity
                ) != conn.fd
                book.closed(conn.fd)
            assert book.unadmitted <= book.max_unadmitted
        counts = book.counts()
        capped = counts[Standing.DISOWNED] + counts[Standing.SILENT] + counts[Standing.UNDECIDED]
        assert capped == book.unadmitted
        assert sum(s.count for s in book._sources.values()) == book.unadmitted
