"""vLLM's P/D convention over rd2h (rd2h.vllm.handoff): the signed params, the ask, the hold
table, and the listener and asker on real ZMQ sockets over loopback."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import pytest
from conftest import free_base_port

from rd2h.vllm.handoff import (
    Held,
    HoldTable,
    accept_ask,
    accept_handoff,
    ask_fields,
    ask_urls,
    handoff_params,
    prompt_digest,
    release_fields,
)
from rd2h.vllm.handoff_net import HandoffAsker, HandoffListener
from rd2h.vllm.vouch import sign

SECRET = b"rd2h-unit-test-secret-0123456789"
OTHER = b"another-secret-of-32-bytes-000000"
TOKENS = list(range(3, 103))
EXT = "ab" * 16


def params(now: float | None = None, *, ttl: float = 60.0, tokens: list[int] = TOKENS, port: int = 5800,
           tp: int = 1) -> dict:
    return handoff_params(
        SECRET, ext_id=EXT, engine_id="prefill-0", host="127.0.0.1", port=port, tp=tp, token_ids=tokens,
        blocks=[[4, 5, 6, 7]], block_size=32, mode="dense", now=time.time() if now is None else now, ttl=ttl,
    )


def accept(raw: object, tokens: list[int] = TOKENS, block_size: int = 32, now: float | None = None):
    return accept_handoff(SECRET, raw, tokens, time.time() if now is None else now, block_size=block_size,
                          mode="dense")


def test_prefills_params_use_vllms_field_names_and_decode_accepts_them() -> None:
    p = params(port=5800, tp=2)
    assert p["do_remote_prefill"] is True and p["do_remote_decode"] is False  # forwarded to Decode as they are
    assert (p["remote_request_id"], p["remote_host"], p["remote_port"], p["tp_size"]) == (EXT, "127.0.0.1", 5800, 2)
    assert (p["remote_block_ids"], p["remote_num_tokens"], p["remote_engine_id"]) == ([[4, 5, 6, 7]], 100, "prefill-0")
    handoff = accept(p["rd2h"])
    assert (handoff.ext_id, handoff.num_tokens) == (EXT, 100)
    assert ask_urls(handoff) == ["tcp://127.0.0.1:5800", "tcp://127.0.0.1:5801"]  # one per Prefill rank


@pytest.mark.parametrize("change, why", [
    ({"port": 6666}, "signature does not match"),  # a router or client redirecting the ask
    ({"id": "cd" * 16}, "signature does not match"),
    ({"sig": None}, "not signed"),
])
def test_decode_refuses_altered_or_unsigned_params(change: dict, why: str) -> None:
    raw = {**params()["rd2h"], **change}
    with pytest.raises(ValueError, match=why):
        accept(raw)


def test_decode_refuses_params_of_another_secret_prompt_layout_or_past_the_hold() -> None:
    forged = {**params()["rd2h"]}
    forged = sign(OTHER, {k: v for k, v in forged.items() if k not in ("sig", "exp")}, time.time())
    with pytest.raises(ValueError, match="signature does not match"):
        accept(forged)
    with pytest.raises(ValueError, match="another prompt"):
        accept(params()["rd2h"], tokens=[*TOKENS[:-1], 999])
    with pytest.raises(ValueError, match="block size"):
        accept(params()["rd2h"], block_size=64)
    with pytest.raises(ValueError, match="expired"):  # signed for the hold time only
        accept(params(ttl=5.0)["rd2h"], now=time.time() + 10)
    with pytest.raises(ValueError, match="leg"):  # an ask is not a hand-off
        accept(ask_fields(SECRET, EXT, "127.0.0.1:5600/1", 0, 100, time.time()))


def ask(secret: bytes = SECRET, ext_id: str = EXT, tokens: int = 100, first_block: int = 0) -> bytes:
    return json.dumps(ask_fields(secret, ext_id, "127.0.0.1:5600/1", first_block, tokens, time.time())).encode()


def held(deadline: float = 1e12, ext_id: str = EXT) -> Held:
    return Held(ext_id, "cmpl-1", ((4, 5, 6, 7),), 100, deadline)


def test_an_ask_is_parsed_and_bad_ones_are_refused_with_a_reason() -> None:
    parsed = accept_ask(SECRET, ask(first_block=2), time.time())
    assert (parsed.ext_id, str(parsed.endpoint), parsed.first_block, parsed.num_tokens) == (
        EXT, "127.0.0.1:5600/1", 2, 100)
    for raw, why in [(b"\xff", "not JSON"), (b"[1]", "expected an object"), (ask(OTHER), "signature"),
                     (b" " * 70_000, "at most")]:
        with pytest.raises(ValueError, match=why):
            accept_ask(SECRET, raw, time.time())


@pytest.mark.parametrize("leg", ["ask", "release"])
def test_an_ask_nested_too_deeply_is_refused_never_raised(leg: str) -> None:
    """Decoding or verifying (which encodes it again, a few frames deeper) may pass Python's
    recursion limit: every depth around it is a ValueError, never a RecursionError that would
    end the listener's thread."""
    for depth in range(400, 1200, 3):
        raw = b'{"leg": "%s", "sig": "x", "a": %s%s}' % (leg.encode(), b"[" * depth, b"]" * depth)
        with pytest.raises(ValueError):
            accept_ask(SECRET, raw, time.time())
        assert "ask refused" in HoldTable().answer(SECRET, raw, time.time(), 0.0)["error"]


def test_a_held_request_goes_once_to_the_first_valid_ask() -> None:
    table = HoldTable()
    assert table.answer(SECRET, ask(), time.time(), 0.0) == {"id": EXT, "retry": "not held yet"}
    table.hold(held())
    assert table.answer(SECRET, ask(OTHER), time.time(), 0.0)["error"].startswith("ask refused")
    assert table.answer(SECRET, ask(tokens=99), time.time(), 0.0)["error"] == "asked for 99 tokens, 100 held"
    assert table.answer(SECRET, ask(), time.time(), 0.0) == {"id": EXT, "ok": True}
    assert "already sent" in table.answer(SECRET, ask(), time.time(), 0.0)["error"]  # a replay gets nothing
    ((h, a),) = table.take_claimed()
    assert (h.req_id, a.first_block) == ("cmpl-1", 0)
    assert table.take_claimed() == [] and len(table) == 0


def test_a_hold_expires_and_a_late_ask_is_told_so() -> None:
    table = HoldTable()
    table.hold(held(deadline=10.0))
    assert table.expire(5.0) == [] and len(table) == 1
    assert "expired" in table.answer(SECRET, ask(), time.time(), 11.0)["error"]  # past it, before the worker ran
    (gone,) = table.expire(11.0)
    assert gone.req_id == "cmpl-1" and table.counts["expired"] == 1
    assert "expired" in table.answer(SECRET, ask(), time.time(), 12.0)["error"]


def release(secret: bytes = SECRET, ext_id: str = EXT, tokens: int = 100) -> bytes:
    return json.dumps(release_fields(secret, ext_id, tokens, time.time())).encode()


def test_a_release_frees_a_held_request_at_once_and_only_an_unsent_one() -> None:
    table = HoldTable()
    table.hold(held())
    table.hold(held(ext_id="cd" * 16))
    assert table.answer(SECRET, release(OTHER), time.time(), 0.0)["error"].startswith("ask refused")  # forged
    assert table.answer(SECRET, release(tokens=99), time.time(), 0.0)["error"] == "asked for 99 tokens, 100 held"
    assert table.counts["refused"] == 2 and table.take_freed(0.0) == []  # nothing freed by them
    assert table.answer(SECRET, release(), time.time(), 0.0) == {"id": EXT, "ok": True}
    assert table.wait(0.0)  # an idle worker wakes for it
    ((freed, why),) = table.take_freed(0.0)
    assert (freed.req_id, why, table.counts["released"]) == ("cmpl-1", "handoff_released", 1)
    assert "released" in table.answer(SECRET, release(), time.time(), 0.0)["error"]  # again: refused, counted
    assert "released" in table.answer(SECRET, ask(), time.time(), 0.0)["error"]  # an ask finds nothing to send
    assert table.counts["refused"] == 3
    # being sent: a release (a replay, or a second Decode) never frees the blocks a send reads
    assert table.answer(SECRET, ask(ext_id="cd" * 16), time.time(), 0.0)["ok"] is True
    assert "already sent" in table.answer(SECRET, release(ext_id="cd" * 16), time.time(), 0.0)["error"]
    assert table.counts["refused"] == 4 and table.take_freed(0.0) == [] and len(table.take_claimed()) == 1
    assert table.answer(SECRET, release(ext_id="ef" * 16), time.time(), 0.0)["retry"] == "not held yet"


def test_a_release_of_an_expired_hold_is_refused_and_counted() -> None:
    table = HoldTable()
    table.hold(held(deadline=10.0))
    assert "expired" in table.answer(SECRET, release(), time.time(), 11.0)["error"]
    assert (table.counts["refused"], table.counts["released"]) == (1, 0)


@pytest.fixture
def listener() -> Iterator[HandoffListener]:
    port = free_base_port(1)
    listener = HandoffListener(HoldTable(), SECRET, "127.0.0.1", port)
    try:
        yield listener
    finally:
        listener.close()


@pytest.fixture
def asker() -> Iterator[HandoffAsker]:
    asker = HandoffAsker(timeout=2.0)
    try:
        yield asker
    finally:
        asker.close()


def settle(asker: HandoffAsker, timeout: float = 10.0) -> list:
    assert asker.wait(timeout)
    return asker.results()


def body(ext_id: str = EXT, secret: bytes = SECRET) -> dict:
    return ask_fields(secret, ext_id, "127.0.0.1:5600/1", 0, 100, time.time())


def test_the_asker_gets_ok_from_every_rank_over_real_sockets(asker: HandoffAsker) -> None:
    base = free_base_port(2)
    tables = [HoldTable(), HoldTable()]
    listeners = [HandoffListener(t, SECRET, "127.0.0.1", base + r) for r, t in enumerate(tables)]
    try:
        for table in tables:
            table.hold(held())
        asker.submit(EXT, [f"tcp://127.0.0.1:{base}", f"tcp://127.0.0.1:{base + 1}"], body())
        assert settle(asker) == [(EXT, None)]
        assert all(len(t.take_claimed()) == 1 for t in tables)
    finally:
        for listener in listeners:
            listener.close()


def test_an_ask_before_the_hold_is_asked_again_until_it_is_held(listener: HandoffListener, asker: HandoffAsker) -> None:
    asker.submit(EXT, [listener.address], body())
    assert not asker.wait(0.2)  # "not held yet": asked again, no result
    listener.table.hold(held())  # the Prefill step that holds it ran
    assert settle(asker) == [(EXT, None)]


def test_a_refusal_reaches_decode_with_its_reason(listener: HandoffListener, asker: HandoffAsker) -> None:
    listener.table.hold(held())
    asker.submit(EXT, [listener.address], body())
    assert settle(asker) == [(EXT, None)]
    asker.submit(EXT, [listener.address], body())  # a second Decode (or a replay) asking for it
    ((ext_id, error),) = settle(asker)
    assert ext_id == EXT and "already sent" in error


def test_a_prefill_that_is_gone_fails_the_ask_at_its_deadline_and_delays_no_other(
    listener: HandoffListener, asker: HandoffAsker
) -> None:
    with socket.socket() as black_hole:  # bound, never accepting: a Prefill that is gone
        black_hole.bind(("127.0.0.1", 0))
        dead = f"tcp://127.0.0.1:{black_hole.getsockname()[1]}"
        listener.table.hold(held(ext_id="cd" * 16))
        started = time.monotonic()
        asker.submit(EXT, [dead], body())
        asker.submit("cd" * 16, [listener.address], body("cd" * 16))
        assert settle(asker) == [("cd" * 16, None)]  # answered while the other waits out its deadline
        assert time.monotonic() - started < 2.0
        ((ext_id, error),) = settle(asker)
    assert ext_id == EXT and "no answer" in error


def test_a_port_in_use_is_refused_at_startup(listener: HandoffListener) -> None:
    from rd2h.errors import ConfigError

    port = int(listener.address.rsplit(":", 1)[1])
    with pytest.raises(ConfigError, match="handoff_port"):
        HandoffListener(HoldTable(), SECRET, "127.0.0.1", port)


def test_garbage_on_the_listener_is_answered_and_the_loop_goes_on(listener: HandoffListener,
                                                                   asker: HandoffAsker) -> None:
    import zmq

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(listener.address)
    try:
        for junk in (b"\x00\xff", b"{}", json.dumps({"leg": "ask", "sig": "x" * 64}).encode(),
                     b"[" * 5000):  # nested past Python's recursion limit: refused, the thread lives
            sock.send(junk)
            assert sock.poll(5000)
            assert "ask refused" in json.loads(sock.recv())["error"]
        sock.send_multipart([b"two", b"frames"])  # not an ask: ignored, logged
    finally:
        sock.close()
    listener.table.hold(held())
    asker.submit(EXT, [listener.address], body())
    assert settle(asker) == [(EXT, None)]
    assert prompt_digest(TOKENS) != prompt_digest(TOKENS[:-1])


def test_an_answer_nested_too_deeply_is_ignored_and_the_asker_goes_on(asker: HandoffAsker) -> None:
    """A Prefill (or anything at its address) answering ``[[[[...``: the asker's one thread must
    not die of it (every later hand-off would wait out its deadline); the valid answer after it counts."""
    import zmq

    ctx = zmq.Context.instance()
    prefill = ctx.socket(zmq.ROUTER)
    prefill.linger = 0
    try:
        port = prefill.bind_to_random_port("tcp://127.0.0.1")
        asker.submit(EXT, [f"tcp://127.0.0.1:{port}"], body())
        assert prefill.poll(10_000), "the ask never came"
        peer, _ = prefill.recv_multipart()
        prefill.send_multipart([peer, b"[" * 5_000])  # past the recursion limit, within MAXMSGSIZE
        prefill.send_multipart([peer, json.dumps({"id": EXT, "ok": True}).encode()])
        assert settle(asker) == [(EXT, None)]
    finally:
        prefill.close()
