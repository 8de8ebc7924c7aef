"""Shared 4 KiB pages against private huge pages, interleaved in one run: what host_buffer's default buys.

    python bench/memory_kinds.py [--layout sfa --block-kib 64 --layer-mib 8 --layers 24 --repeat 5]

Sources and destinations of each kind (``rd2h.cli.bench_source``): ``shared`` (anonymous
MAP_SHARED, what ``host_buffer`` gave before), ``thp`` (private, MADV_HUGEPAGE, its default
now), and ``thp -> shared`` (huge-page Prefill pools read into a shared Decode pool, as the demo
does). For each: a bare ``process_vm_readv`` loop on 1 thread, the local engine on 1 and 2
threads, and memcpy on 2 threads; all methods interleaved pass by pass. The ratios
``thp / shared`` of each method come from the same passes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path

from rd2h.cli.bench_source import SourceProcess, fill_pattern, pool
from rd2h.cli.benchmark import (
    Descriptors,
    Method,
    bare_pvr_method,
    engine_method,
    make_layout,
    memcpy_method,
)

KINDS = (("shared", "shared"), ("thp", "thp"), ("thp", "shared"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layout", default="sfa")
    parser.add_argument("--block-kib", type=int, default=64)
    parser.add_argument("--layer-mib", type=float, default=8)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    layout = make_layout(args.layout, args.block_kib, args.layer_mib, args.layers)
    desc = Descriptors(layout)
    samples: dict[str, list[float]] = {}
    with ExitStack() as stack:
        methods: list[Method] = []
        held = []  # methods hold raw addresses: the pools must outlive them
        sources = {k: stack.enter_context(SourceProcess("local", layout.total_bytes, k)) for k in ("shared", "thp")}
        for src_kind, dst_kind in KINDS:
            label = src_kind if src_kind == dst_kind else f"{src_kind} -> {dst_kind}"
            dest = pool(layout.total_bytes, dst_kind)
            src = sources[src_kind]
            made = [bare_pvr_method(desc, src.pid, src.addr, dest, 1),
                    engine_method("local 1t", "local", {"threads": 1}, desc, src, dest),
                    engine_method("local 2t", "local", {"threads": 2}, desc, src, dest)]
            local_src = pool(layout.total_bytes, src_kind)
            fill_pattern(local_src)
            held += [dest, local_src]
            made.append(memcpy_method(layout, local_src, dest, 2))
            for m in made:
                stack.callback(m.close)
                m.name = f"{m.name} [{label}]"
                if m.checked:
                    dest[:] = 0
                    m.run()
                    desc.check(dest, (0, layout.layers - 1))
            methods += made
        samples = {m.name: [] for m in methods}
        for p in range(args.repeat):
            shift = p % len(methods)
            for m in methods[shift:] + methods[:shift]:
                started = time.perf_counter()
                m.run()
                samples[m.name].append(layout.total_bytes / (time.perf_counter() - started) / 1e9)
    print(f"{layout.name} {args.block_kib} KiB: {layout.layers} layers x {layout.descriptors} descriptors, "
          f"{layout.layer_bytes / 2**20:.1f} MiB a layer, median of {args.repeat} interleaved passes")
    for name, values in samples.items():
        print(f"  {name:<32}{statistics.median(values):>7.2f} GB/s")
    ratios = {}
    for base in ("bare pvr 1t", "local 1t", "local 2t", "memcpy 2t"):
        for label in ("thp", "thp -> shared"):
            a, b = samples[f"{base} [{label}]"], samples[f"{base} [shared]"]
            ratios[f"{base}: {label} / shared"] = statistics.median(x / y for x, y in zip(a, b))
    for name, value in ratios.items():
        print(f"  {name:<40}{value:>6.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"layout": layout.name, "block_kib": args.block_kib,
                                               "samples": samples, "ratios": ratios}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
