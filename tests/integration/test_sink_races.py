"""Sink: abort waits out an in-flight read; a failed constructor frees its port."""

from __future__ import annotations

import threading

import pytest
from layers import layer_tensors

from rd2h import plugins
from rd2h.api import KVSink, KVSource, layer_layout
from rd2h.sink import Sink
from rd2h.tracking import TerminalState

BLOCK = 16


class _PausingEngine:
    """Delegates to a real engine; read_batch waits for ``go`` first (a slow batched read)."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self.entered, self.go = threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def read_batch(self, session, local, remote, lengths) -> None:
        self.entered.set()
        self.go.wait(10)
        self._inner.read_batch(session, local, remote, lengths)


def test_abort_returns_only_after_the_read_into_its_blocks_ended(kv_port: int) -> None:
    """abort() -> take_terminal() reports ABORTED (vLLM frees and reuses the blocks) while the
    loop thread is inside read_batch for that request; the read then writes into blocks that
    no longer belong to it."""
    src, dst = {"l": layer_tensors(True)}, {"l": layer_tensors(False)}
    engine = _PausingEngine(plugins.load_engine("local", "decode"))
    listener = plugins.load_channel("zmq").listen(f"tcp://127.0.0.1:{kv_port}")
    sink = Sink(rank=0, tp_size=1, engine=engine, listener=listener, layers={"l": layer_layout(dst["l"])})
    sink.expect("r", [5])
    with sink.start(), KVSource(src, block_size=BLOCK) as source:
        from rd2h.source import DecodeEndpoint

        source.add_request("r", DecodeEndpoint("127.0.0.1", kv_port, 1), main_block_ids=[1], num_tokens=BLOCK)
        source.send_all({"r": BLOCK})
        assert engine.entered.wait(10)
        sink.abort("r")
        assert sink.take_terminal() == {"r": TerminalState.ABORTED}
        # vLLM now frees block 5 and hands it to another request, which zeroes it:
        dst["l"].main[0][5] = 0
        engine.go.set()
        source.wait_finished(["r"], 10)
    assert not dst["l"].main[0][5].any(), "an aborted (and reported) request's block was written after the report"


def test_failed_sink_constructor_frees_the_port(kv_port: int) -> None:
    """KVSink binds the listener, then Sink.__init__ raises (here rank=-1 passes ports[rank]);
    neither the listener nor the engine is closed, so the port stays taken in this process."""
    layers = {"l": layer_tensors(False)}
    with pytest.raises(Exception) as info:
        KVSink(layers, rank=-1, tp_size=2, kv_port=kv_port)
    # the caller still holds the exception (a log record, a retry loop's last error...)
    kept = info.value  # noqa: F841
    # rank 1 is the port rank -1 bound
    sink = KVSink(layers, rank=1, tp_size=2, kv_port=kv_port)
    sink.close()
