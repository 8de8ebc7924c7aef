"""Run a disaggregated deployment on this machine: Prefill and Decode ranks as processes.

Everything that can be checked is checked before a process starts (topology, ports,
engine); a child that dies makes the run fail at once with its reason, and every other
child is stopped.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from multiprocessing import shared_memory
from typing import Any

import numpy as np

from rd2h import plugins
from rd2h.cli.demo import ranks
from rd2h.cli.demo.workload import MAIN_TENSORS, DemoConfig, Workload
from rd2h.errors import BackendUnavailableError, PortInUseError, RD2HError
from rd2h.layout.topology import decode_ports

__all__ = ["DemoFailed", "DemoResult", "preflight", "run_demo"]


class DemoFailed(RD2HError):
    """A child process died or the run timed out; the message says which and why."""


@dataclass
class DemoResult:
    verified: bool
    bytes: int
    seconds: float
    gbps: float
    prefill_tp: int
    decode_tp: int
    layers: int
    requests: int
    engine: str
    steps: int
    read_seconds: float  # the busiest Decode rank's time inside read_batch
    read_gbps: float
    layer_latency_p50_ms: float
    layer_latency_p99_ms: float
    exposed_ms: float
    problems: list[str] = field(default_factory=list)
    # Decode's time per readiness besides read_batch (plan, bookkeeping, reply), busiest rank
    layer_overhead_p50_ms: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def preflight(config: DemoConfig) -> None:
    """Fail before any process starts: unknown or unusable engine, a Decode port in use.

    (The topology and port range were checked when the config was built.)
    """
    cls = plugins.engine_class(config.engine)
    available = cls.availability()
    if not available.ok:
        raise BackendUnavailableError(f"engine {config.engine!r} cannot run here: {available.reason}")
    if config.decode_netns:  # the address lives in that namespace: the Decode rank reports a taken port
        return
    for rank, port in enumerate(decode_ports(config.kv_port, 0, config.decode_tp)):
        with socket.socket() as probe:
            # as libzmq does: connections of a finished run in TIME_WAIT must not count
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((config.host, port))
            except OSError as exc:
                raise PortInUseError(
                    f"Decode rank {rank} needs {config.host}:{port}, which is in use ({exc.strerror}); "
                    f"choose another --kv-port"
                ) from None


def run_demo(config: DemoConfig, progress: Callable[[int, int], None] | None = None) -> DemoResult:
    """Run the whole flow and verify every destination byte. Raises DemoFailed."""
    preflight(config)
    work = Workload.build(config)
    ctx = mp.get_context("spawn")
    events = ctx.Queue()
    go = ctx.Event()
    pool = shared_memory.SharedMemory(create=True, size=max(1, ranks.main_pool_bytes(config, work.dst_pool_blocks)))
    children: dict[tuple[str, int], Any] = {}
    try:
        for rank in range(config.decode_tp):
            children["decode", rank] = ctx.Process(
                target=ranks.decode_rank, args=(config, rank, pool.name, events, go), name=f"decode-{rank}"
            )
        for rank in range(config.prefill_tp):
            children["prefill", rank] = ctx.Process(
                target=ranks.prefill_rank, args=(config, rank, events, go), name=f"prefill-{rank}"
            )
        for child in children.values():
            child.start()
        results = _supervise(config, work, children, events, go, progress)
        main = ranks.main_pool_views(pool.buf, config, work.dst_pool_blocks)
        problems = ranks.verify(work, main, MAIN_TENSORS, 0)
        del main
        return _summarize(config, work, results, problems)
    finally:
        _stop_children(children.values())
        try:
            pool.close()
        except BufferError:  # a traceback still holds views into it; unlinking frees it anyway
            pass
        pool.unlink()


# A child stopped this long (SIGSTOP, a debugger) fails the run: it would only time out later,
# and the message would name whichever rank waited on it instead of the stopped one.
_STOPPED_GRACE_SECONDS = 5.0


def _stop_children(children: Any) -> None:
    """SIGTERM, then SIGKILL what is still there: a stopped child ignores SIGTERM until it is
    continued, and a child left alive would block the interpreter's exit."""
    children = [c for c in children if c.pid is not None]
    for child in children:
        if child.is_alive():
            child.terminate()
    for child in children:
        child.join(5)
        if child.is_alive():
            child.kill()
            child.join(5)


def _is_stopped(pid: int | None) -> bool:
    """Whether the process is stopped (state T or t in /proc), without blocking."""
    if pid is None:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return False
    return bool(fields) and fields[0] in (b"T", b"t")


def _supervise(
    config: DemoConfig,
    work: Workload,
    children: dict[tuple[str, int], Any],
    events: Any,
    go: Any,
    progress: Callable[[int, int], None] | None,
) -> dict[tuple[str, int], dict[str, Any]]:
    total_layers = len(work.steps()) * config.layers
    ready: set[tuple[str, int]] = set()
    results: dict[tuple[str, int], dict[str, Any]] = {}
    errors: dict[tuple[str, int], str] = {}
    done_layers = 0
    silent_since: dict[tuple[str, int], float] = {}
    stopped_since: dict[tuple[str, int], float] = {}
    deadline = time.monotonic() + config.timeout + 60.0  # start-up included
    while len(results) < len(children):
        try:
            kind, role, rank, payload = events.get(timeout=0.2)
        except queue.Empty:
            kind = None
        if kind == "ready":
            ready.add((role, rank))
            if len(ready) == len(children):
                go.set()
        elif kind == "progress":
            done_layers += payload
            if progress is not None:
                progress(done_layers, total_layers)
        elif kind == "result":
            results[role, rank] = payload
        elif kind == "error":
            errors[role, rank] = payload
        for key, child in children.items():
            if key not in results and child.exitcode is None and _is_stopped(child.pid):
                if time.monotonic() - stopped_since.setdefault(key, time.monotonic()) > _STOPPED_GRACE_SECONDS:
                    raise DemoFailed(
                        f"{key[0]} rank {key[1]} (pid {child.pid}) is stopped (SIGSTOP or a debugger) "
                        f"and has been for {_STOPPED_GRACE_SECONDS:.0f}s; the run cannot finish"
                    )
                continue
            stopped_since.pop(key, None)
            if key in results or child.exitcode is None:
                continue
            if child.exitcode != 0:
                raise DemoFailed(_death_message(key, child.exitcode, errors.get(key)))
            silent_since.setdefault(key, time.monotonic())
            if time.monotonic() - silent_since[key] > 5.0:  # its result should long have arrived
                raise DemoFailed(f"{key[0]} rank {key[1]} exited without reporting a result")
        if time.monotonic() > deadline:
            waiting = sorted(f"{r} rank {n}" for r, n in children.keys() - results.keys())
            raise DemoFailed(f"timed out after {config.timeout:.0f}s waiting for {', '.join(waiting)}")
    return results


def _death_message(key: tuple[str, int], exitcode: int, error: str | None) -> str:
    role, rank = key
    how = f"was killed by signal {-exitcode}" if exitcode < 0 else f"exited with status {exitcode}"
    message = f"{role} rank {rank} {how}"
    if error:
        last = error.strip().splitlines()[-1]
        message += f": {last}"
    return message


def _summarize(
    config: DemoConfig, work: Workload, results: dict[tuple[str, int], dict[str, Any]], problems: list[str]
) -> DemoResult:
    prefill = [v for (role, _), v in results.items() if role == "prefill"]
    decode = [v for (role, _), v in results.items() if role == "decode"]
    problems = list(problems)
    for (role, rank), value in sorted(results.items()):
        problems += [f"{role} rank {rank}: {p}" for p in value.get("mismatches", [])]
        problems += [f"{role} rank {rank}: {e} failed: {why}" for e, why in sorted(value["failed"].items())]
    moved = sum(v["bytes"] for v in decode)
    expected = work.main_bytes() + work.indexer_bytes()
    if moved != expected:
        problems.append(f"Decode read {moved} bytes, expected {expected}")
    started = min(v["started"] for v in prefill)
    seconds = max(v["finished"] for v in decode + prefill) - started
    read_seconds = max(sum(v["read_seconds"]) for v in decode)
    latencies = np.array([s for v in prefill for s in v["layer_seconds"]] or [0.0]) * 1e3
    return DemoResult(
        verified=not problems,
        bytes=moved,
        seconds=seconds,
        gbps=moved / seconds / 1e9 if seconds > 0 else 0.0,
        prefill_tp=config.prefill_tp,
        decode_tp=config.decode_tp,
        layers=config.layers,
        requests=config.requests,
        engine=config.engine,
        steps=len(work.steps()),
        read_seconds=read_seconds,
        read_gbps=moved / read_seconds / 1e9 if read_seconds > 0 else 0.0,
        layer_latency_p50_ms=float(np.percentile(latencies, 50)),
        layer_latency_p99_ms=float(np.percentile(latencies, 99)),
        exposed_ms=max(v["exposed_seconds"] for v in prefill) * 1e3,
        problems=problems,
        layer_overhead_p50_ms=max(_overhead_p50_ms(v) for v in decode),
    )


def _overhead_p50_ms(decode: dict[str, Any]) -> float:
    handle, read = np.array(decode.get("handle_seconds", [])), np.array(decode["read_seconds"])
    return float(np.median(handle - read)) * 1e3 if len(handle) == len(read) > 0 else 0.0
