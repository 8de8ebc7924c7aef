"""The floor of the control path: a bare pyzmq DEALER/ROUTER ping-pong of one msgpack message each way.

    python bench/pingpong.py [--rounds 2000] [--json out.json]

A ROUTER in a child process (as a Decode rank) answers each readiness-shaped message from a
DEALER here (as a Prefill rank) with a ``read_done``-shaped one, both packed and unpacked
with msgpack, no rd2h code. The round trip's p50 is what a tiny layer of ``rd2h demo``
(layer announced -> Decode replied) is held against (``bench/end_to_end.py``).
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time

import msgpack
import numpy as np
import zmq

# What a one-block layer's readiness carries: (tag, layer, name, read_reqs, done, member, ratio).
_READY = [b"read_ready_batch", 0, "model.layers.0.attn", [["req-0", [0], [0], 0, 0]], [], 0, 1]


def _serve(port: int) -> None:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(f"tcp://127.0.0.1:{port}")
    print("ready", flush=True)
    while True:
        identity, payload = router.recv_multipart()
        message = msgpack.unpackb(payload)
        if message[0] == b"exit":
            break
        router.send_multipart([identity, b"", msgpack.packb([b"read_done", message[1]])])
    router.close(0)
    ctx.term()


def measure(rounds: int) -> dict[str, float]:
    """Round-trip percentiles in microseconds over ``rounds`` after a warm-up of 100."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port)], stdout=subprocess.PIPE, text=True)
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        dealer.connect(f"tcp://127.0.0.1:{port}")
        times = np.empty(rounds)
        for i in range(-100, rounds):
            started = time.perf_counter()
            dealer.send(msgpack.packb([*_READY[:1], i, *_READY[2:]]))
            frames = dealer.recv_multipart()
            reply = msgpack.unpackb(frames[-1])
            if reply[1] != i:
                raise AssertionError(f"reply for layer {reply[1]}, expected {i}")
            if i >= 0:
                times[i] = time.perf_counter() - started
        dealer.send(msgpack.packb([b"exit"]))
    finally:
        dealer.close(0)
        ctx.term()
        server.wait(timeout=10)
    us = times * 1e6
    return {"p50_us": float(np.percentile(us, 50)), "p90_us": float(np.percentile(us, 90)),
            "p99_us": float(np.percentile(us, 99)), "rounds": rounds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--json")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        _serve(args.serve)
        return 0
    result = measure(args.rounds)
    print(f"zmq DEALER/ROUTER + msgpack round trip over {args.rounds}: p50 {result['p50_us']:.0f} us, "
          f"p90 {result['p90_us']:.0f} us, p99 {result['p99_us']:.0f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
