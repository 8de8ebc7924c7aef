"""The hand-off's sockets (:mod:`rd2h.vllm.handoff`): Prefill's listener and Decode's asker.

Both are one thread each over ZMQ (already rd2h's control channel library): a ROUTER on
every Prefill rank, bound to ``host:handoff_port + rank`` (plus the DP offset), and on the
Decode scheduler one DEALER per Prefill address it asks. Neither thread ever blocks on a
peer: ZMQ connects, reconnects and queues; a deadline per ask turns a Prefill that is gone
(or a black hole) into that request's failure after ``timeout`` seconds, and no other ask
waits behind it. Nothing a peer sends raises out of a loop: a bad message gets an error
answer (the listener) or is ignored and logged (the asker). Another thread wakes a loop
through a socket pair, so neither polls on a timer.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from rd2h.vllm.handoff import MAX_ASK_BYTES, HoldTable

__all__ = ["HandoffAsker", "HandoffListener"]

log = logging.getLogger("rd2h.vllm.handoff")

RETRY_PAUSE = 0.05  # seconds between asks a Prefill answered "not held yet" (its next step holds it)
MAX_PEERS = 64  # Prefill addresses with a socket open; idle ones beyond it are closed


def _wake_pair() -> tuple[socket.socket, socket.socket]:
    reader, writer = socket.socketpair()
    reader.setblocking(False)
    writer.setblocking(False)
    return reader, writer


def _wake(writer: socket.socket) -> None:
    try:
        writer.send(b"w")
    except (BlockingIOError, OSError):  # full: a wake-up is pending anyway; closed: stopping
        pass


def _drain(reader: socket.socket) -> None:
    try:
        while reader.recv(4096):
            pass
    except (BlockingIOError, OSError):
        pass


class HandoffListener:
    """One Prefill rank's listener: answers asks from ``table`` (the worker serves what it
    claims). ``bind`` is ``(host, port)``; a port in use raises ConfigError at once."""

    def __init__(self, table: HoldTable, secret: bytes, host: str, port: int, *,
                 clock: Callable[[], float] = time.time, mono: Callable[[], float] = time.monotonic) -> None:
        from rd2h.errors import ConfigError

        self.table, self._secret, self._clock, self._mono = table, secret, clock, mono
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_ASK_BYTES + 1024)  # libzmq drops a peer sending more
        self._sock.setsockopt(zmq.SNDHWM, 10_000)
        address = f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
        if ":" in host:
            self._sock.setsockopt(zmq.IPV6, 1)
        try:
            self._sock.bind(address)
        except zmq.ZMQError as exc:
            self._sock.close()
            raise ConfigError(f"the hand-off listener cannot bind {address}: {exc} (handoff_port)") from None
        self.address = address
        self.dropped = 0  # answers a peer did not take (its queue full): it times out
        self._reader, self._writer = _wake_pair()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=f"rd2h-handoff-{port}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._reader, zmq.POLLIN)
        try:
            while not self._stop:
                poller.poll()
                _drain(self._reader)  # a wake-up only says: look at _stop
                while not self._stop and self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    self._answer(self._sock.recv_multipart(zmq.NOBLOCK, copy=True))
        except Exception:  # noqa: BLE001 - the listener ends; asks then time out on Decode (logged there)
            log.exception("hand-off listener %s stopped", self.address)
        finally:
            self._sock.close()

    def _answer(self, frames: list[bytes]) -> None:
        if len(frames) != 2:  # a DEALER sends one frame; anything else is not an ask
            log.warning("hand-off listener %s: a message of %d frames ignored", self.address, len(frames))
            return
        reply = self.table.answer(self._secret, frames[1], self._clock(), self._mono())
        if "error" in reply:
            log.warning("hand-off listener %s: ask for %s refused: %s", self.address, reply["id"], reply["error"])
        try:
            self._sock.send_multipart([frames[0], json.dumps(reply).encode()], zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1

    def close(self, timeout: float = 5.0) -> None:
        self._stop = True
        _wake(self._writer)
        self._thread.join(timeout)
        self._reader.close()
        self._writer.close()


@dataclass
class _Pending:
    ext_id: str
    url: str
    body: bytes
    deadline: float
    retry_at: float | None = None  # set while it waits to be asked again


class HandoffAsker:
    """Decode's asks, all on one thread. ``submit`` an ask for every Prefill rank's URL;
    :meth:`results` gives each ext id once, with None (every rank will announce it) or why it
    cannot be transferred (a refusal, or no answer within ``timeout`` seconds)."""

    def __init__(self, *, timeout: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._timeout, self._clock = timeout, clock
        self._lock = threading.Lock()
        self._settled = threading.Condition(self._lock)
        self._inbox: deque[tuple[str, list[str], bytes]] = deque()
        self._cancelled: set[str] = set()
        self._results: list[tuple[str, str | None]] = []
        self._ctx = zmq.Context.instance()
        self._reader, self._writer = _wake_pair()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="rd2h-handoff-asker", daemon=True)
        self._thread.start()

    def submit(self, ext_id: str, urls: list[str], body: dict[str, Any]) -> None:
        with self._lock:
            self._inbox.append((ext_id, list(urls), json.dumps(body).encode()))
        _wake(self._writer)

    def cancel(self, ext_id: str) -> None:
        """Its request is gone: no result will be reported for it."""
        with self._lock:
            self._cancelled.add(ext_id)
        _wake(self._writer)

    def wait(self, timeout: float) -> bool:
        """Block until a result is there to take (``timeout`` seconds at most); whether one is."""
        with self._settled:
            return self._settled.wait_for(lambda: bool(self._results), timeout)

    def results(self) -> list[tuple[str, str | None]]:
        with self._lock:
            results, self._results = self._results, []
            return results

    def close(self, timeout: float = 5.0) -> None:
        self._stop = True
        _wake(self._writer)
        self._thread.join(timeout)
        self._reader.close()
        self._writer.close()

    # -- the thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        self._socks: dict[str, zmq.Socket] = {}
        self._pending: dict[tuple[str, str], _Pending] = {}
        self._waiting: dict[str, int] = {}  # ext id -> ranks not yet answered "ok"
        poller = zmq.Poller()
        poller.register(self._reader, zmq.POLLIN)
        self._poller = poller
        try:
            while not self._stop:
                self._take_inbox()
                self._tick()
                wake = min((p.retry_at or p.deadline for p in self._pending.values()), default=None)
                timeout = None if wake is None else max(0, int(1000 * (wake - self._clock())) + 1)
                for sock, _ in poller.poll(timeout):
                    if isinstance(sock, int) or sock is self._reader:  # pyzmq gives a raw socket's fd
                        _drain(self._reader)
                    else:
                        self._read(sock)
        except Exception:  # noqa: BLE001 - asks in flight then fail on Decode's request deadline
            log.exception("hand-off asker stopped")
        finally:
            for sock in self._socks.values():
                sock.close()

    def _take_inbox(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, deque()
            cancelled, self._cancelled = self._cancelled, set()
        for ext_id in cancelled:
            self._waiting.pop(ext_id, None)
            for key in [k for k in self._pending if k[0] == ext_id]:
                del self._pending[key]
        now = self._clock()
        for ext_id, urls, body in inbox:
            if ext_id in cancelled:
                continue
            self._waiting[ext_id] = len(urls)
            for url in urls:
                self._pending[(ext_id, url)] = _Pending(ext_id, url, body, now + self._timeout)
                self._send(self._pending[(ext_id, url)])

    def _tick(self) -> None:
        now = self._clock()
        for pending in list(self._pending.values()):
            if now >= pending.deadline:
                self._fail(pending.ext_id, f"no answer from Prefill at {pending.url} within {self._timeout:g} s")
            elif pending.retry_at is not None and now >= pending.retry_at:
                pending.retry_at = None
                self._send(pending)

    def _socket(self, url: str) -> zmq.Socket:
        sock = self._socks.get(url)
        if sock is None:
            if len(self._socks) >= MAX_PEERS:
                busy = {p.url for p in self._pending.values()}
                for idle in [u for u in self._socks if u not in busy]:
                    self._poller.unregister(self._socks[idle])
                    self._socks.pop(idle).close()
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_ASK_BYTES)
            sock.setsockopt(zmq.IPV6, 1)
            sock.connect(url)
            self._poller.register(sock, zmq.POLLIN)
            self._socks[url] = sock
        return sock

    def _send(self, pending: _Pending) -> None:
        try:
            self._socket(pending.url).send(pending.body, zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # queue full or a bad address: this ask fails now
            self._fail(pending.ext_id, f"cannot ask Prefill at {pending.url}: {exc}")

    def _read(self, sock: zmq.Socket) -> None:
        url = next((u for u, s in self._socks.items() if s is sock), None)
        while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            raw = sock.recv(zmq.NOBLOCK)
            try:
                reply = json.loads(raw)
                pending = self._pending.get((reply.get("id"), url))
            except (ValueError, AttributeError, TypeError, RecursionError):  # RecursionError: "[[[[..."
                log.warning("hand-off: a malformed answer from %s ignored", url)
                continue
            if pending is None:
                if isinstance(reply, dict) and reply.get("error"):  # no id: our ask itself was refused
                    log.warning("hand-off: Prefill at %s refused an ask: %s", url, reply["error"])
                continue  # a late answer to an ask that already ended
            if reply.get("ok") is True:
                del self._pending[(pending.ext_id, url)]
                self._waiting[pending.ext_id] -= 1
                if not self._waiting[pending.ext_id]:
                    del self._waiting[pending.ext_id]
                    self._settle(pending.ext_id, None)
            elif "retry" in reply:
                pending.retry_at = min(self._clock() + RETRY_PAUSE, pending.deadline)
            else:
                self._fail(pending.ext_id, f"Prefill at {url} refused it: {reply.get('error')}")

    def _fail(self, ext_id: str, why: str) -> None:
        for key in [k for k in self._pending if k[0] == ext_id]:
            del self._pending[key]
        if self._waiting.pop(ext_id, None) is not None:
            self._settle(ext_id, why)

    def _settle(self, ext_id: str, error: str | None) -> None:
        with self._lock:
            self._results.append((ext_id, error))
            self._settled.notify_all()
