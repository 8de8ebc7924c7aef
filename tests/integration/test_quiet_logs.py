"""Issue 19, item 6: a peer that floods one kind of bad message costs a bounded number of log
lines, and the lines say how many there were. Real zmq sockets on loopback, real runtimes;
time is moved on the logs' clocks, never slept."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import zmq
from layers import layer_tensors
from rd2h_zmq import ZmqChannel

from rd2h import plugins
from rd2h.api import KVSink, KVSource
from rd2h.clock import ManualClock
from rd2h.decode.sink import Sink
from rd2h.errors import ChannelError
from rd2h.quiet_log import quiet
from rd2h.tensors import layer_layout
from rd2h.testing.channel_suite import until
from rd2h.wire import protocol
from rd2h.wire.endpoint import DecodeEndpoint

FLOOD = 5000
GARBAGE = b"\xc1"  # a byte msgpack never uses: a malformed message, cheap to decode
_MORE = re.compile(r"\(and (\d+) more like this in the last [\d.]+ s\)")



def _reported(records: list[logging.LogRecord], text: str) -> tuple[int, int]:
    """(lines whose message contains ``text``, occurrences they stand for: one each plus counts)."""
    lines = [r.getMessage() for r in records if text in r.getMessage()]
    return len(lines), sum(1 + int(m.group(1)) if (m := _MORE.search(line)) else 1 for line in lines)


@pytest.fixture
def dealer() -> zmq.Socket:
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, 10_000)  # a send never blocks the test without bound
    yield sock
    sock.close(linger=0)
    context.term()


def test_a_flood_of_malformed_frames_to_decode_logs_two_lines_and_their_count(
    kv_port: int, dealer: zmq.Socket, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = ManualClock()
    sink_log = quiet(logging.getLogger("rd2h.decode.sink"))
    monkeypatch.setattr(sink_log, "clock", clock)
    caplog.set_level(logging.WARNING, logger="rd2h.decode.sink")
    with KVSink({"l0": layer_tensors(False)}, kv_port=kv_port) as sink:
        dealer.connect(f"tcp://127.0.0.1:{kv_port}")
        for _ in range(FLOOD):
            dealer.send(GARBAGE)
        assert until(lambda: sink.counters.malformed == FLOOD)
        assert _reported(caplog.records, "malformed message") == (1, 1)  # was one line per frame
        clock.advance(sink_log.interval)
        dealer.send(GARBAGE)  # the next one after the interval carries the count
        assert until(lambda: sink.counters.malformed == FLOOD + 1)
    lines, occurrences = _reported(caplog.records, "malformed message")
    # the loop's flush may write the count before the next frame does: 2 or 3 lines, never more
    assert lines in (2, 3) and occurrences == FLOOD + 1


def test_decode_writes_the_count_of_a_flood_that_ended_without_another_warning(
    kv_port: int, dealer: zmq.Socket, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = ManualClock()
    sink_log = quiet(logging.getLogger("rd2h.decode.sink"))
    monkeypatch.setattr(sink_log, "clock", clock)
    caplog.set_level(logging.WARNING, logger="rd2h.decode.sink")
    with KVSink({"l0": layer_tensors(False)}, kv_port=kv_port) as sink:
        dealer.connect(f"tcp://127.0.0.1:{kv_port}")
        for _ in range(FLOOD):
            dealer.send(GARBAGE)
        assert until(lambda: sink.counters.malformed == FLOOD)
        clock.advance(sink_log.interval)  # the flood is over; nothing else is ever logged
        # the loop flushes on its liveness cadence: the count arrives without a new warning
        assert until(lambda: _reported(caplog.records, "malformed message") == (2, FLOOD))


def test_a_flood_of_malformed_replies_to_prefill_is_logged_with_its_count(
    kv_port: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Prefill dropped malformed replies without a word (only a counter): now the first is
    logged, and the count once its interval ends, by the sender loop on Prefill's clock."""
    clock = ManualClock()
    caplog.set_level(logging.WARNING, logger="rd2h.prefill.source")
    listener = ZmqChannel().listen(f"tcp://127.0.0.1:{kv_port}")
    try:
        with KVSource({"l0": layer_tensors(True)}, block_size=16, clock=clock) as source:
            source.add_request("r", DecodeEndpoint("127.0.0.1", kv_port, 1), main_block_ids=[1], num_tokens=16)
            source.schedule({"r": 16})
            source.layer_ready("l0")
            introduction, ready = listener.recv(10.0), listener.recv(10.0)  # mf_meta, then the readiness
            assert introduction is not None and ready is not None
            peer = introduction[0]
            listener.send(peer, protocol.ACK_FRAME)
            for _ in range(FLOOD):
                while True:  # the listener never blocks: a full queue is an error, so try again
                    try:
                        listener.send(peer, GARBAGE)
                        break
                    except ChannelError:  # Prefill sends nothing now: this only waits for it to drain
                        listener.recv(0.001)
            assert until(lambda: source.counters["malformed"] == FLOOD)
            assert _reported(caplog.records, "malformed") == (1, 1)
            clock.advance(30.0)  # past the log interval, inside the reply timeout
            assert until(lambda: _reported(caplog.records, "malformed")[1] == FLOOD)
            assert _reported(caplog.records, "malformed")[0] == 2
            listener.send(peer, protocol.encode(protocol.ReadDone(0)))  # the flood cost no request
            assert source.wait_finished(["r"], 10)["r"].ok
    finally:
        listener.close()


def test_a_flood_of_multipart_messages_to_a_zmq_listener_logs_two_lines_and_their_count(
    kv_port: int, dealer: zmq.Socket, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = ManualClock()
    channel_log = quiet(logging.getLogger("rd2h_zmq"))
    monkeypatch.setattr(channel_log, "clock", clock)
    caplog.set_level(logging.WARNING, logger="rd2h_zmq")
    listener = ZmqChannel().listen(f"tcp://127.0.0.1:{kv_port}")
    try:
        dealer.connect(listener.address)
        for _ in range(FLOOD):
            dealer.send_multipart([b"one", b"two"])  # not our framing: dropped by the channel
        dealer.send(b"last")
        received = []
        assert until(lambda: received.append(listener.recv(0.05)) or received[-1] is not None)
        assert received[-1][1] == b"last"
        assert _reported(caplog.records, "expected one payload frame") == (1, 1)
        clock.advance(channel_log.interval)
        assert channel_log.flush() == 1
    finally:
        listener.close()
    assert _reported(caplog.records, "expected one payload frame") == (2, FLOOD)


def test_replies_dropped_for_a_peer_that_never_reads_log_two_lines_and_their_count(
    tmp_path: Path, dealer: zmq.Socket, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The 215,787 lines of the attack: a peer announces and never reads, so once its queue and
    the socket buffers are full every reply to it is dropped, each with a warning."""
    clock = ManualClock()
    sink_log = quiet(logging.getLogger("rd2h.decode.sink"))
    monkeypatch.setattr(sink_log, "clock", clock)
    caplog.set_level(logging.WARNING, logger="rd2h.decode.sink")
    listener = ZmqChannel(high_water_mark=1).listen(f"ipc://{tmp_path}/decode")  # ipc: small socket buffers
    readiness = protocol.encode_readiness(0, "l0", protocol.pack_read_reqs([protocol.ReadRequest("r", [1], [1], 0, 0)]))
    sink = Sink(
        rank=0, tp_size=1, engine=plugins.load_engine("local", "decode"), listener=listener,
        layers={"l0": layer_layout(layer_tensors(False))},
    ).start()
    try:
        dealer.setsockopt(zmq.RCVHWM, 1)
        dealer.connect(listener.address)
        sent = 0
        while listener.dropped < 2000 and sent < 200_000:  # each is answered "mf_meta required"
            dealer.send(readiness)
            sent += 1
        dealer.send(GARBAGE)  # handled after every readiness before it: then the count is final
        assert until(lambda: sink.counters.malformed == 1)
        assert listener.dropped >= 2000
        assert _reported(caplog.records, "could not reply") == (1, 1)  # was one line per dropped reply
        clock.advance(sink_log.interval)
        sink_log.flush()
        assert _reported(caplog.records, "could not reply") == (2, listener.dropped)
    finally:
        sink.close()
