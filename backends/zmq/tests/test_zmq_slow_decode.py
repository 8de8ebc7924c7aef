"""The zmq dialer and a Decode that does not read, on real sockets: the shared suites
(``rd2h.testing.stuck_decode_suite``: the channel, and a Prefill Source over it whose Decode
stops reading), and what only this dialer has: a race between its writer failing a connection
and a disconnect, and its outbox limit in bytes, not frames."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import TypeVar

import pytest

from rd2h.errors import ChannelError
from rd2h.testing.stuck_decode_suite import (
    MOST_FRAMES,
    PATIENT,
    LostFramesConformance,
    StuckDecodeConformance,
    ThenLock,
    hung_up,
)

T = TypeVar("T")


class TestZmqStuckDecode(StuckDecodeConformance, LostFramesConformance):
    channel_name = "zmq"
    stuck_options = {"high_water_mark": 5}  # libzmq queues 5 frames; the rest wait in the outbox
    big_frame_bytes = 256 << 10
    backed_up_at = 20  # frames waiting: 5 MiB, more than any buffer on the way takes while nobody reads
    failure_match = "took none"

    def assert_connected_again(self, conn: socket.socket, payload: bytes) -> None:
        assert conn.recv(1) == b"\xff"  # a ZMTP greeting: the stuck server never answers it

    def test_a_disconnect_as_the_writer_fails_a_connection_drops_the_failure(
        self, closer: Callable[[T], T]
    ) -> None:
        """The writer takes the connection out of the table and records its failure in one hold
        of the lock: a disconnect right after the connection left the table (before, the failure
        was recorded in a second hold, after it) leaves no failure behind for the next send."""
        server, stuck = self.stuck_server(closer)
        dialer = closer(self.make_channel(send_timeout=1.0).dialer())
        lock = ThenLock("rd2h-zmq-writer", lambda: dialer.disconnect(stuck))
        dialer._lock = lock  # type: ignore[attr-defined]  # the writer takes it first when it fails the connection
        self.fill(dialer, stuck, lambda i: b"frame %d" % i, until=1)
        conn = closer(server.accept()[0])
        assert hung_up(conn, 30.0), "the connection to a Decode that does not read was never failed"
        assert lock.ran.is_set()
        dialer.send(stuck, b"again")  # disconnected: no failure left to raise, it connects again
        again = closer(server.accept()[0])
        again.settimeout(self.arrival)
        self.assert_connected_again(again, b"again")

    def test_a_decode_far_behind_but_reading_is_not_failed_for_a_burst(self, closer: Callable[[T], T]) -> None:
        """A burst of many more frames than high_water_mark (80 layers x a few steps) to a Decode
        that reads them later: all wait in order and arrive; only bytes past max_queued_bytes fail it."""
        channel = self.make_channel(send_timeout=PATIENT)
        slow = closer(channel.listen(self.make_address()))
        dialer = closer(channel.dialer())
        sent = self.fill(dialer, slow.address, lambda i: b"%06d" % i + b"f" * self.big_frame_bytes, until=2)
        more = [b"%06d" % (len(sent) + i) for i in range(400)]  # 80 x high_water_mark frames more
        for frame in more:  # queued behind the waiting ones (a frame cap of 2 x high_water_mark failed it here)
            dialer.send(slow.address, frame)
        for expected in [*sent, *more]:  # the Decode reads at last: every frame, in order
            got = slow.recv(self.arrival)
            assert got is not None and got[1] == expected

    def test_a_decode_past_max_queued_bytes_is_failed_at_once(self, closer: Callable[[T], T]) -> None:
        limit = 4 << 20
        channel = self.make_channel(send_timeout=PATIENT, max_queued_bytes=limit)
        stuck = closer(channel.listen(self.make_address()))
        dialer = closer(channel.dialer())
        frame = b"f" * self.big_frame_bytes
        self.fill(dialer, stuck.address, until=1)
        waited = 0
        with pytest.raises(ChannelError, match="max_queued_bytes"):
            for _ in range(MOST_FRAMES):  # a frame that waited may still leave: count what waits, not what was sent
                waited = dialer.waiting(stuck.address)  # type: ignore[attr-defined]
                dialer.send(stuck.address, frame)
        assert (waited + 1) * len(frame) > limit, "failed before its outbox would pass max_queued_bytes"
