"""Prefill and Decode ranks as real processes, driven command by command from the test.

Each rank is a ``multiprocessing`` spawn child that builds a ``KVSource`` or ``KVSink`` and
then serves calls over a pipe, so the test decides what happens between two layers: kill
(SIGKILL), stop (SIGSTOP), continue, restart. Every byte Prefill holds is
``pattern(layer, tensor, request index, position)`` (the demo's workload), and every Decode
destination lives in one shared-memory segment the test owns, so the test checks the bytes
itself, also after a rank died: DONE requests equal their sources, blocks given to no request
stay zero. Children die with the test process (PR_SET_PDEATHSIG) and ``Cluster`` kills and
reaps every child it started.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import numpy as np
from typing_extensions import Self

from rd2h.cli.demo.ranks import _die_with_parent
from rd2h.cli.demo.workload import pattern

BLOCK = 16  # tokens per block
MAIN = (256, 64)  # bytes per block of the two main tensors (latent, rope)
INDEXER, SCALE = 64, 16  # bytes per block
SPECS = (*MAIN, INDEXER, SCALE)  # tensor numbering of pattern(): main..., indexer, scale
_SPAWN = multiprocessing.get_context("spawn")


@dataclass(frozen=True)
class Shape:
    layers: int = 4
    src_blocks: int = 96  # per Prefill tensor
    dst_blocks: int = 128  # per Decode tensor: some always stay untouched
    decode_tp: int = 1

    def names(self) -> list[str]:
        return [f"l{i}" for i in range(self.layers)]

    def pool_bytes(self) -> int:
        per_block = sum(MAIN) + self.decode_tp * (INDEXER + SCALE)
        return self.layers * self.dst_blocks * per_block


@dataclass(frozen=True)
class Request:
    ext_id: str
    index: int  # the pattern's request number
    src: tuple[int, ...]
    dst: tuple[int, ...]

    @property
    def tokens(self) -> int:
        return len(self.src) * BLOCK - BLOCK // 2  # a partial last block


def decode_views(buf: memoryview, shape: Shape) -> tuple[list[list[np.ndarray]], list[list[list[np.ndarray]]]]:
    """(main[layer][tensor], local[rank][layer][indexer, scale]) over one shared segment."""
    offset = 0

    def take(width: int) -> np.ndarray:
        nonlocal offset
        view = np.frombuffer(buf, np.uint8, shape.dst_blocks * width, offset).reshape(shape.dst_blocks, width)
        offset += shape.dst_blocks * width
        return view

    main = [[take(w) for w in MAIN] for _ in range(shape.layers)]
    local = [[[take(INDEXER), take(SCALE)] for _ in range(shape.layers)] for _ in range(shape.decode_tp)]
    return main, local


def outcome_tuple(outcome: Any) -> tuple[str, str | None, str]:
    error = outcome.error
    return outcome.state.value, None if error is None else type(error).__name__, "" if error is None else str(error)


def _outcomes(found: Mapping[str, Any]) -> dict[str, tuple[str, str | None, str]]:
    return {ext_id: outcome_tuple(o) for ext_id, o in found.items()}


def process_usage() -> tuple[int, int]:
    """(RSS in KiB, open fds) of this process."""
    with open("/proc/self/status") as status:
        rss = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    return rss, len(os.listdir("/proc/self/fd"))


# -- the ranks (in the child) ---------------------------------------------------------------


class PrefillRank:
    def __init__(self, shape: Shape, rank: int, tp: int, endpoint: str, **options: Any) -> None:
        from rd2h.api import DecodeEndpoint, KVSource, LayerTensors, host_buffer

        self.shape = shape
        self.tensors = [[host_buffer((shape.src_blocks, w)) for w in SPECS] for _ in range(shape.layers)]
        layers = {
            name: LayerTensors(main=t[: len(MAIN)], indexer=t[len(MAIN)], scale=t[len(MAIN) + 1])
            for name, t in zip(shape.names(), self.tensors)
        }
        options.setdefault("reply_timeout", 30.0)
        self.endpoint = DecodeEndpoint.parse(endpoint)
        self.source = KVSource(layers, block_size=BLOCK, rank=rank, tp_size=tp, **options)

    def add(self, req: Request, tokens: int | None = None) -> None:
        positions = np.arange(len(req.src))
        for layer, tensors in enumerate(self.tensors):
            for t, (width, arr) in enumerate(zip(SPECS, tensors)):
                arr[list(req.src)] = pattern(layer, t, req.index, positions, width)
        self.source.add_request(
            req.ext_id, self.endpoint, main_block_ids=list(req.src),
            num_tokens=req.tokens if tokens is None else tokens,
        )

    def schedule(self, tokens: Mapping[str, int]) -> dict[str, str]:
        return {e: type(err).__name__ for e, err in self.source.schedule(tokens).items()}

    def layers(self, lo: int, hi: int, gate: float = 30.0) -> None:
        for name in self.shape.names()[lo:hi]:
            self.source.wait_for_layer_send(name, timeout=gate)
            self.source.layer_ready(name)

    def abort(self, ext_id: str) -> bool:
        return self.source.abort(ext_id)

    def wait(self, ids: Sequence[str], timeout: float) -> dict[str, tuple[str, str | None, str]]:
        return _outcomes(self.source.wait_finished(list(ids), timeout))

    def take(self) -> dict[str, tuple[str, str | None, str]]:
        return _outcomes(self.source.take_finished())

    def usage(self) -> tuple[int, int]:
        return process_usage()

    def close(self) -> None:
        self.source.close()


class DecodeRank:
    def __init__(self, shape: Shape, rank: int, kv_port: int, shm: str, **options: Any) -> None:
        self.shape, self.rank, self.kv_port, self.options = shape, rank, kv_port, options
        self.shm = shared_memory.SharedMemory(shm)
        main, local = decode_views(self.shm.buf, shape)
        self.layers = {
            name: self._layer(main[i], local[rank][i]) for i, name in enumerate(shape.names())
        }
        del main, local
        try:
            self.sink = self._open()
        except BaseException:
            self._release()
            raise

    @staticmethod
    def _layer(main: list[np.ndarray], local: list[np.ndarray]) -> Any:
        from rd2h.api import LayerTensors

        return LayerTensors(main=main, indexer=local[0], scale=local[1])

    def _open(self) -> Any:
        from rd2h.api import KVSink

        return KVSink(self.layers, rank=self.rank, tp_size=self.shape.decode_tp, kv_port=self.kv_port, **self.options)

    def endpoint(self) -> str:
        return str(self.sink.endpoint)

    def expect(self, req: Request, **options: Any) -> None:
        self.sink.expect(req.ext_id, main_blocks=list(req.dst), **options)

    def abort(self, ext_id: str) -> bool:
        return self.sink.abort(ext_id)

    def wait(self, ids: Sequence[str], timeout: float) -> dict[str, tuple[str, str | None, str]]:
        return _outcomes(self.sink.wait(list(ids), timeout))

    def take(self) -> dict[str, tuple[str, str | None, str]]:
        return _outcomes(self.sink.take())

    def layers_read(self) -> int:
        return len(self.sink.counters.stats)

    def reopen(self) -> dict[str, tuple[str, str | None, str]]:
        """Close the sink (its socket and every session), bind a new one on the same port;
        the closed sink's outcomes."""
        self.sink.close()
        settled = _outcomes(self.sink.take())
        self.sink = self._open()
        return settled

    def usage(self) -> tuple[int, int]:
        return process_usage()

    def close(self) -> None:
        self.sink.close()
        self._release()

    def _release(self) -> None:
        self.sink = self.layers = None  # the views into the segment go before it closes
        try:
            self.shm.close()
        except BufferError:  # a traceback holds a view: the mapping goes with the process,
            self.shm._mmap = None  # and SharedMemory.__del__ must not try again at exit


def _serve(conn: Any, factory: Callable[..., Any], args: tuple, kwargs: dict) -> None:
    _die_with_parent()
    try:
        target = factory(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - the test reads the reason, whatever it is
        conn.send(("err", (type(exc).__name__, str(exc), traceback.format_exc())))
        return
    conn.send(("ok", os.getpid()))
    while True:
        try:
            name, call_args, call_kwargs = conn.recv()
        except EOFError:
            target.close()
            return
        try:
            result = ("ok", getattr(target, name)(*call_args, **call_kwargs))
        except BaseException as exc:  # noqa: BLE001 - the serving loop outlives any one call
            result = ("err", (type(exc).__name__, str(exc), traceback.format_exc()))
        conn.send(result)
        if name == "close":
            return


# -- the test side --------------------------------------------------------------------------


class ChildError(Exception):
    """A call in a rank raised: ``kind`` is the exception's class name."""

    def __init__(self, kind: str, message: str, trace: str) -> None:
        super().__init__(f"{kind}: {message}\n{trace}")
        self.kind, self.message = kind, message


class Rank:
    """A rank in a child process; ``call`` runs one of its methods there, bounded in time."""

    def __init__(self, factory: Callable[..., Any], *args: Any, start_timeout: float = 60.0, **kwargs: Any) -> None:
        self._conn, child = _SPAWN.Pipe()
        self.process = _SPAWN.Process(target=_serve, args=(child, factory, args, kwargs), daemon=True)
        self.process.start()
        child.close()
        self.pid = self._result(start_timeout, "start")

    def _result(self, timeout: float, what: str) -> Any:
        if not self._conn.poll(timeout):
            raise TimeoutError(f"rank pid {self.process.pid}: {what} gave no answer in {timeout} s")
        status, value = self._conn.recv()
        if status == "err":
            raise ChildError(*value)
        return value

    def call(self, name: str, *args: Any, timeout: float = 60.0, **kwargs: Any) -> Any:
        self.send(name, *args, **kwargs)
        return self.result(timeout, name)

    def send(self, name: str, *args: Any, **kwargs: Any) -> None:
        """Start a call without waiting for it (``result`` collects it)."""
        self._conn.send((name, args, kwargs))

    def result(self, timeout: float = 60.0, what: str = "call") -> Any:
        return self._result(timeout, what)

    def signal(self, sig: int) -> None:
        os.kill(self.process.pid, sig)

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(10)

    def wait_stopped(self, timeout: float = 10.0) -> None:
        """Until the kernel shows the process stopped (kill() returns before it is)."""
        until = time.monotonic() + timeout
        while time.monotonic() < until:
            with open(f"/proc/{self.process.pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] == "T":
                    return
            time.sleep(0.005)  # polling a kernel state with a bound: no event to wait on
        raise TimeoutError(f"pid {self.process.pid} not stopped after {timeout} s")

    def close(self, timeout: float = 30.0) -> None:
        """Close the rank (or reap it if it died) and release the pipe; idempotent."""
        if self._conn.closed:
            return
        if self.process.is_alive():
            try:
                self.signal(signal.SIGCONT)
                self.call("close", timeout=timeout)
            except (OSError, EOFError, TimeoutError, ChildError):
                pass
        self.process.join(timeout)
        self.kill()
        self._conn.close()
        self.process.close()


class Cluster:
    """Owns the shared destination segment and every rank started through it."""

    def __init__(self, shape: Shape, kv_port: int) -> None:
        self.shape, self.kv_port = shape, kv_port
        self.shm = shared_memory.SharedMemory(create=True, size=shape.pool_bytes())
        self.main, self.local = decode_views(self.shm.buf, shape)
        self.ranks: list[Rank] = []

    def decode(self, rank: int = 0, **options: Any) -> Rank:
        return self._track(Rank(DecodeRank, self.shape, rank, self.kv_port, self.shm.name, **options))

    def prefill(self, rank: int = 0, tp: int = 1, **options: Any) -> Rank:
        endpoint = f"127.0.0.1:{self.kv_port}/{self.shape.decode_tp}"
        return self._track(Rank(PrefillRank, self.shape, rank, tp, endpoint, **options))

    def _track(self, rank: Rank) -> Rank:
        self.ranks.append(rank)
        return rank

    def all_arrays(self, rank: int | None = None) -> Iterator[np.ndarray]:
        """Every destination array (main, then each rank's indexer and scale)."""
        for layer in self.main:
            yield from layer
        for r, per_rank in enumerate(self.local):
            if rank is None or r == rank:
                for layer in per_rank:
                    yield from layer

    def arrived(self, req: Request, ranks: Sequence[int], *, main: bool = True) -> list[str]:
        """What differs from the source in ``req``'s destinations: main (when every rank read its
        share) and the indexer and scale of ``ranks``."""
        problems, positions, dst = [], np.arange(len(req.src)), list(req.dst)
        for layer in range(self.shape.layers):
            wanted = [pattern(layer, t, req.index, positions, w) for t, w in enumerate(SPECS)]
            if main:
                for t, arr in enumerate(self.main[layer]):
                    if not np.array_equal(arr[dst], wanted[t]):
                        problems.append(f"{req.ext_id} layer {layer} main {t}")
            for r in ranks:
                for t, arr in enumerate(self.local[r][layer]):
                    if not np.array_equal(arr[dst], wanted[len(MAIN) + t]):
                        problems.append(f"{req.ext_id} layer {layer} rank {r} tensor {len(MAIN) + t}")
        return problems

    def written_outside(self, allowed: Sequence[int]) -> int:
        """Non-zero blocks outside ``allowed`` destination ids, over every array."""
        mask = np.ones(self.shape.dst_blocks, bool)
        mask[list(allowed)] = False
        return int(sum(np.count_nonzero(arr[mask].any(axis=1)) for arr in self.all_arrays()))

    def zero(self) -> None:
        for arr in self.all_arrays():
            arr.fill(0)

    def close(self) -> None:
        for rank in self.ranks:
            rank.close(timeout=10.0)
        self.main = self.local = []  # views into the segment must go before it closes
        try:
            self.shm.close()
        except BufferError:  # a test still holds a view: the mapping goes with the process
            pass
        self.shm.unlink()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def poll(condition: Callable[[], bool], timeout: float, what: str) -> float:
    """Poll ``condition`` (a child's state: nothing to wait on here) until it holds; seconds taken."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout:
            raise TimeoutError(f"{what}: not within {timeout} s")
        time.sleep(0.01)
    return time.monotonic() - started
