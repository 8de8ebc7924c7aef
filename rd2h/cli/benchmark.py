"""Transfer engines against their limits, measured in one run, interleaved (``rd2h bench``).

A *case* is a layout (DeepSeek-V3.2-like ``sfa``: four tensors per layer, 61 layers; or
``dense``: one tensor per layer), a block size and a memory kind (``shared`` or ``thp``, see
``rd2h.cli.bench_source``). For a case, source processes hold every layer; this process
reads each layer into its own destination with one batched read of the layer's blocks in a
random order, as Decode does, by each *method*:

- ``memcpy Nt``: ``memmove`` of each layer's bytes out of a local pool of the same kind and
  size (the same bytes as the engines, not one cached layer), split over N threads: the limit;
- ``bare pvr Nt``: one ``process_vm_readv`` per thread with the layer's iovecs prebuilt (no
  rd2h code): the limit of the syscall the local engine is built on;
- ``NAME Nt`` / ``NAME``: ``read_batch`` through every engine asked for (local with 1 and 2
  threads; other engines with their own options).

Every read method is checked against the source pattern before it is timed. Then passes
run method after method in an order rotated every pass, so a noisy neighbour hits every
method alike; a figure is the median of the passes, and a ratio is the median of the
per-pass ratios (both methods timed in the same pass).
"""

from __future__ import annotations

import ctypes
import itertools
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from rd2h import plugins
from rd2h.cli.bench_source import SourceProcess, fill_pattern, pool
from rd2h.interfaces import Region

__all__ = ["Case", "CaseResult", "Layout", "Method", "available_engines", "make_layout", "measure_case"]

I64 = np.int64
SFA_LAYERS = 61  # DeepSeek-V3.2


@dataclass(frozen=True)
class Layout:
    """``layers`` layers of ``blocks`` blocks in each tensor; ``block_bytes`` per tensor."""

    name: str
    layers: int
    blocks: int
    block_bytes: tuple[int, ...]

    @property
    def layer_bytes(self) -> int:
        return self.blocks * sum(self.block_bytes)

    @property
    def total_bytes(self) -> int:
        return self.layers * self.layer_bytes

    @property
    def descriptors(self) -> int:
        """Descriptors in one layer's read."""
        return self.blocks * len(self.block_bytes)


def make_layout(kind: str, block_kib: int, layer_mib: float, layers: int = SFA_LAYERS) -> Layout:
    """``sfa``: main latent (``block_kib``), rope and indexer (1/8 each) and LIC8 scale (1/256),
    as DeepSeek-V3.2 on one rank (64 tokens a block gives 64 KiB, 8, 8 and 0.25 KiB);
    ``dense``: one tensor of ``block_kib`` blocks. Blocks per layer fill ``layer_mib``."""
    block = block_kib << 10
    if kind == "sfa":
        sizes: tuple[int, ...] = (block, block // 8, block // 8, block // 256)
    elif kind == "dense":
        sizes = (block,)
    else:
        raise ValueError(f"layout must be 'sfa' or 'dense', got {kind!r}")
    if min(sizes) < 8 or any(s % 8 for s in sizes):
        raise ValueError(f"block of {block_kib} KiB is too small for the {kind} layout")
    blocks = max(1, int(layer_mib * (1 << 20)) // sum(sizes))
    return Layout(kind, layers, blocks, sizes)


@dataclass(frozen=True)
class Case:
    layout: Layout
    memory: str  # a bench_source.MEMORY_KINDS entry: sources (and destinations unless dest_memory)
    dest_memory: str | None = None

    @property
    def label(self) -> str:
        into = f" into {self.dest_memory}" if self.dest_memory and self.dest_memory != self.memory else ""
        return f"{self.layout.name} {self.layout.block_bytes[0] >> 10} KiB {self.memory}{into}"


class Descriptors:
    """Per layer: destination and source offsets (from each pool's base) and lengths.

    Tensor ``t`` of layer ``i`` sits at the same offset in both pools; its blocks are read
    in a random order into consecutive destination blocks.
    """

    def __init__(self, layout: Layout, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.layout = layout
        self.lengths = np.concatenate([np.full(layout.blocks, b, I64) for b in layout.block_bytes])
        self.local: list[np.ndarray] = []
        self.remote: list[np.ndarray] = []
        for layer in range(layout.layers):
            base, locs, rems = layer * layout.layer_bytes, [], []
            for b in layout.block_bytes:
                ids = np.arange(layout.blocks, dtype=I64)
                locs.append(base + ids * b)
                rems.append(base + rng.permutation(ids) * b)
                base += layout.blocks * b
            self.local.append(np.concatenate(locs))
            self.remote.append(np.concatenate(rems))

    def check(self, dest: np.ndarray, layers: Sequence[int]) -> None:
        """Raise AssertionError unless ``dest`` holds what a read of ``layers`` from a
        patterned source (``bench_source.fill_pattern``) leaves there."""
        words = dest.view(np.uint64)
        n = self.layout.blocks
        for layer in layers:
            for t, b in enumerate(self.layout.block_bytes):
                loc = self.local[layer][t * n:(t + 1) * n] // 8
                rem = self.remote[layer][t * n:(t + 1) * n] // 8
                got = words[loc[0]:loc[0] + n * b // 8].reshape(n, b // 8)
                want = rem[:, None] + np.arange(b // 8, dtype=I64)
                if not np.array_equal(got, want.astype(np.uint64)):
                    raise AssertionError(f"layer {layer} tensor {t}: the destination does not match the source")


@dataclass
class Method:
    """One way to move a case's layers: ``run`` moves every layer once."""

    name: str
    run: Callable[[], None]
    close: Callable[[], None]
    kind: str  # "limit" or "engine"
    checked: bool = True  # whether the destination must then match the source


def _split(n: int, parts: int) -> list[slice]:
    edges = np.linspace(0, n, parts + 1).astype(int)
    return [slice(int(a), int(b)) for a, b in itertools.pairwise(edges)]


def _on_threads(threads: int, per_layer: Sequence[Sequence[Callable[[], None]]]) -> tuple[Callable[[], None], Callable[[], None]]:
    """``run`` calls each layer's parts, part 0 on this thread and the rest on a pool."""
    if threads == 1:
        def run_one() -> None:
            for parts in per_layer:
                parts[0]()
        return run_one, lambda: None
    pooled = ThreadPoolExecutor(threads - 1, thread_name_prefix="rd2h-bench")

    def run() -> None:
        for parts in per_layer:
            futures = [pooled.submit(p) for p in parts[1:]]
            parts[0]()
            for f in futures:
                f.result()

    return run, pooled.shutdown


def memcpy_method(layout: Layout, src: np.ndarray, dest: np.ndarray, threads: int) -> Method:
    s, d, step = src.ctypes.data, dest.ctypes.data, layout.layer_bytes
    per_layer = []
    for layer in range(layout.layers):
        parts = []
        for part in _split(step, threads):
            off, size = layer * step + part.start, part.stop - part.start
            parts.append(lambda off=off, size=size: ctypes.memmove(d + off, s + off, size) and None)
        per_layer.append(parts)
    run, close = _on_threads(threads, per_layer)
    return Method(f"memcpy {threads}t", run, close, "limit", checked=False)


def bare_pvr_method(desc: Descriptors, pid: int, src_addr: int, dest: np.ndarray, threads: int) -> Method:
    from rd2h_local import _sys

    _sys._load()
    readv = _sys.process_vm_readv
    per_layer = []
    for loc, rem in zip(desc.local, desc.remote):
        parts = []
        for part in _split(len(loc), threads):
            calls = []  # IOV_MAX iovecs a call, as any caller must
            for lo in range(part.start, part.stop, _sys.IOV_MAX):
                chunk = slice(lo, min(lo + _sys.IOV_MAX, part.stop))
                lv = np.stack([loc[chunk] + dest.ctypes.data, desc.lengths[chunk]], axis=1).astype(np.uint64)
                rv = np.stack([rem[chunk] + src_addr, desc.lengths[chunk]], axis=1).astype(np.uint64)
                calls.append((lv, rv, len(lv), int(desc.lengths[chunk].sum())))

            def one(calls: list[tuple[np.ndarray, np.ndarray, int, int]] = calls) -> None:
                for lv, rv, n, want in calls:
                    if readv(pid, lv.ctypes.data, n, rv.ctypes.data, n, 0) != want:
                        raise OSError(ctypes.get_errno(), "process_vm_readv read short")

            parts.append(one)
        per_layer.append(parts)
    run, close = _on_threads(threads, per_layer)
    return Method(f"bare pvr {threads}t", run, close, "limit")


def engine_method(
    label: str, name: str, options: Mapping[str, Any], desc: Descriptors, source: SourceProcess, dest: np.ndarray
) -> Method:
    engine = plugins.load_engine(name, "decode", **dict(options))
    try:
        engine.register([Region(dest.ctypes.data, dest.nbytes)])
        session = engine.connect(source.metadata)
    except BaseException:
        engine.close()
        raise
    local = [loc + dest.ctypes.data for loc in desc.local]
    remote = [rem + source.addr for rem in desc.remote]
    lengths = desc.lengths

    def run() -> None:
        for loc, rem in zip(local, remote):
            engine.read_batch(session, loc, rem, lengths)

    def close() -> None:
        session.close()
        engine.close()

    return Method(label, run, close, "engine")


def available_engines() -> list[str]:
    """Every installed transfer engine that says it can run here."""
    return [b.name for b in plugins.list_backends() if b.kind == "engine" and b.available]


@dataclass
class EngineSpec:
    """An engine to measure: ``threads`` expands local-style engines into one method per count."""

    name: str
    options: dict[str, Any] = field(default_factory=dict)  # both roles
    threads: tuple[int, ...] = ()
    prefill_options: dict[str, Any] = field(default_factory=dict)
    decode_options: dict[str, Any] = field(default_factory=dict)

    def methods(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """(label, decode options) of each method this engine gives."""
        base = {**self.options, **self.decode_options}
        if not self.threads:
            yield self.name, base
        for t in self.threads:
            yield f"{self.name} {t}t", {**base, "threads": t}


@dataclass
class CaseResult:
    case: dict[str, Any]
    samples: dict[str, list[float]]  # GB/s per pass, by method
    kinds: dict[str, str]
    skipped: dict[str, str] = field(default_factory=dict)  # method -> why it was not measured

    def median(self, method: str) -> float:
        return statistics.median(self.samples[method])

    def ratio(self, method: str, reference: str) -> float:
        """The median over passes of method / reference (timed in the same pass)."""
        return statistics.median(a / b for a, b in zip(self.samples[method], self.samples[reference]))

    def to_json(self) -> dict[str, Any]:
        return {**self.case, "samples": self.samples, "kinds": self.kinds, "skipped": self.skipped,
                "gbps": {m: self.median(m) for m in self.samples}}


Progress = Callable[[str], None]  # called once per timed pass of a method, with its name


def measure_case(
    case: Case,
    engines: Sequence[EngineSpec],
    *,
    threads: Sequence[int] = (1, 2),
    repeat: int = 5,
    seed: int = 0,
    progress: Progress | None = None,
) -> CaseResult:
    """Build every method for ``case``, check each, then time ``repeat`` interleaved passes.

    An engine that cannot be set up is skipped with its reason (``CaseResult.skipped``);
    a method that reads wrong bytes raises AssertionError.
    """
    layout = case.layout
    desc = Descriptors(layout, seed)
    everything = range(layout.layers) if layout.total_bytes <= 1 << 30 else (0, layout.layers - 1)
    methods: list[Method] = []
    skipped: dict[str, str] = {}
    with ExitStack() as stack:
        dest = pool(layout.total_bytes, case.dest_memory or case.memory)
        src = pool(layout.total_bytes, case.memory)
        fill_pattern(src)
        for t in threads:
            methods.append(memcpy_method(layout, src, dest, t))
            stack.callback(methods[-1].close)
        sources: dict[str, SourceProcess] = {}
        for spec in engines:
            try:
                if spec.name not in sources:
                    sources[spec.name] = stack.enter_context(SourceProcess(
                        spec.name, layout.total_bytes, case.memory, {**spec.options, **spec.prefill_options}))
                for label, options in spec.methods():
                    methods.append(engine_method(label, spec.name, options, desc, sources[spec.name], dest))
                    stack.callback(methods[-1].close)
            except Exception as exc:  # noqa: BLE001 - an engine that cannot run here is reported, not fatal
                skipped[spec.name] = f"{type(exc).__name__}: {exc}"
        local = sources.get("local")
        if local is not None:
            for t in threads:
                methods.append(bare_pvr_method(desc, local.pid, local.addr, dest, t))
                stack.callback(methods[-1].close)
        for m in methods:
            if m.checked:
                dest[:] = 0
                m.run()
                desc.check(dest, everything)
            else:
                m.run()  # warm up as the others were
        samples: dict[str, list[float]] = {m.name: [] for m in methods}
        for p in range(repeat):
            shift = p % len(methods)
            for m in methods[shift:] + methods[:shift]:
                started = time.perf_counter()
                m.run()
                samples[m.name].append(layout.total_bytes / (time.perf_counter() - started) / 1e9)
                if progress is not None:
                    progress(m.name)
    info = {"label": case.label, "memory": case.memory, "dest_memory": case.dest_memory or case.memory,
            **asdict(layout), "layer_bytes": layout.layer_bytes, "total_bytes": layout.total_bytes,
            "descriptors_per_layer": layout.descriptors}
    return CaseResult(info, samples, {m.name: m.kind for m in methods}, skipped)
