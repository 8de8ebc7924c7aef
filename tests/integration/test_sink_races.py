"""Sink: abort returns at once and settles once an in-flight read ended; a failed constructor frees its port."""

from __future__ import annotations

import threading

import pytest
from layers import layer_tensors

from rd2h import plugins
from rd2h.api import KVSink, KVSource, layer_layout
from rd2h.decode.sink import Sink
from rd2h.errors import DestinationError, RD2HError
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


@pytest.mark.parametrize("how", ["abort", "fail"])
def test_abort_returns_at_once_and_settles_when_the_read_into_its_blocks_ends(kv_port: int, how: str) -> None:
    """Issue 19, item 2: a read into a request's blocks is in flight when the caller aborts
    (or fails) it. The call returns at once (the vLLM worker makes it on the forward path;
    it used to wait for the read); the request is reported only once the read ended, its
    blocks stay held until then, and the reply to that read tells Prefill the request
    failed, so Prefill cannot report DONE what Decode ended (it used to say DONE: this
    readiness was the request's final layer)."""
    src, dst = {"l": layer_tensors(True)}, {"l": layer_tensors(False)}
    engine = _PausingEngine(plugins.load_engine("local", "decode"))
    listener = plugins.load_channel("zmq").listen(f"tcp://127.0.0.1:{kv_port}")
    sink = Sink(rank=0, tp_size=1, engine=engine, listener=listener, layers={"l": layer_layout(dst["l"])})
    sink.expect("r", [5])
    with sink.start(), KVSource(src, block_size=BLOCK) as source:
        source.add_request("r", DecodeEndpoint("127.0.0.1", kv_port, 1), main_block_ids=[1], num_tokens=BLOCK)
        source.send_all({"r": BLOCK})
        assert engine.entered.wait(10)
        ended = sink.abort("r") if how == "abort" else sink.fail("r", RD2HError("the caller gave up"))
        assert ended is True and not engine.go.is_set()  # returned while the read is still paused
        assert sink.take() == {}  # not reported while a read may write its blocks
        with pytest.raises(DestinationError, match="held by live request 'r'"):
            sink.expect("s", [5])
        engine.go.set()
        outcome = sink.wait(["r"], 10)["r"]
        assert outcome.state is (TerminalState.ABORTED if how == "abort" else TerminalState.FAILED)
        assert dst["l"].main[0][5].any()  # the read did finish before the outcome was settled
        on_prefill = source.wait_finished(["r"], 10)["r"]  # answered, not timed out
        assert on_prefill.state is TerminalState.FAILED, on_prefill
        assert "aborted on Decode" in str(on_prefill.error) if how == "abort" else "gave up" in str(on_prefill.error)
        sink.expect("s", [5])  # released with the outcome


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
