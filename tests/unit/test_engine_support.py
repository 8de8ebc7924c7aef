"""Shared engine helpers: the metadata envelope refuses anything but its own blob, naming why."""

from __future__ import annotations

from dataclasses import dataclass

import msgpack
import numpy as np
import pytest

from rd2h.engine_support import MetadataEnvelope, breaks_session_on_timeout, check_read, check_read_arrays
from rd2h.errors import PeerGoneError, RegionError, TransferError, TransferTimeout
from rd2h.layout.regions import RegionSet

ENV = MetadataEnvelope("toy", b"rd2h-toy", 3)


def test_round_trip_ignores_appended_fields() -> None:
    blob = msgpack.packb((b"rd2h-toy", 3, "peer", [[4096, 10]], "a later field"), use_bin_type=True)
    peer, regions = ENV.unpack(blob, 2)
    assert peer == "peer" and ENV.regions(regions) == [(4096, 10)]
    assert ENV.unpack(ENV.pack("x", []), 2) == ["x", []]


@pytest.mark.parametrize(
    ("blob", "why"),
    [
        ("text", "expected bytes"),
        (b"\xc1", "not msgpack"),
        (msgpack.packb((b"rd2h-toy", 3)), "at least 4 fields"),
        (msgpack.packb((b"other", 3, 1, 2)), "not produced by the toy engine"),
        (msgpack.packb((b"rd2h-toy", 4, 1, 2)), "version 4"),
    ],
)
def test_foreign_blobs_are_refused(blob: object, why: str) -> None:
    with pytest.raises(TransferError, match=f"malformed toy-engine metadata: .*{why}"):
        ENV.unpack(blob, 2)


@pytest.mark.parametrize("raw", [None, [[1]], [[-1, 5]], [[0, 0]], [[2**63 - 2, 5]], [["a", 1]]])
def test_bad_regions_are_refused(raw: object) -> None:
    with pytest.raises(TransferError, match="region"):
        ENV.regions(raw)


def test_read_arrays_are_checked() -> None:
    ok = np.zeros(3, np.int64)
    assert check_read_arrays(ok, ok, np.ones(3, np.int64)) == 3
    with pytest.raises(TransferError, match="int64"):
        check_read_arrays(ok.astype(np.int32), ok, ok)
    with pytest.raises(TransferError, match="differ in length"):
        check_read_arrays(ok, ok[:2], ok)
    with pytest.raises(TransferError, match="> 0"):
        check_read_arrays(ok, ok, ok)
    assert check_read_arrays(ok, ok, ok, positive_lengths=False) == 3


def test_bounded_call_returns_times_out_and_maps_errors() -> None:
    import threading

    from rd2h.engine_support import bounded_call
    from rd2h.errors import PeerGoneError, TransferError, TransferTimeout

    assert bounded_call("x", "add", lambda: 1 + 1, 5) == 2
    release = threading.Event()
    with pytest.raises(TransferTimeout, match="x stuck did not return"):
        bounded_call("x", "stuck", lambda: release.wait(10), 0.05)
    release.set()  # the overrunning call's thread ends on its own
    with pytest.raises(PeerGoneError):  # rd2h's own errors pass through
        bounded_call("x", "gone", lambda: (_ for _ in ()).throw(PeerGoneError("gone")), 5)
    with pytest.raises(TransferError, match="x boom raised OSError"):
        bounded_call("x", "boom", lambda: (_ for _ in ()).throw(OSError("eio")), 5)
    with pytest.raises(PeerGoneError, match="mapped"):
        bounded_call("x", "boom", lambda: (_ for _ in ()).throw(OSError("eio")), 5, lambda e, w: PeerGoneError(f"mapped {w}"))


def test_goes_quiet_waits_out_a_listener_that_closes_a_moment_later() -> None:
    import socket
    import threading

    from rd2h.engine_support import answers_at, goes_quiet

    listener = socket.create_server(("127.0.0.1", 0))
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    assert answers_at(address, 1.0)
    assert goes_quiet(address, within=0.2) is False  # alive throughout
    closer = threading.Timer(0.3, listener.close)  # the peer's process is still exiting
    closer.start()
    assert goes_quiet(address, within=5.0) is True
    closer.join()
    assert not answers_at(address, 1.0) and not answers_at("no-port", 1.0)


@dataclass
class _Session:
    engine: object
    peer_id: str = "peer"
    closed: bool = False
    broken: str = ""
    bounds: RegionSet = RegionSet([(1 << 20, 4096)])


def _arrays(local: int, remote: int, length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return tuple(np.array([v], dtype=np.int64) for v in (local, remote, length))  # type: ignore[return-value]


def test_check_read_refuses_what_no_engine_may_read_and_counts_what_it_may() -> None:
    engine, other = object(), object()
    local_bounds = RegionSet([(2 << 20, 4096)])
    ok = _arrays(2 << 20, 1 << 20, 4096)
    assert check_read(engine, _Session(engine), local_bounds, *ok) == 1
    empty = tuple(np.zeros(0, dtype=np.int64) for _ in range(3))
    assert check_read(engine, _Session(engine, bounds=RegionSet()), local_bounds, *empty) == 0  # nothing to check
    with pytest.raises(TransferError, match="not a session of this"):
        check_read(engine, _Session(other), local_bounds, *ok)
    with pytest.raises(TransferError, match="closed"):
        check_read(engine, _Session(engine, closed=True), local_bounds, *ok)
    with pytest.raises(TransferTimeout, match="unusable: stuck"):
        check_read(engine, _Session(engine, broken="stuck"), local_bounds, *ok)
    with pytest.raises(PeerGoneError, match="unusable"):
        check_read(engine, _Session(engine, broken="gone"), local_bounds, *ok, broken=PeerGoneError)
    with pytest.raises(RegionError, match="remote range from peer"):
        check_read(engine, _Session(engine), local_bounds, *_arrays(2 << 20, 1 << 20, 4097))
    with pytest.raises(RegionError, match="local destination"):
        check_read(engine, _Session(engine), local_bounds, *_arrays(3 << 20, 1 << 20, 16))


def test_a_timed_out_read_leaves_its_session_refusing_reads() -> None:
    engine = object()
    session = _Session(engine)
    with pytest.raises(TransferTimeout), breaks_session_on_timeout(session):
        raise TransferTimeout("the native read did not return")
    assert session.broken == "the native read did not return"
    with pytest.raises(TransferTimeout, match="unusable"):
        check_read(engine, session, RegionSet([(2 << 20, 4096)]), *_arrays(2 << 20, 1 << 20, 16))
    other = _Session(engine)
    with pytest.raises(TransferError), breaks_session_on_timeout(other):
        raise TransferError("an ordinary failure")
    assert other.broken == ""  # only a timeout breaks the session
