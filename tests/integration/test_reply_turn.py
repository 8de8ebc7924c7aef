"""Which thread reads Decode's replies on Prefill (rd2h.prefill.reply_turn): the compute thread
while it waits for its slots, and keeps the role between waits; the sender thread once the
caller leaves it idle or gives it back; only one thread is ever inside the dialer's recv."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from layers import layer_tensors

from rd2h import plugins
from rd2h.api import KVSink, KVSource
from rd2h.prefill.reply_turn import ReplyTurn
from rd2h.prefill.source import Source
from rd2h.tensors import layer_layout
from rd2h.testing.channel_suite import until
from rd2h.wire import protocol

NAMES = ["l0", "l1", "l2", "l3"]


@pytest.fixture(params=["zmq", "tcp"])
def channel(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _layouts(tensors: dict) -> dict:
    return {name: layer_layout(t) for name, t in tensors.items()}


def _pair(kv_port: int, channel: str, **source_options: object) -> tuple[KVSink, Source, list[tuple[int, str]]]:
    """Every layer in one physical slot (each waits for the previous one's reply); the
    replies read are recorded as (layer, reading thread)."""
    slot = layer_tensors(True, seed=1)
    src = dict.fromkeys(NAMES, slot)
    dst = {n: layer_tensors(False) for n in NAMES}
    sink = KVSink(dst, kv_port=kv_port, channel=channel).start()
    if source_options:  # options KVSource does not take: the Source it is made of
        source: Source = Source(
            rank=0, tp_size=1, engine=plugins.load_engine("local", "prefill"),
            dialer=plugins.load_channel(channel).dialer(), layers=_layouts(src), block_size=1, **source_options,
        )  # fmt: skip
    else:
        source = KVSource(src, block_size=1, channel=channel)
    read: list[tuple[int, str]] = []
    on_reply = source._on_reply

    def recording(address: str, frame: bytes) -> None:
        if frame != protocol.ACK_FRAME:
            message = protocol.decode_reply(frame)
            read.append((message.layer_idx, threading.current_thread().name))
        on_reply(address, frame)

    source._on_reply = recording  # type: ignore[method-assign]
    source.start()
    sink.expect("r", main_blocks=[3, 4])
    source.add_request("r", sink.endpoint, main_block_ids=[1, 2], num_tokens=2)
    source.schedule({"r": 2})
    return sink, source, read


@pytest.fixture
def pair(kv_port: int, channel: str) -> Iterator[tuple[KVSink, Source, list[tuple[int, str]]]]:
    sink, source, read = _pair(kv_port, channel)
    with sink, source:
        yield sink, source, read


def _all_layers(source: Source) -> None:
    for name in NAMES:
        source.wait_for_layer_send(name)
        source.layer_ready(name)


def test_the_caller_waiting_for_a_slot_reads_the_reply_itself(pair: tuple[KVSink, Source, list]) -> None:
    sink, source, read = pair
    _all_layers(source)
    assert source.wait_finished(["r"], 30)["r"].ok and sink.wait(["r"], 30)["r"].ok
    caller = threading.current_thread().name
    # l0..l2 freed the slot the next layer waited for: their replies woke this thread
    assert [(layer, thread) for layer, thread in read if layer < 3] == [(0, caller), (1, caller), (2, caller)]
    # the last one nobody waited for: the sender thread read it once the caller gave the role back
    assert read[-1][0] == 3 and read[-1][1].startswith("rd2h-source")
    assert source._turn.caller_reads >= 3  # and the mf_meta ACK


def test_replies_are_read_by_the_sender_thread_once_the_caller_leaves_them(
    pair: tuple[KVSink, Source, list],
) -> None:
    """The caller keeps the role after its last wait; the sender takes it back once unused
    for poll_seconds, without the caller giving it back: no reply waits for ever."""
    sink, source, read = pair
    _all_layers(source)
    assert until(lambda: len(read) == len(NAMES), within=30)  # no wait_finished: nothing is given back
    assert read[-1][0] == 3 and read[-1][1].startswith("rd2h-source")
    assert sink.wait(["r"], 30)["r"].ok
    assert source.wait_finished(["r"], 30)["r"].ok


def test_caller_reads_replies_off_leaves_them_to_the_sender_thread(kv_port: int, channel: str) -> None:
    sink, source, read = _pair(kv_port, channel, caller_reads_replies=False)
    with sink, source:
        _all_layers(source)
        assert source.wait_finished(["r"], 30)["r"].ok
    assert [layer for layer, _ in read] == [0, 1, 2, 3]
    assert all(thread.startswith("rd2h-source") for _, thread in read), read
    assert source._turn.caller_reads == 0


# -- the turn itself, over the memory channel ------------------------------------------------


@pytest.fixture
def ends() -> Iterator[tuple[object, object]]:
    channel = plugins.load_channel("memory")
    listener = channel.listen("memory://reply-turn")
    dialer = channel.dialer()
    try:
        yield listener, dialer
    finally:
        dialer.close()
        listener.close()


def test_a_caller_takes_the_role_from_the_sender_inside_recv(ends: tuple) -> None:
    listener, dialer = ends
    turn = ReplyTurn(dialer, idle_seconds=60.0)
    got: list[tuple[str, bytes]] = []
    sender = threading.Thread(target=turn.sender_turn, args=(60.0, lambda *item: got.append(item)))
    sender.start()
    assert until(lambda: turn.holder == "sender")
    # the caller asks the sender to leave recv (a wakeup), then reads itself
    dialer.send("memory://reply-turn", b"hello")  # connects: the listener can answer this dialer
    identity, _ = listener.recv(5.0)
    # done once the role is the caller's: it asked for it and got it, and reads nothing now
    turn.caller_turn(30.0, lambda *item: got.append(item), lambda: turn.holder == "caller")
    sender.join(10.0)
    assert not sender.is_alive(), "the sender thread stayed in recv: it was never asked to leave it"
    assert turn.holder == "kept"
    listener.send(identity, b"reply")
    turn.caller_turn(10.0, lambda *item: got.append(item), lambda: False)
    assert got == [("memory://reply-turn", b"reply")]
    assert turn.caller_reads == 1


def test_the_kept_role_goes_back_to_the_sender(ends: tuple) -> None:
    listener, dialer = ends
    turn = ReplyTurn(dialer, idle_seconds=60.0)
    dialer.send("memory://reply-turn", b"hello")
    identity, _ = listener.recv(5.0)
    turn.caller_turn(0.0, lambda *item: None, lambda: False)
    assert turn.holder == "kept"
    got: list[tuple[str, bytes]] = []
    listener.send(identity, b"reply")
    turn.sender_turn(0.0, lambda *item: got.append(item))  # kept, not idle long enough: waits, reads nothing
    assert got == []
    turn.give_back()
    assert turn.holder is None
    turn.sender_turn(10.0, lambda *item: got.append(item))
    assert got == [("memory://reply-turn", b"reply")]


def test_a_caller_whose_slot_is_free_reads_nothing(ends: tuple) -> None:
    listener, dialer = ends
    turn = ReplyTurn(dialer, idle_seconds=60.0)
    dialer.send("memory://reply-turn", b"hello")
    identity, _ = listener.recv(5.0)
    listener.send(identity, b"reply")
    got: list[tuple[str, bytes]] = []
    turn.caller_turn(10.0, lambda *item: got.append(item), lambda: True)
    assert got == [] and turn.caller_reads == 0
    turn.give_back()
    turn.sender_turn(10.0, lambda *item: got.append(item))
    assert got == [("memory://reply-turn", b"reply")]


def test_a_caller_never_gets_a_handlers_error_nor_spins_on_a_closed_dialer(ends: tuple) -> None:
    listener, dialer = ends
    turn = ReplyTurn(dialer, idle_seconds=60.0)
    dialer.send("memory://reply-turn", b"hello")
    identity, _ = listener.recv(5.0)
    listener.send(identity, b"reply")

    def broken(address: str, frame: bytes) -> None:
        raise RuntimeError("a defect in handling a reply")

    turn.caller_turn(10.0, broken, lambda: False)  # logged, not raised
    assert turn.holder == "kept" and turn.caller_reads == 1
    dialer.close()
    waited = threading.Event()
    caller = threading.Thread(target=lambda: (turn.caller_turn(0.2, broken, lambda: False), waited.set()))
    caller.start()
    caller.join(10.0)
    assert waited.is_set() and turn.holder == "kept"  # the closed dialer's error ended in a bounded wait
