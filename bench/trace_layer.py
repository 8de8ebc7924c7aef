"""Where a tiny layer's latency goes: timestamps along its path, Prefill and Decode in two processes.

    python bench/trace_layer.py [--layers 400] [--channel zmq|tcp] [--json out.json]

A Prefill process (``KVSource``) announces one-block layers through one slot, so one layer is
in flight at a time, and a Decode process (``KVSink``) pulls them over zmq with the local
engine, as ``rd2h demo --layers N --requests 1 --max-tokens 1 --block-size 1 --slots 1``. Both
wrap a few runtime methods to record ``time.perf_counter_ns`` (CLOCK_MONOTONIC: one clock for
both processes) on entry and exit. Per layer the events are put in time order and the gaps
between consecutive events are attributed to the step that ends there; the medians over
layers show which hops cost what (thread hand-offs, zmq transit, Decode's own work). The
wrapped names are the runtimes' private methods: this is a measuring tool and follows them.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

_EVENTS: list[tuple[str, int]] = []


def _wrap(cls: Any, name: str, tag: str) -> None:
    original: Callable[..., Any] = getattr(cls, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        _EVENTS.append((f"{tag} >", time.perf_counter_ns()))
        try:
            return original(*args, **kwargs)
        finally:
            _EVENTS.append((f"{tag} <", time.perf_counter_ns()))

    setattr(cls, name, wrapped)


def _prefill(port: int, layers: int, out: Any, go: Any, channel: str = "zmq") -> None:
    import importlib

    import numpy as np

    from rd2h.api import KVSource, LayerTensors, host_buffer
    from rd2h.prefill import gate, source

    module, cls = {"zmq": ("rd2h_zmq.sockets", "ZmqDialer"), "tcp": ("rd2h_tcp.dialer", "TcpDialer")}[channel]
    _wrap(source.Source, "layer_ready", "P main: layer_ready")
    _wrap(source.Source, "_announce", "P source: announce")
    _wrap(getattr(importlib.import_module(module), cls), "send", f"P source: {channel} send")
    _wrap(gate.SlotGate, "replied", "P source: gate released")
    _wrap(source.Source, "wait_for_layer_send", "P main: wait for slot")
    slot = [host_buffer((4, 64)), host_buffer((4, 16))]
    names = [f"layer.{i}" for i in range(layers)]
    tensors = {n: LayerTensors(main=[slot[0]], indexer=slot[1]) for n in names}
    with KVSource(tensors, block_size=1, channel=channel) as src:
        src.add_request("r", source.DecodeEndpoint("127.0.0.1", port, 1), main_block_ids=[0], num_tokens=1)
        go.wait()
        src.schedule({"r": 1})
        for name in names:
            src.wait_for_layer_send(name)
            slot[0][0] = np.uint8(len(_EVENTS) % 251)  # the "compute" of a one-block layer
            src.layer_ready(name)
        src.wait_finished(["r"], 60)
    out.put(("prefill", _EVENTS))


def _decode(port: int, layers: int, out: Any, ready: Any, channel: str = "zmq") -> None:
    from rd2h.api import KVSink, LayerTensors, host_buffer
    from rd2h.decode import layer_read, sink

    _wrap(sink.Sink, "_handle", "D sink: handle")
    _wrap(layer_read.LayerReader, "_plan", "D sink: plan")
    _wrap(layer_read.LayerReader, "_lane_read", "D sink: lane")  # a step's layers after its first clean read
    _wrap(layer_read.LayerReader, "_read", "D sink: read")
    _wrap(layer_read.LayerReader, "send", "D sink: reply send")
    names = [f"layer.{i}" for i in range(layers)]
    tensors = {n: LayerTensors(main=[host_buffer((4, 64))], indexer=host_buffer((4, 16))) for n in names}
    with KVSink(tensors, kv_port=port, channel=channel) as s:
        s.expect("r", main_blocks=[1])
        ready.set()
        s.wait(["r"], 60)
    out.put(("decode", _EVENTS))


def trace(layers: int, port: int = 7900, channel: str = "zmq") -> dict[str, float]:
    """Median microseconds per step of a layer's path (the gap before each event), ordered
    by when the event comes in a cycle (one ``layer_ready`` to the next)."""
    ctx = mp.get_context("spawn")
    out, ready = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_decode, args=(port, layers, out, ready, channel)),
             ctx.Process(target=_prefill, args=(port, layers, out, ready, channel))]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    events = sorted(got["prefill"] + got["decode"], key=lambda e: e[1])
    starts = [t for tag, t in events if tag == "P main: layer_ready >"]
    gaps: dict[str, list[float]] = {}
    offsets: dict[str, list[float]] = {}
    for lo, hi in zip(starts[layers // 10:], starts[layers // 10 + 1:]):  # warm layers, whole cycles
        cycle = [e for e in events if lo <= e[1] < hi]
        for (_, t0), (tag, t1) in itertools.pairwise(cycle):
            gaps.setdefault(tag, []).append((t1 - t0) / 1e3)
            offsets.setdefault(tag, []).append((t1 - lo) / 1e3)
        gaps.setdefault("whole cycle", []).append((hi - lo) / 1e3)
        offsets.setdefault("whole cycle", []).append((hi - lo) / 1e3)
    at = {tag: statistics.median(v) for tag, v in offsets.items()}
    return {tag: statistics.median(gaps[tag]) for tag in sorted(gaps, key=at.__getitem__)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=400)
    parser.add_argument("--port", type=int, default=7900)
    parser.add_argument("--channel", default="zmq", help="control channel: zmq or tcp")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import pingpong

    before = pingpong.measure(1000)["p50_us"]
    steps = trace(args.layers, args.port, args.channel)
    after = pingpong.measure(1000)["p50_us"]
    bare = statistics.median([before, after])
    print(f"median us per step of a one-block layer ({args.layers} layers; a step ends at the event named)")
    for tag, us in steps.items():
        print(f"  {us:>8.1f}  {tag}")
    print(f"  bare zmq ping-pong p50 before/after: {before:.0f} / {after:.0f} us; "
          f"cycle / ping-pong: {steps['whole cycle'] / bare:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"steps_us": steps, "pingpong_p50_us": [before, after]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
