"""Which thread announces a layer: the caller's when the KV is written and nothing is queued
before it, the sender thread otherwise, and layers always go out in order."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from layers import layer_tensors

from rd2h.api import KVSink, KVSource
from rd2h.wire import protocol

NAMES = ["l0", "l1", "l2"]


class _GatedEvent:
    """A device event that completes when the test says so."""

    def __init__(self) -> None:
        self.done = threading.Event()

    def synchronize(self) -> None:
        assert self.done.wait(30)


@pytest.fixture
def pair(kv_port: int, request: pytest.FixtureRequest) -> Iterator[tuple[KVSink, KVSource, list[tuple[int, str]]]]:
    """A sink and a source whose readiness frames are recorded as (layer, sending thread)."""
    src = {n: layer_tensors(True, seed=i) for i, n in enumerate(NAMES)}
    dst = {n: layer_tensors(False) for n in NAMES}
    inline = getattr(request, "param", True)
    sent: list[tuple[int, str]] = []
    with KVSink(dst, kv_port=kv_port) as sink, KVSource(src, block_size=1, inline_announce=inline) as source:
        dialer_send = source._dialer.send

        def recording_send(address: str, frame: bytes) -> None:
            message = protocol.decode(frame)
            if isinstance(message, protocol.ReadReadyBatch):
                sent.append((message.layer_idx, threading.current_thread().name))
            dialer_send(address, frame)

        source._dialer.send = recording_send  # type: ignore[method-assign]
        sink.expect("r", main_blocks=[3, 4])
        source.add_request("r", sink.endpoint, main_block_ids=[1, 2], num_tokens=2)
        source.schedule({"r": 2})
        yield sink, source, sent


def _finished(sink: KVSink, source: KVSource) -> None:
    assert source.wait_finished(["r"], 30)["r"].ok
    assert sink.wait(["r"], 30)["r"].ok


def test_a_written_layer_is_announced_on_the_callers_thread(pair: tuple[KVSink, KVSource, list]) -> None:
    sink, source, sent = pair
    for name in NAMES:
        source.wait_for_layer_send(name)
        source.layer_ready(name)
    _finished(sink, source)
    caller = threading.current_thread().name
    assert sent == [(0, caller), (1, caller), (2, caller)]


@pytest.mark.parametrize("pair", [False], indirect=True)
def test_inline_announce_off_sends_from_the_sender_thread(pair: tuple[KVSink, KVSource, list]) -> None:
    sink, source, sent = pair
    for name in NAMES:
        source.layer_ready(name)
    _finished(sink, source)
    assert [layer for layer, _ in sent] == [0, 1, 2]
    assert all(thread.startswith("rd2h-source") for _, thread in sent), sent


def test_a_layer_behind_a_pending_event_waits_its_turn(pair: tuple[KVSink, KVSource, list]) -> None:
    sink, source, sent = pair
    event = _GatedEvent()
    source.layer_ready("l0", event)  # the sender thread waits for the device
    source.layer_ready("l1")  # written, but l0 is still queued: it must not overtake it
    assert sent == []
    event.done.set()
    source.wait_for_layer_send("l1")  # l1 was announced (and answered) after l0
    source.layer_ready("l2")  # the queue is empty again: inline
    _finished(sink, source)
    caller = threading.current_thread().name
    assert [layer for layer, _ in sent] == [0, 1, 2]
    assert sent[0][1].startswith("rd2h-source") and sent[1][1].startswith("rd2h-source")
    assert sent[2] == (2, caller)
