"""A patterned source of a transfer engine, in a process of its own (used by ``rd2h probe``,
``rd2h bench`` and the conformance suite in ``rd2h.testing``).

Run as ``python -m rd2h.cli.peer --engine NAME --role prefill --options JSON
--sizes 4194304,1048576 --seed 7``. It builds the engine by name, maps one block of
memory, fills it with a known pattern, registers the regions (with one unregistered page
before, between and after them, so an engine that skips its region check reads mapped
but foreign bytes and the test sees it), prints one line ``rd2h-peer: {json}`` (pid, session
id, regions, base64 metadata) and then waits: a line ``exit`` or the end of stdin ends it.
With ``--memory cuda:0`` (any memory kind torch can allocate in) the regions are device
tensors holding the same patterns, each of its own allocation (no guard pages there).

``PeerProcess`` is the parent's handle on such a process.
"""

from __future__ import annotations

import argparse
import base64
import json
import mmap
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["PeerProcess", "pattern", "load_engine", "GAP", "GAP_BYTE"]

HELLO = "rd2h-peer: "  # marks our line: native libraries may print to stdout too
GAP = mmap.PAGESIZE  # unregistered bytes around every region
GAP_BYTE = 0xE5  # what the unregistered bytes hold


def pattern(seed: int, index: int, size: int) -> np.ndarray:
    """The bytes region ``index`` of a peer started with ``seed`` holds."""
    return np.frombuffer(np.random.default_rng([seed, index]).bytes(size), dtype=np.uint8)


def load_engine(name: str, role: str, **options: Any) -> Any:
    """Build a transfer engine by name, through ``rd2h.plugins`` (as an application would)."""
    from rd2h.plugins import load_engine as load

    return load(name, role, **options)


def _main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rd2h.cli.peer")
    parser.add_argument("--engine", required=True)
    parser.add_argument("--role", default="prefill")
    parser.add_argument("--options", default="{}", help="engine options as a JSON object")
    parser.add_argument("--sizes", required=True, help="region sizes in bytes, comma separated")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--memory", default="host", help="memory kind of the regions, e.g. cuda:0")
    args = parser.parse_args(argv)

    from rd2h.interfaces import Region

    sizes = [int(s) for s in args.sizes.split(",")]
    engine = load_engine(args.engine, args.role, **json.loads(args.options))
    memory = mmap.mmap(-1, sum(sizes) + GAP * (len(sizes) + 1))
    view = np.frombuffer(memory, dtype=np.uint8)
    view[:] = GAP_BYTE  # also faults every page in
    regions, offset = [], GAP
    for i, size in enumerate(sizes):
        view[offset : offset + size] = pattern(args.seed, i, size)
        regions.append(Region(view.ctypes.data + offset, size))
        offset += size + GAP
    on_device = [] if args.memory == "host" else _on_device(args.memory, args.seed, sizes)
    if on_device:
        from rd2h.tensors import memory_kind

        regions = [Region(t.data_ptr(), size, memory_kind(t)) for t, size in zip(on_device, sizes)]
    metadata = engine.register(regions)
    hello = {
        "pid": os.getpid(),
        "session_id": engine.session_id,
        "regions": [[r.addr, r.length] for r in regions],
        "metadata": base64.b64encode(metadata).decode("ascii"),
    }
    sys.stdout.write(HELLO + json.dumps(hello) + "\n")
    sys.stdout.flush()
    for line in sys.stdin:
        if line.strip() == "exit":
            break
    engine.close()
    on_device.clear()
    del view
    memory.close()
    return 0


def _on_device(kind: str, seed: int, sizes: Sequence[int]) -> list[Any]:
    """One torch tensor per region on device ``kind``, holding the region's pattern."""
    import torch

    if kind.startswith("npu"):
        import torch_npu  # noqa: F401 - registers torch.npu
    return [torch.from_numpy(pattern(seed, i, size).copy()).to(kind) for i, size in enumerate(sizes)]


class PeerProcess:
    """A running peer: its metadata, its regions and the bytes they hold; ``memory`` is the
    memory kind its regions are in (``"host"``, or a device such as ``"cuda:0"``).

    Raises ``RuntimeError`` with the peer's stderr if it does not come up in ``timeout``.
    """

    def __init__(
        self,
        engine: str,
        *,
        sizes: Sequence[int],
        seed: int,
        role: str = "prefill",
        options: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float = 60.0,
        memory: str = "host",
    ) -> None:
        self.sizes = tuple(sizes)
        self.seed = seed
        self._stderr = tempfile.TemporaryFile()
        cmd = [
            sys.executable, "-m", "rd2h.cli.peer",
            "--engine", engine, "--role", role, "--options", json.dumps(dict(options or {})),
            "--sizes", ",".join(map(str, self.sizes)), "--seed", str(seed), "--memory", memory,
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, env={**os.environ, **(env or {})}
        )
        try:
            hello = json.loads(self._hello_line(timeout))
        except BaseException:
            self.kill()
            raise
        self.pid: int = hello["pid"]
        self.session_id: str = hello["session_id"]
        self.regions: list[tuple[int, int]] = [tuple(r) for r in hello["regions"]]
        self.metadata: bytes = base64.b64decode(hello["metadata"])
        self._patterns: dict[int, np.ndarray] = {}

    def _hello_line(self, timeout: float) -> bytes:
        """The peer's marked line, skipping whatever else it printed first."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        buf = b""
        marker = HELLO.encode()
        while True:
            *lines, buf = buf.split(b"\n")
            for line in lines:
                if line.startswith(marker):
                    return line[len(marker) :]
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise RuntimeError(f"peer did not start within {timeout} s; stderr:\n{self.stderr()}")
            chunk = os.read(fd, 65536)
            if not chunk:
                self.proc.wait(timeout=5)
                raise RuntimeError(f"peer exited with {self.proc.returncode}; stderr:\n{self.stderr()}")
            buf += chunk

    def stderr(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")[-4000:]

    def expected(self, region: int) -> np.ndarray:
        """The bytes region ``region`` holds (computed here, not read from the peer)."""
        if region not in self._patterns:
            self._patterns[region] = pattern(self.seed, region, self.sizes[region])
        return self._patterns[region]

    def kill(self) -> None:
        """SIGKILL and reap; idempotent."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def close(self, timeout: float = 10.0) -> None:
        """Ask the peer to exit; kill it if it does not in ``timeout``. Idempotent."""
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(b"exit\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=timeout)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None and not stream.closed:
                stream.close()
        self._stderr.close()

    def __enter__(self) -> PeerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


if __name__ == "__main__":
    try:
        sys.exit(_main())
    except Exception:
        traceback.print_exc()
        sys.exit(1)
