"""A slow (not dead) Decode is abandoned, then revived by a new request: the old request,
which lost a layer, must not end DONE on Decode."""

from __future__ import annotations

import time

from layers import layer_tensors

from rd2h import plugins
from rd2h.api import KVSource, layer_layout
from rd2h.errors import LayerFailedError
from rd2h.sink import LayerStat, Sink
from rd2h.source import DecodeEndpoint
from rd2h.tracking import TerminalState

BLOCK = 16


def test_revived_endpoint_does_not_complete_a_request_with_a_missing_layer(kv_port: int) -> None:
    names = [f"l{i}" for i in range(4)]
    src = {n: layer_tensors(True, i) for i, n in enumerate(names)}
    dst = {n: layer_tensors(False) for n in names}
    stalled = []

    def on_layer(stat: LayerStat) -> None:  # Decode stalls once (GC pause, slow read, ...)
        if stat.layer_idx == 0 and not stalled:
            stalled.append(1)
            time.sleep(1.5)

    engine = plugins.load_engine("local", "decode")
    listener = plugins.load_channel("zmq").listen(f"tcp://127.0.0.1:{kv_port}")
    sink = Sink(rank=0, tp_size=1, engine=engine, listener=listener,
                layers={n: layer_layout(t) for n, t in dst.items()}, on_layer=on_layer)
    endpoint = DecodeEndpoint("127.0.0.1", kv_port, 1)
    sink.expect("r", [5, 6])
    sink.expect("r2", [7])
    with sink.start(), KVSource(src, block_size=BLOCK, reply_timeout=0.3) as source:
        source.add_request("r", endpoint, main_block_ids=[1, 2], num_tokens=2 * BLOCK)
        source.schedule({"r": 2 * BLOCK})
        for name in ("l0", "l1"):
            source.wait_for_layer_send(name)
            source.layer_ready(name)
        time.sleep(0.8)  # l1 unanswered for > reply_timeout: the endpoint is abandoned
        source.wait_for_layer_send("l2")
        source.layer_ready("l2")  # skipped: endpoint dead
        time.sleep(0.2)
        source.add_request("r2", endpoint, main_block_ids=[3], num_tokens=BLOCK)  # revives it
        source.wait_for_layer_send("l3")
        source.layer_ready("l3")  # sent, with done_ext_ids=("r",)
        try:
            source.wait_for_layer_send("l1", timeout=5)
        except LayerFailedError:
            pass
        prefill = source.wait_finished(["r"], 10)["r"]
        state = sink.wait(["r"], 10)["r"]
    assert not dst["l2"].main[0][[5, 6]].any()  # l2 never reached Decode
    assert prefill.error is not None  # Prefill knows r failed
    assert state is not TerminalState.DONE, "Decode reports r DONE although layer l2 was never read"
