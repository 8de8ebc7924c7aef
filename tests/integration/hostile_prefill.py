"""A hostile local Prefill, run as its own process by the admission tests and the measuring script.

It speaks through the real codec and real zmq, and owns a real local-engine registration
(so its metadata names its own pid, start time and regions); what it does wrong is chosen
by ``mode``:

- ``hang``: ``count`` peers (one DEALER each) whose mf_meta names a proof socket of this
  process that accepts connections and never answers; each then sends ``held`` bytes of
  frames that Decode must hold until the handshake ends. Prints ``accepted N`` as Decode's
  proofs connect. ``release`` on stdin closes the silent socket: every proof fails.
- ``cheap``: ``count`` peers whose mf_meta carries garbage engine metadata (refused at once),
  their connections kept open.
- ``bigproof``: one peer whose proof socket answers a reader with a ``held``-byte reply.

Prints ``ready`` once everything is sent, then waits for ``exit`` (or the end of stdin).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import socket
import struct
import sys
import threading

import msgpack
import numpy as np
import zmq

LAYER = "l0"


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class SilentSocket:
    """A proof socket that takes connections and answers none (or answers ``reply`` to
    each) until closed."""

    def __init__(self, reply: bytes | None = None) -> None:
        self.name = f"rd2h-hostile.{os.getpid()}.{id(self):x}"
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(b"\0" + self.name.encode())
        self.listener.listen(1024)
        self.reply = reply
        self.held: list[socket.socket] = []
        self.closed = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        self.listener.settimeout(0.05)
        while not self.closed.is_set():
            try:
                conn = self.listener.accept()[0]
            except TimeoutError:
                continue
            except OSError:
                return
            self.held.append(conn)
            if self.reply is not None:
                threading.Thread(target=conn.sendall, args=(self.reply,), daemon=True).start()
            _say(f"accepted {len(self.held)}")

    def close(self) -> None:
        self.closed.set()
        self.listener.close()
        for conn in self.held:
            conn.close()


def _meta(layouts: dict[str, object], metadata: bytes, name: str, proof_socket: str | None) -> bytes:
    from rd2h_local import _metadata

    from rd2h.wire import protocol
    from rd2h.wire.layer_metadata import encode_layer_metadata
    from rd2h.wire.mf_meta import MfMeta

    if proof_socket is not None:
        metadata = _metadata.encode(dataclasses.replace(_metadata.decode(metadata), proof_socket=proof_socket))
    return protocol.encode(MfMeta(name, encode_layer_metadata(layouts), engine_metadata=metadata))


def big_reply(size: int) -> bytes:
    """A well-formed proof reply of about ``size`` bytes: a huge list of regions."""
    count = max(1, (size - 64) // 11)  # 11 bytes a region
    body = msgpack.packb((b"rd2h-local-proof", 1, None, [[1 << 40, 1]] * count), use_bin_type=True)
    return struct.pack(">I", len(body)) + body


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("hang", "cheap", "bigproof"))
    parser.add_argument("address")
    parser.add_argument("--count", type=int, default=1)
    parser.add_argument("--held", type=int, default=0)
    args = parser.parse_args(argv)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))  # a connection per peer

    from rd2h import plugins
    from rd2h.api import LayerTensors, layer_layout

    engine = plugins.load_engine("local", "prefill")
    tensors = LayerTensors(main=[np.ones((8, 64), np.uint8)], indexer=np.ones((8, 16), np.uint8))
    layouts = {LAYER: layer_layout(tensors)}
    metadata = engine.register([r for lay in layouts.values() for r in lay.regions()])
    context = zmq.Context()
    context.max_sockets = args.count + 16
    dealers = []
    silent = None
    if args.mode == "hang":
        silent = SilentSocket()
    elif args.mode == "bigproof":
        silent = SilentSocket(reply=big_reply(args.held))
    for i in range(args.count):
        sock = context.socket(zmq.DEALER)
        sock.linger = 0
        sock.sndhwm = 0
        sock.connect(args.address)
        if args.mode == "cheap":
            sock.send(_meta(layouts, b"\x93garbage", f"cheap-{i}", None))
        else:
            sock.send(_meta(layouts, metadata, f"{args.mode}-{i}", silent.name if silent else None))
            left = args.held if args.mode == "hang" else 0
            while left > 0:
                chunk = min(left, 1 << 20)
                sock.send(b"\x00" * chunk)  # held unread until the handshake ends
                left -= chunk
        dealers.append(sock)
    _say("ready")
    for line in sys.stdin:
        if line.strip() == "release" and silent is not None:
            silent.close()
            _say("released")
        if line.strip() == "exit":
            break
    for sock in dealers:
        sock.close()
    context.term()
    engine.close()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main(sys.argv[1:])
