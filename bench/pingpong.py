"""The floor of the control path: bare ping-pongs of one msgpack message each way, no rd2h code.

    python bench/pingpong.py [--rounds 2000] [--json out.json]

A server in a child process (as a Decode rank) answers each readiness-shaped message from a
client here (as a Prefill rank) with a ``read_done``-shaped one, both packed and unpacked with
msgpack. Two transports:

- ``zmq``: a pyzmq DEALER here, a ROUTER there (libzmq's I/O thread on each side); the round
  trip's p50 is what a tiny layer of ``rd2h demo`` (layer announced -> Decode replied) is held
  against (``bench/end_to_end.py``, ``bench/control_channel.py``);
- ``socket``: a plain blocking TCP socket each side, a 4-byte length before each message (what
  the ``tcp`` channel puts on the wire, without its greeting, poll or bookkeeping). With
  ``spin`` both ends poll a non-blocking socket instead of sleeping in ``recv``
  (``bench/busy_poll.py`` holds the two against each other).
"""

from __future__ import annotations

import argparse
import json
import socket
import struct
import subprocess
import sys
import time

import msgpack
import numpy as np
import zmq

# What a one-block layer's readiness carries: (tag, layer, name, read_reqs, done, member, ratio).
_READY = [b"read_ready_batch", 0, "model.layers.0.attn", [["req-0", [0], [0], 0, 0]], [], 0, 1]
_HEADER = struct.Struct("!I")


def _serve_zmq(port: int) -> None:
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


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        try:
            more = sock.recv(size - len(data))
        except BlockingIOError:  # a spinning end's non-blocking socket: look again at once
            continue
        if not more:
            raise ConnectionError("peer closed")
        data += more
    return data


def _recv_frame(sock: socket.socket) -> bytes:
    (size,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    return _recv_exact(sock, size)


def _send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(_HEADER.pack(len(payload)) + payload)


def _serve_socket(port: int, spin: bool = False) -> None:
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", port))
        server.listen(1)
        print("ready", flush=True)
        conn, _ = server.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.setblocking(not spin)
            while True:
                message = msgpack.unpackb(_recv_frame(conn))
                if message[0] == b"exit":
                    break
                _send_frame(conn, msgpack.packb([b"read_done", message[1]]))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _percentiles(times: np.ndarray, rounds: int) -> dict[str, float]:
    us = times * 1e6
    return {"p50_us": float(np.percentile(us, 50)), "p90_us": float(np.percentile(us, 90)),
            "p99_us": float(np.percentile(us, 99)), "rounds": rounds}


def measure(rounds: int) -> dict[str, float]:
    """zmq round-trip percentiles in microseconds over ``rounds`` after a warm-up of 100."""
    port = _free_port()
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
    return _percentiles(times, rounds)


def measure_socket(rounds: int, spin: bool = False) -> dict[str, float]:
    """The same over a plain TCP socket with length-prefixed frames, both ends sleeping in
    ``recv`` or, with ``spin``, both polling; ``cpu_us``: this process's CPU per round trip."""
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve-socket", str(port), *(["--spin"] if spin else [])],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if spin:
                sock.setblocking(False)
            times = np.empty(rounds)
            for i in range(-100, rounds):
                if i == 0:
                    cpu = time.process_time()
                started = time.perf_counter()
                _send_frame(sock, msgpack.packb([*_READY[:1], i, *_READY[2:]]))
                reply = msgpack.unpackb(_recv_frame(sock))
                if reply[1] != i:
                    raise AssertionError(f"reply for layer {reply[1]}, expected {i}")
                if i >= 0:
                    times[i] = time.perf_counter() - started
            cpu = time.process_time() - cpu
            _send_frame(sock, msgpack.packb([b"exit"]))
    finally:
        server.wait(timeout=10)
    return {**_percentiles(times, rounds), "cpu_us": cpu / rounds * 1e6}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--json")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--serve-socket", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--spin", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        _serve_zmq(args.serve)
        return 0
    if args.serve_socket:
        _serve_socket(args.serve_socket, args.spin)
        return 0
    results = {"zmq": measure(args.rounds), "socket": measure_socket(args.rounds)}
    for kind, result in results.items():
        print(f"{kind:>6} ping-pong + msgpack over {args.rounds}: p50 {result['p50_us']:.0f} us, "
              f"p90 {result['p90_us']:.0f} us, p99 {result['p99_us']:.0f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
