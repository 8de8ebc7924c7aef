"""Cost per block as a layer grows: blocks per layer, requests, TP ratio (one process, real runtimes).

    python bench/scaling.py [--full] [--out DIR]

Each point runs ``ratio`` Prefill ranks (``KVSource``) and one Decode rank (``KVSink``) in this
process over zmq on loopback and the local engine, a layer of tiny blocks (64 B main, 16 B
indexer: the copy is cheap, so the control path shows), ``--layers`` layers of one step.
Figures per block, from the Decode rank's own per-readiness stats:

- ``handle``: time in the sink's handling of a readiness (plan, read, reply) per block;
- ``control``: ``handle`` less the time inside ``read_batch``;
- ``wall``: first announce -> every request settled, per block (Prefill, Decode and the
  channel, sharing one interpreter).

Flat curves mean linear total cost. Writes ``scaling.json`` and ``scaling.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from rd2h.api import KVSink, KVSource, LayerTensors, host_buffer
from rd2h.decode.peer_limits import PeerLimits
from rd2h.prefill.source import DecodeEndpoint

MAIN_BYTES, INDEXER_BYTES = 64, 16
_port = [7600]


def point(blocks: int, requests: int, ratio: int, layers: int, seed: int = 0) -> dict[str, Any]:
    """One measurement: ``requests`` requests sharing ``blocks`` blocks a layer."""
    per_request = max(1, blocks // requests)
    total = per_request * requests
    rng = np.random.default_rng(seed)
    src_ids = rng.permutation(total).reshape(requests, per_request)
    dst_ids = rng.permutation(total + 16)[:total].reshape(requests, per_request)
    names = [f"layer.{i}" for i in range(layers)]

    def tensors(n: int) -> dict[str, LayerTensors]:
        return {name: LayerTensors(main=[host_buffer((n, MAIN_BYTES))], indexer=host_buffer((n, INDEXER_BYTES)))
                for name in names}

    _port[0] += 2
    ids = [f"r{i}" for i in range(requests)]
    held = [tensors(total + 16)] + [tensors(total) for _ in range(ratio)]  # layouts hold addresses only
    # a readiness names every block of the layer, main and indexer: allow that many ids
    limits = PeerLimits(max_ids_per_message=max(PeerLimits().max_ids_per_message, 2 * total))
    with KVSink(held[0], kv_port=_port[0], peer_limits=limits) as sink:
        endpoint = DecodeEndpoint("127.0.0.1", _port[0], 1)
        sources = [KVSource(held[1 + r], block_size=1, rank=r, tp_size=ratio) for r in range(ratio)]
        try:
            # a one-block request first, so the handshakes are over before the measured step:
            # readiness frames that arrive during one are held, at most 32 MiB of them
            warm_dst = int(np.setdiff1d(np.arange(total + 16), dst_ids.ravel())[0])
            sink.expect("warm-up", main_blocks=[warm_dst])
            for s in sources:
                s.add_request("warm-up", endpoint, main_block_ids=[0], num_tokens=1)
                s.send_all({"warm-up": 1})
            if not sink.wait(["warm-up"], timeout=120)["warm-up"].ok:
                raise AssertionError("the warm-up request failed")
            measured_from = len(sink.counters.stats)
            for i, ext in enumerate(ids):
                sink.expect(ext, main_blocks=dst_ids[i].tolist())
                for s in sources:
                    s.add_request(ext, endpoint, main_block_ids=src_ids[i].tolist(), num_tokens=per_request)
            started = time.perf_counter()
            for s in sources:
                s.schedule(dict.fromkeys(ids, per_request))
            for name in names:
                for s in sources:
                    s.layer_ready(name)
            outcomes = sink.wait(ids, timeout=600)
            wall = time.perf_counter() - started
            if not all(o.ok for o in outcomes.values()):
                raise AssertionError(f"failed: {[e for e, o in outcomes.items() if not o.ok][:5]}")
            stats = list(sink.counters.stats)[measured_from:]
        finally:
            for s in sources:
                s.close()
    per_layer: dict[int, list[float]] = {}
    for st in stats:
        handle, read = per_layer.setdefault(st.layer_idx, [0.0, 0.0]), st.read_seconds
        handle[0] += st.handle_seconds
        handle[1] += read
    handle_ns = statistics.median(v[0] for v in per_layer.values()) / total * 1e9
    read_ns = statistics.median(v[1] for v in per_layer.values()) / total * 1e9
    return {"blocks": total, "requests": requests, "ratio": ratio, "layers": layers,
            "handle_ns_per_block": handle_ns, "control_ns_per_block": handle_ns - read_ns,
            "wall_ns_per_block": wall / (layers * total) * 1e9}


def sweeps(full: bool) -> dict[str, list[dict[str, int]]]:
    if full:
        return {
            "blocks": [{"blocks": b, "requests": 1, "ratio": 1} for b in (1 << 10, 1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20)],
            "requests": [{"blocks": 1 << 16, "requests": r, "ratio": 1} for r in (1, 4, 16, 64, 256, 1024)],
            "ratio": [{"blocks": 1 << 14, "requests": 64, "ratio": t} for t in (1, 2, 4, 8)],
        }
    return {
        "blocks": [{"blocks": b, "requests": 1, "ratio": 1} for b in (1 << 10, 1 << 13)],
        "requests": [{"blocks": 1 << 12, "requests": r, "ratio": 1} for r in (1, 32)],
        "ratio": [{"blocks": 1 << 11, "requests": 8, "ratio": t} for t in (1, 2)],
    }


def figure(results: dict[str, list[dict[str, Any]]]) -> Any:
    """A panel per sweep, ns per block on a log axis: ``control`` is 10-350 ns where ``wall`` is
    600-1,800, and on a linear axis from 0 its curve, the one the sweeps are about, lay flat
    on the floor. Raises ImportError without matplotlib."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

    fig = Figure(figsize=(13, 4.0), layout="constrained")
    axes = fig.subplots(1, len(results), squeeze=False, sharey=True)[0]  # one scale: panels compare
    for ax, (axis, rows) in zip(axes, results.items()):
        x = [r[axis] for r in rows]
        for key, style in (("wall_ns_per_block", "o-"), ("handle_ns_per_block", "s-"), ("control_ns_per_block", "^-")):
            ax.plot(x, [max(r[key], 1.0) for r in rows], style, label=key.replace("_ns_per_block", ""), gid=key)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel({"blocks": "blocks per layer (1 request)", "requests": "requests (blocks per layer fixed)",
                       "ratio": "TP ratio (Prefill ranks per Decode rank)"}.get(axis, axis))
        ax.yaxis.set_major_locator(FixedLocator([m * 10.0**k for k in range(0, 7) for m in (1, 3)]))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("ns per block (log)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, [{"wall": "wall: first announce to all settled", "handle": "handle: the sink's handling",
                          "control": "control: handle less the read"}[label] for label in labels],
               loc="outside lower center", ncol=3, frameon=False)
    return fig


def plot(out: Path, results: dict[str, list[dict[str, Any]]]) -> Path | None:
    """``scaling.png`` in ``out``; None without matplotlib."""
    try:
        fig = figure(results)
    except ImportError:
        return None
    path = out / "scaling.png"
    fig.savefig(path, dpi=110)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="1k..1M blocks, 1..1024 requests, ratio 1..8")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--out", type=Path, default=Path("rd2h-bench-results"))
    args = parser.parse_args(argv)
    results: dict[str, list[dict[str, Any]]] = {}
    for axis, points in sweeps(args.full).items():
        results[axis] = []
        for p in points:
            row = point(p["blocks"], p["requests"], p["ratio"], args.layers)
            results[axis].append(row)
            print(f"{axis:<9} blocks {row['blocks']:>8} requests {row['requests']:>5} ratio {row['ratio']}: "
                  f"wall {row['wall_ns_per_block']:>8.0f}  handle {row['handle_ns_per_block']:>7.0f}  "
                  f"control {row['control_ns_per_block']:>7.0f} ns/block", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "scaling.json").write_text(json.dumps(results, indent=2))
    png = plot(args.out, results)
    print(f"wrote {args.out / 'scaling.json'}" + (f", {png}" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
