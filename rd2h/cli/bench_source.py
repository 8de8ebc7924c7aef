"""The source side of ``rd2h bench``: a process that holds a layer pool and exposes it.

Run as ``python -m rd2h.cli.bench_source --engine NAME --size BYTES --memory thp``: it maps
``size`` bytes of the memory kind asked for, writes the pattern (word ``i`` of the pool holds
``i``, so any destination is checked without shipping data), registers the pool with a
Prefill-side engine, prints one line ``rd2h-bench-source: {json}`` (pid, address, base64
metadata) and waits until stdin ends. ``SourceProcess`` is the parent's handle on it.

Memory kinds (:data:`MEMORY_KINDS`): ``shared`` is anonymous ``MAP_SHARED`` memory (shmem,
4 KiB pages: what ``host_buffer`` gave before, and what a pool shared between processes
is); ``thp`` is private memory advised to use transparent huge pages (``host_buffer`` now).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from rd2h.tensors import host_buffer

__all__ = ["MEMORY_KINDS", "SourceProcess", "fill_pattern", "pool"]

MEMORY_KINDS = ("shared", "thp")
_HELLO = "rd2h-bench-source: "


def pool(nbytes: int, memory: str) -> np.ndarray:
    """A pre-faulted byte pool of the given memory kind."""
    if memory not in MEMORY_KINDS:
        raise ValueError(f"memory kind must be one of {MEMORY_KINDS}, got {memory!r}")
    return host_buffer(nbytes, shared=memory == "shared")


def fill_pattern(buf: np.ndarray) -> None:
    """Word ``i`` of ``buf`` holds ``i`` (``buf.nbytes`` is a multiple of 8)."""
    words = buf.view(np.uint64)
    step = 1 << 22  # in slices: a whole-pool arange would double the peak memory
    for start in range(0, len(words), step):
        stop = min(start + step, len(words))
        words[start:stop] = np.arange(start, stop, dtype=np.uint64)


def _serve(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rd2h.cli.bench_source")
    parser.add_argument("--engine", required=True, help="engine name, or 'none' for a bare process")
    parser.add_argument("--options", default="{}")
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--memory", choices=MEMORY_KINDS, default="thp")
    args = parser.parse_args(argv)

    from rd2h.interfaces import Region
    from rd2h.plugins import load_engine

    buf = pool(args.size, args.memory)
    fill_pattern(buf)
    engine = None if args.engine == "none" else load_engine(args.engine, "prefill", **json.loads(args.options))
    metadata = b"" if engine is None else engine.register([Region(buf.ctypes.data, buf.nbytes)])
    hello = {"pid": os.getpid(), "addr": buf.ctypes.data, "metadata": base64.b64encode(metadata).decode()}
    sys.stdout.write(_HELLO + json.dumps(hello) + "\n")
    sys.stdout.flush()
    sys.stdin.read()
    if engine is not None:
        engine.close()
    return 0


class SourceProcess:
    """A running source: ``pid``, ``addr`` (the pool's base in that process), ``metadata``.

    Raises ``RuntimeError`` with the process's stderr if it does not come up in ``timeout``.
    """

    def __init__(
        self,
        engine: str,
        size: int,
        memory: str,
        options: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float = 120.0,
    ) -> None:
        self._stderr = tempfile.TemporaryFile()
        cmd = [sys.executable, "-m", "rd2h.cli.bench_source", "--engine", engine,
               "--options", json.dumps(dict(options or {})), "--size", str(size), "--memory", memory]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
                                     env={**os.environ, **(env or {})})
        try:
            hello = json.loads(self._hello(timeout))
        except BaseException:
            self.close()
            raise
        self.pid: int = hello["pid"]
        self.addr: int = hello["addr"]
        self.metadata: bytes = base64.b64decode(hello["metadata"])

    def _hello(self, timeout: float) -> str:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        fd, buf = self.proc.stdout.fileno(), b""
        while True:
            *lines, buf = buf.split(b"\n")
            for line in lines:  # native libraries may print to stdout too
                if line.startswith(_HELLO.encode()):
                    return line[len(_HELLO):].decode()
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise RuntimeError(f"bench source did not start within {timeout} s:\n{self.stderr()}")
            chunk = os.read(fd, 65536)
            if not chunk:
                self.proc.wait(timeout=5)
                raise RuntimeError(f"bench source exited with {self.proc.returncode}:\n{self.stderr()}")
            buf += chunk

    def stderr(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")[-4000:]

    def close(self) -> None:
        """End the process (stdin closed, then killed after 10 s). Idempotent."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None and not self.proc.stdout.closed:
            self.proc.stdout.close()
        self._stderr.close()

    def __enter__(self) -> SourceProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


if __name__ == "__main__":
    sys.exit(_serve())
