"""Sink: abort waits out an in-flight read; a failed constructor frees its port."""

from __future__ import annotations

import threading

import pytest
from layers import layer_tensors

from rd2h import plugins
from rd2h.api import KVSink, KVSource, layer_layout
from rd2h.decode.sink import Sink
from rd2h.outcome import TerminalState
from rd2h.prefill.source import DecodeEndpoint

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
    """A read into a request's blocks is in flight when vLLM aborts it: abort() (and a
    take() on another thread) must wait for the read, since vLLM reuses the blocks
    as soon as the abort is reported; and Prefill still gets its reply."""
    src, dst = {"l": layer_tensors(True)}, {"l": layer_tensors(False)}
    engine = _PausingEngine(plugins.load_engine("local", "decode"))
    listener = plugins.load_channel("zmq").listen(f"tcp://127.0.0.1:{kv_port}")
    sink = Sink(rank=0, tp_size=1, engine=engine, listener=listener, layers={"l": layer_layout(dst["l"])})
    sink.expect("r", [5])
    with sink.start(), KVSource(src, block_size=BLOCK) as source:
        source.add_request("r", DecodeEndpoint("127.0.0.1", kv_port, 1), main_block_ids=[1], num_tokens=BLOCK)
        source.send_all({"r": BLOCK})
        assert engine.entered.wait(10)
        aborter = threading.Thread(target=sink.abort, args=("r",))
        aborter.start()
        reported: list[dict[str, TerminalState]] = []
        taker = threading.Thread(target=lambda: reported.append(sink.wait(["r"], 10)))
        taker.start()
        # the abort is recorded at once; returning must wait until the read ends
        with sink._changed:
            assert sink._changed.wait_for(lambda: sink._tracker.state("r").value == "aborted", 10)
        assert aborter.is_alive() and taker.is_alive() and reported == []
        engine.go.set()
        aborter.join(10)
        taker.join(10)
        assert [{e: o.state for e, o in r.items()} for r in reported] == [{"r": TerminalState.ABORTED}]
        assert dst["l"].main[0][5].any()  # the read finished before the abort was reported
        result = source.wait_finished(["r"], 10)["r"]  # Prefill got its reply: no timeout
        assert result.ok


def test_failed_sink_constructor_frees_the_port(kv_port: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sink.__init__ fails after KVSink bound the listener: the port must be free again."""
    import rd2h.decode.sink

    def broken(**_: object) -> None:
        raise RuntimeError("constructor failed after the bind")

    layers = {"l": layer_tensors(False)}
    with monkeypatch.context() as patch:
        patch.setattr(rd2h.decode.sink, "LayerReader", broken)
        with pytest.raises(RuntimeError, match="after the bind") as info:
            KVSink(layers, kv_port=kv_port)
        kept = info.value  # the caller may keep the exception (and its traceback) alive  # noqa: F841
    KVSink(layers, kv_port=kv_port).close()  # PortInUseError if the first listener leaked
