"""One side of the two-host test, run inside its namespace: ``python sides.py prefill|decode JSON``.

It builds a KVSource or KVSink over real tensors and then obeys one JSON command per stdin
line, answering one marked JSON line each (native libraries print to stdout too):

- both: ``{"cmd": "wait", "id": ..., "within": s}`` -> the outcome (state, error class and text,
  seconds waited); ``{"cmd": "exit"}``;
- prefill: ``{"cmd": "send", "id": ..., "blocks": [...]}`` announces every layer of a request;
- decode: ``{"cmd": "expect", "id": ..., "blocks": [...]}``; ``{"cmd": "bytes"}`` -> bytes read so
  far; ``{"cmd": "verify", "id": ..., "blocks": [...], "src": [...]}`` -> whether every
  destination block holds its source pattern.

Every byte on Prefill is a function of (layer, tensor, block), so Decode checks what arrived
without anything shipped beside the transfer.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import numpy as np

from rd2h.api import KVSink, KVSource, LayerTensors, host_buffer

MARK = "twohost: "
WIDTHS = (16 << 10, 2 << 10, 1 << 10, 64)  # bytes per block: main K, main V, indexer, scale


def source_bytes(layer: int, tensor: int, blocks: np.ndarray, width: int) -> np.ndarray:
    seeds = np.uint32(layer * 7919 + tensor * 104_729) + blocks.astype(np.uint32) * np.uint32(2_654_435_761)
    return (seeds[:, None] + np.arange(width // 4, dtype=np.uint32)[None, :]).view(np.uint8)


def tensors(layer: int, blocks: int, fill: bool) -> LayerTensors:
    arrays = []
    for t, width in enumerate(WIDTHS):
        a = host_buffer((blocks, width))
        a[:] = source_bytes(layer, t, np.arange(blocks), width) if fill else 0
        arrays.append(a)
    return LayerTensors(main=arrays[:2], indexer=arrays[2], scale=arrays[3])


def say(payload: dict[str, Any]) -> None:
    sys.stdout.write(MARK + json.dumps(payload) + "\n")
    sys.stdout.flush()


def outcome(found: Any, started: float) -> dict[str, Any]:
    error = found.error
    return {
        "state": found.state.value,
        "ok": found.ok,
        "error": type(error).__name__ if error is not None else None,
        "why": str(error)[:500] if error is not None else "",
        "seconds": time.monotonic() - started,
    }


def main() -> int:
    role, conf = sys.argv[1], json.loads(sys.argv[2])
    layers, blocks = conf["layers"], conf["blocks"]
    names = [f"model.layers.{i}.attn" for i in range(layers)]
    options = conf["engine_options"]
    if role == "prefill":
        src = {n: tensors(i, blocks, True) for i, n in enumerate(names)}
        side: Any = KVSource(src, block_size=conf["block_size"], engine=conf["engine"], engine_options=options,
                             reply_timeout=conf["reply_timeout"], channel_options=conf["channel_options"])
        from rd2h.prefill.source import DecodeEndpoint

        endpoint = DecodeEndpoint(conf["decode_host"], conf["kv_port"], 1)
    else:
        dst = {n: tensors(i, blocks, False) for i, n in enumerate(names)}
        side = KVSink(dst, host=conf["decode_host"], kv_port=conf["kv_port"], engine=conf["engine"],
                      engine_options=options, request_timeout=conf["request_timeout"],
                      channel_options=conf["channel_options"])
    with side:
        say({"ready": role})
        for line in sys.stdin:
            msg = json.loads(line)
            cmd = msg["cmd"]
            started = time.monotonic()
            if cmd == "exit":
                break
            if cmd == "send":
                tokens = len(msg["blocks"]) * conf["block_size"]
                side.add_request(msg["id"], endpoint, main_block_ids=msg["blocks"], num_tokens=tokens)
                say({"sent": side.send_all({msg["id"]: tokens}) == {}})
            elif cmd == "expect":
                side.expect(msg["id"], main_blocks=msg["blocks"])
                say({"expected": msg["id"]})
            elif cmd == "wait":
                try:
                    wait = side.wait_finished if role == "prefill" else side.wait
                    say(outcome(wait([msg["id"]], msg["within"])[msg["id"]], started))
                except TimeoutError as exc:
                    say({"state": "pending", "ok": False, "error": type(exc).__name__, "why": str(exc),
                         "seconds": time.monotonic() - started})
            elif cmd == "bytes":
                say({"bytes": side.counters.bytes_read})
            elif cmd == "verify":
                dst_ids, src_ids = np.array(msg["blocks"]), np.array(msg["src"])
                bad = [
                    f"layer {i} tensor {t}"
                    for i, n in enumerate(names)
                    for t, arr in enumerate((*dst[n].main, dst[n].indexer, dst[n].scale))
                    if not np.array_equal(arr[dst_ids], source_bytes(i, t, src_ids, WIDTHS[t]))
                ]
                say({"verified": not bad, "bad": bad[:5]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
