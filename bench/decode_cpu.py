"""Decode's own CPU per layer, beside the read: the sink's handling with a core to itself.

    python bench/decode_cpu.py [--layers 32 --requests 32 --blocks 40] [--rounds 8] \\
        [--baseline DIR] [--json out.json]
    python bench/decode_cpu.py --layers 256 --requests 1 --blocks 1     # the tiny layer

A ``Sink`` (local engine, in-memory channel) is fed real readiness frames through the real
codec by calling its handler on this thread: no loop thread, no Prefill threads, no zmq, so
the figure is Decode's work alone, not the contention of a 2-core machine (``rd2h demo``'s
``layer_overhead_p50_ms`` includes that). The source tensors live in this process and are
read with ``process_vm_readv`` like any peer's. Each round expects ``--requests`` requests of
``--blocks`` random blocks, announces them on every layer (one step) and fails them
afterwards; figures are microseconds per layer: ``handle`` (decode, admission, plan, read,
bookkeeping, reply) and ``overhead`` (``handle`` less the time in ``read_batch``), medians
over rounds. With ``--baseline`` the same measurement runs from that checkout (``git
worktree add --detach DIR COMMIT``) in a child process, round by round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

MAIN_BYTES, INDEXER_BYTES = 64, 16


class _Harness:
    """A sink with one admitted peer (this process), ready for readiness frames."""

    def __init__(self, layers: int, pool_blocks: int) -> None:
        from rd2h import plugins
        from rd2h.api import LayerTensors, host_buffer, layer_layout
        from rd2h.decode.sink import Sink
        from rd2h.wire import protocol
        from rd2h.wire.layer_metadata import encode_layer_metadata
        from rd2h.wire.mf_meta import MfMeta

        self.protocol = protocol
        self.names = [f"layer.{i}" for i in range(layers)]

        def tensors() -> Any:
            return LayerTensors(main=[host_buffer((pool_blocks, MAIN_BYTES))], indexer=host_buffer((pool_blocks, INDEXER_BYTES)))

        src_tensors = {n: tensors() for n in self.names}
        dst_tensors = {n: tensors() for n in self.names}
        self.keep = (src_tensors, dst_tensors)  # the memory the layouts point into
        src = {n: layer_layout(t) for n, t in src_tensors.items()}
        self.engine = plugins.load_engine("local", "prefill")
        metadata = self.engine.register([r for layout in src.values() for r in layout.regions()])
        listener = plugins.load_channel("memory").listen("memory://decode-cpu")
        self.sink = Sink(rank=0, tp_size=1, engine=plugins.load_engine("local", "decode"), listener=listener,
                         layers={n: layer_layout(t) for n, t in dst_tensors.items()})
        self.dialer = plugins.load_channel("memory").dialer()
        self.dialer.send(listener.address, protocol.encode(MfMeta("bench", encode_layer_metadata(src), engine_metadata=metadata)))
        got = listener.recv(10.0)
        assert got is not None
        self.identity = got[0]
        self.sink._handle(*got)  # the handshake, on this thread
        deadline = time.monotonic() + 30
        while self.sink._admissions and time.monotonic() < deadline:
            time.sleep(0.001)  # a baseline checkout may predate Admissions.wait_any
            self.sink._finish_handshakes()
        self.dialer.recv(10.0)  # the ACK

    def round(self, requests: int, blocks: int, pool_blocks: int, rng: np.random.Generator, tag: int) -> tuple[float, float]:
        protocol, sink = self.protocol, self.sink
        src = rng.permutation(pool_blocks)[: requests * blocks].reshape(requests, blocks)
        dst = rng.permutation(pool_blocks)[: requests * blocks].reshape(requests, blocks)
        ids = [f"r{tag}-{i}" for i in range(requests)]
        for i, ext in enumerate(ids):
            sink.expect(ext, dst[i].tolist(), deadline=3600)
        reads = tuple(protocol.ReadRequest(e, src[i].tolist(), src[i].tolist(), 0, 0) for i, e in enumerate(ids))
        frames = [protocol.encode(protocol.ReadReadyBatch(k, n, reads, ())) for k, n in enumerate(self.names)]
        read_before = sink.counters.read_seconds
        started = time.perf_counter()
        for frame in frames:
            sink._handle(self.identity, frame)
        handle = time.perf_counter() - started
        read = sink.counters.read_seconds - read_before
        replies = 0
        while (got := self.dialer.recv(0)) is not None:
            replies += isinstance(protocol.decode_reply(got[1]), protocol.ReadDone)
        if replies != len(frames):
            raise AssertionError(f"{len(frames) - replies} of {len(frames)} layers were not read")
        for ext in ids:
            sink.abort(ext)
        sink.take()
        per_layer = 1e6 / len(frames)
        return handle * per_layer, (handle - read) * per_layer


def measure(layers: int, requests: int, blocks: int, rounds: int) -> dict[str, Any]:
    pool = max(64, 2 * requests * blocks)
    harness = _Harness(layers, pool)
    rng = np.random.default_rng(0)
    harness.round(requests, blocks, pool, rng, -1)  # warm-up: the first layer pays for caches
    rows = [harness.round(requests, blocks, pool, rng, r) for r in range(rounds)]
    return {"layers": layers, "requests": requests, "blocks": blocks, "rounds": rounds,
            "handle_us": statistics.median(h for h, _ in rows), "overhead_us": statistics.median(o for _, o in rows)}


def _child(checkout: str, args: argparse.Namespace) -> dict[str, Any]:
    env = dict(os.environ)
    root = Path(checkout)
    env["PYTHONPATH"] = os.pathsep.join(str(root / p) for p in ("", "backends/local", "backends/zmq"))
    cmd = [sys.executable, __file__, "--layers", str(args.layers), "--requests", str(args.requests),
           "--blocks", str(args.blocks), "--rounds", "1", "--child"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, timeout=600, cwd="/")
    return json.loads(out.stdout.splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=40, help="blocks per request")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--baseline", help="an older checkout to measure as well, round by round")
    parser.add_argument("--json")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.layers, args.requests, args.blocks, 3)))
        return 0
    if args.baseline is None:
        report: dict[str, Any] = {"now": measure(args.layers, args.requests, args.blocks, args.rounds)}
    else:  # both in child processes, alternating, so neither keeps a warmer cache
        pairs = [(_child(str(Path(__file__).resolve().parent.parent), args), _child(args.baseline, args))
                 for _ in range(args.rounds)]
        report = {
            "now": {k: statistics.median(p[0][k] for p in pairs) for k in ("handle_us", "overhead_us")},
            "baseline": {k: statistics.median(p[1][k] for p in pairs) for k in ("handle_us", "overhead_us")},
            "baseline / now (overhead)": statistics.median(p[1]["overhead_us"] / p[0]["overhead_us"] for p in pairs),
        }
    shape = f"{args.layers} layers, {args.requests} requests x {args.blocks} blocks"
    for name, row in report.items():
        if isinstance(row, dict):
            print(f"{name:9s} ({shape}): handle {row['handle_us']:8.1f} us/layer, besides the read {row['overhead_us']:8.1f}")
        else:
            print(f"{name}: {row:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
