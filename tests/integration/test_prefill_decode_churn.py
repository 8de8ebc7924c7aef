"""Issue 19, item 7: Prefill's memory per Decode is bounded. Decodes come and go (a proxy routes
to whichever is up); Prefill used to keep a socket and a record for every address it ever
dialled. Real Decodes (Sinks) and a real Prefill over zmq on loopback; Prefill's clock is moved,
never slept on."""

from __future__ import annotations

import os

from layers import layer_tensors
from rd2h_zmq import ZmqChannel

from rd2h import plugins
from rd2h.api import KVSink
from rd2h.clock import ManualClock
from rd2h.prefill.source import Source
from rd2h.tensors import layer_layout
from rd2h.testing.channel_suite import until

BLOCK = 16
DECODES = 8
KEPT = 2  # max_endpoints
REPLY_TIMEOUT = 5.0
IDLE = 60.0


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))



def _serve(source: Source, kv_port: int, ext_id: str) -> object:
    """One request through a Decode on ``kv_port`` that stops once it is served; the block it got."""
    dst = {"l0": layer_tensors(False)}
    with KVSink(dst, kv_port=kv_port) as sink:
        sink.expect(ext_id, main_blocks=[5])
        source.add_request(ext_id, sink.endpoint, main_block_ids=[1], num_tokens=BLOCK)
        source.schedule({ext_id: BLOCK})
        source.wait_for_layer_send("l0", timeout=10)
        source.layer_ready("l0")
        assert source.wait_finished([ext_id], 10)[ext_id].ok
        assert sink.wait([ext_id], 10)[ext_id].ok
    return dst["l0"].main[0][5]


def test_prefill_forgets_decodes_gone_quiet_and_dials_one_that_comes_back(kv_port: int) -> None:
    clock = ManualClock()
    src = layer_tensors(True)  # kept alive: the layout holds only its addresses
    source = Source(
        rank=0, tp_size=1, engine=plugins.load_engine("local", "prefill"), dialer=ZmqChannel().dialer(),
        layers={"l0": layer_layout(src)}, block_size=BLOCK, clock=clock,
        reply_timeout=REPLY_TIMEOUT, endpoint_idle_seconds=IDLE, max_endpoints=KEPT,
    ).start()
    try:
        # the first dial starts the dialer's zmq I/O and reaper threads (their fds stay): warm up
        assert (_serve(source, kv_port, "first") == src.main[0][1]).all()
        clock.advance(IDLE)
        assert until(lambda: source.endpoints == 0), source.endpoints
        baseline = _fds()
        for i in range(DECODES):
            assert (_serve(source, kv_port + i, f"r{i}") == src.main[0][1]).all()
        # every Decode is gone; within the reply timeout nothing is forgotten (its notices may still leave)
        assert source.endpoints == DECODES
        held = _fds() - baseline
        assert held >= DECODES, f"{held} fds for {DECODES} dialled Decodes"  # the control: a socket each
        clock.advance(REPLY_TIMEOUT)  # over the cap: least recently used first, down to it
        assert until(lambda: source.endpoints == KEPT), source.endpoints
        # a kept socket: its mailbox, and a TCP fd while it tries to reconnect to its stopped Decode
        assert until(lambda: _fds() - baseline <= 2 * KEPT), (held, _fds() - baseline)
        clock.advance(IDLE)  # past the idle time: none is kept
        assert until(lambda: source.endpoints == 0), source.endpoints
        assert until(lambda: _fds() <= baseline), (baseline, _fds())
        # the first Decode comes back on its address: dialled again, introduced again, read
        assert (_serve(source, kv_port, "back") == src.main[0][1]).all()
        assert source.endpoints == 1
    finally:
        source.close()
