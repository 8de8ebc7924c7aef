"""A Prefill Source over the zmq dialer, and a Decode that stops reading with the last layer's
frame waiting for it: Prefill sends nothing more there, yet that Decode's request fails about
``send_timeout`` after (the writer fails the connection and wakes the Prefill, which asks the
dialer's ``take_failures``), not at ``reply_timeout``; another Decode's request in the same step
completes. Real sockets on loopback, the real codec, the local engine."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from typing import TypeVar

import numpy as np
from rd2h_zmq import ZmqChannel

from rd2h import plugins
from rd2h.errors import ChannelError
from rd2h.interfaces import Dialer, Listener
from rd2h.outcome import TerminalState
from rd2h.prefill.source import Source
from rd2h.tensors import LayerTensors, layer_layout
from rd2h.testing.channel_suite import free_tcp_address
from rd2h.wire import protocol
from rd2h.wire.endpoint import DecodeEndpoint

T = TypeVar("T")
SEND_TIMEOUT = 2.0  # the failure comes about this long after the frame began to wait
REPLY_TIMEOUT = 120.0  # what the stuck request waited for before the fix
WITHIN = 40.0  # a bound for the outcome: far above SEND_TIMEOUT, far below REPLY_TIMEOUT


def _endpoint(address: str) -> DecodeEndpoint:
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    return DecodeEndpoint(host, int(port), 1)


def _layers() -> dict[str, LayerTensors]:
    rng = np.random.default_rng(0)
    return {
        f"l{i}": LayerTensors(main=[rng.integers(1, 255, (4, 64), dtype=np.uint8)], indexer=None) for i in range(2)
    }


def _answer(listener: Listener, stop: threading.Event) -> None:
    """A Decode that reads: it acknowledges mf_meta and answers every readiness ReadDone."""
    while not stop.is_set():
        item = listener.recv(0.1)
        if item is None:
            continue
        message = protocol.decode_request(item[1])
        if isinstance(message, protocol.ReadReadyBatch):
            listener.send(item[0], protocol.encode(protocol.ReadDone(message.layer_idx)))
        elif isinstance(message, protocol.MfMeta):
            listener.send(item[0], protocol.ACK_FRAME)


def _source(dialer: Dialer) -> Source:
    return Source(
        rank=0, tp_size=1, engine=plugins.load_engine("local", "prefill"), dialer=dialer, block_size=16,
        layers={name: layer_layout(t) for name, t in _layers().items()}, reply_timeout=REPLY_TIMEOUT,
    ).start()


def test_a_decode_that_stops_reading_with_the_last_layer_queued_fails_its_request_at_send_timeout(
    closer: Callable[[T], T],
) -> None:
    server = closer(socket.create_server(("127.0.0.1", 0)))  # the stuck Decode: accepts, never reads or answers
    stuck = f"tcp://127.0.0.1:{server.getsockname()[1]}"
    channel = ZmqChannel(high_water_mark=5, send_timeout=SEND_TIMEOUT)
    live = closer(channel.listen(free_tcp_address()))
    stop = threading.Event()
    answering = threading.Thread(target=_answer, args=(live, stop), daemon=True)
    answering.start()
    dialer = channel.dialer()
    try:
        with _source(dialer) as source:
            source.add_request("stuck", _endpoint(stuck), main_block_ids=[1], num_tokens=16)
            source.add_request("live", _endpoint(live.address), main_block_ids=[2], num_tokens=16)
            source.schedule({"stuck": 16, "live": 16})
            source.wait_for_layer_send("l0")
            source.layer_ready("l0")  # on this thread: both connections are made
            for i in range(2000):  # libzmq's queue to the stuck Decode fills; what follows waits in its outbox
                if dialer.waiting(stuck):  # type: ignore[attr-defined]
                    break
                dialer.send(stuck, b"frame %d" % i)
            assert dialer.waiting(stuck), "the stuck Decode took 2000 frames unread"  # type: ignore[attr-defined]
            source.wait_for_layer_send("l1")
            source.layer_ready("l1")  # the last layer: its frame waits; nothing more goes there
            outcomes = source.wait_finished(["stuck", "live"], WITHIN)  # WaitTimeout before the fix
            assert outcomes["live"].state is TerminalState.DONE
            assert outcomes["stuck"].state is TerminalState.FAILED
            assert isinstance(outcomes["stuck"].error, ChannelError)
            assert "took none" in str(outcomes["stuck"].error)
            assert dialer.take_failures() == {}  # reported once: consumed by the Prefill
    finally:
        stop.set()
        answering.join(10)
