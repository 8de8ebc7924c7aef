"""A Source on the in-memory control channel, and a hand-written Decode to talk to it.

``DecodeEndpoint`` gives ``tcp://host:port`` addresses; the memory channel names listeners
``memory://name``. ``MemoryNamed`` maps one onto the other, so a real Source and a real or
scripted Decode meet in memory: every frame still goes through the real codec, nothing
waits on a socket or a sleep.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

from rd2h import plugins
from rd2h.clock import Clock
from rd2h.interfaces import Dialer, Listener
from rd2h.prefill.source import Source
from rd2h.tensors import LayerTensors, layer_layout
from rd2h.wire import protocol
from rd2h.wire.endpoint import DecodeEndpoint

BLOCK = 16
_TCP, _MEMORY = "tcp://", "memory://"


class MemoryNamed(Dialer):
    """A memory-channel dialer addressed by the ``tcp://`` names a DecodeEndpoint gives."""

    def __init__(self, inner: Dialer | None = None) -> None:
        self._inner = plugins.load_channel("memory").dialer() if inner is None else inner
        self.sent: list[bytes] = []  # every frame sent, in order
        self._changed = threading.Condition()

    def send(self, address: str, payload: bytes) -> None:
        self._inner.send(_MEMORY + address.removeprefix(_TCP), payload)
        with self._changed:
            self.sent.append(payload)
            self._changed.notify_all()

    def wait_sent(self, until: Callable[[list[bytes]], bool], timeout: float = 10.0) -> bool:
        """Block until ``until(sent frames)`` holds (the sender thread sends asynchronously)."""
        with self._changed:
            return self._changed.wait_for(lambda: until(self.sent), timeout)

    def recv(self, timeout: float) -> tuple[str, bytes] | None:
        item = self._inner.recv(timeout)
        return None if item is None else (_TCP + item[0].removeprefix(_MEMORY), item[1])

    def wakeup(self) -> None:
        self._inner.wakeup()

    def disconnect(self, address: str) -> None:
        self._inner.disconnect(_MEMORY + address.removeprefix(_TCP))

    def close(self) -> None:
        self._inner.close()


def memory_listener(port: int) -> Listener:
    """The Decode listener a ``DecodeEndpoint("127.0.0.1", port, 1)`` reaches."""
    return plugins.load_channel("memory").listen(f"{_MEMORY}127.0.0.1:{port}")


def memory_source(
    layers: Mapping[str, LayerTensors], clock: Clock, dialer: MemoryNamed | None = None, **options: Any
) -> Source:
    """A started Source on the local engine and the memory channel."""
    options.setdefault("block_size", BLOCK)
    return Source(
        rank=0, tp_size=1, engine=plugins.load_engine("local", "prefill"),
        dialer=MemoryNamed() if dialer is None else dialer,
        layers={name: layer_layout(t) for name, t in layers.items()}, clock=clock, **options,
    ).start()


class ScriptedDecode:
    """A hand-written Decode rank: the test reads each frame and chooses the reply."""

    def __init__(self, port: int) -> None:
        self.listener = memory_listener(port)
        self.endpoint = DecodeEndpoint("127.0.0.1", port, 1)

    def next(self, timeout: float = 10.0) -> tuple[bytes, protocol.Message]:
        item = self.listener.recv(timeout)
        assert item is not None, "Prefill sent nothing"
        return item[0], protocol.decode_request(item[1])

    def readiness(self, timeout: float = 10.0) -> tuple[bytes, protocol.ReadReadyBatch]:
        """The next readiness; an mf_meta before it is acknowledged, as Decode does."""
        while True:
            peer, message = self.next(timeout)
            if isinstance(message, protocol.ReadReadyBatch):
                return peer, message
            self.listener.send(peer, protocol.ACK_FRAME)

    def reply(self, peer: bytes, message: protocol.Reply) -> None:
        self.listener.send(peer, protocol.encode(message))

    def close(self) -> None:
        self.listener.close()

    def __enter__(self) -> ScriptedDecode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
