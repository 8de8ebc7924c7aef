"""Device check: Prefill and Decode as two processes on one GPU, every byte verified.

    python bench/device_check.py [--engines local,nixl --layers 61 --requests 16 --tokens 8192 --json out.json]
    python bench/device_check.py --cpu-stand-in      # the same logic on host tensors (CI)

A DeepSeek-V3.2-like layout (``--block-tokens`` 64 per block): main K/V (656 bytes a token:
fp8 latent, its scales and the bf16 rope part), the indexer's keys (128 bytes a token, fp8)
and their scale (4 bytes a token), all in device memory on Prefill. Decode pulls main K/V into
a pinned host pool and indexer and scale into device memory (the ``sfa`` placement).

Engines (``--engines``): ``local`` moves host memory only, so both sides stage
(``rd2h.staging``: Prefill's host mirror, Decode's landing buffer); ``nixl`` runs where its
wheel imports and declares CUDA memory (VRAM registered directly: no staging), and says why
it is skipped otherwise. Per engine, in one run:

- ``copy``: the staging copy (gather by index + device-to-host into the mirror) of a step's
  blocks, layer by layer, against a bare device-to-host copy of the same bytes
  (``cudaMemcpyAsync`` into pinned memory), interleaved; GB/s and the ratio.
- ``pull``: a step with every layer written; GB/s from the first announcement to Decode
  holding every byte, and its ratio to the bare copy.
- ``exposed``: the same with simulated compute per layer (``torch.cuda._sleep``, one pull
  layer long): the time from the last layer's compute to Decode holding everything, and
  its ratio to one layer's transfer.

Every destination byte is checked against the pattern both sides derive from (layer,
tensor, Prefill block id, offset). Without CUDA it exits at once with "no CUDA device";
``--cpu-stand-in`` runs the same code with host tensors (``rd2h.device.HostStandIn``),
small by default. Exit status 0 only when everything verified. Sized for < 8 minutes on
one H200 (docs/performance.md says how to run it there with only torch, numpy, msgpack and
carried wheels).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path
from typing import Any

MAIN_BYTES, INDEXER_BYTES, SCALE_BYTES = 656, 128, 4  # per token
ROLES = (("main", MAIN_BYTES), ("indexer", INDEXER_BYTES), ("scale", SCALE_BYTES))


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-stand-in", action="store_true", help="host tensors play the device (CI)")
    p.add_argument("--engines", default="local,nixl")
    p.add_argument("--channel", default="zmq", help="zmq (pyzmq) or tcp (no extra wheel)")
    p.add_argument("--layers", type=int)
    p.add_argument("--requests", type=int)
    p.add_argument("--tokens", type=int, help="prompt tokens per request")
    p.add_argument("--block-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="pull rounds, and as many with compute")
    p.add_argument("--copies", type=int, default=5, help="interleaved copy passes")
    p.add_argument("--slots", type=int, default=2)
    p.add_argument("--kv-port", type=int, default=27600)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    small = (4, 3, 300) if args.cpu_stand_in else (61, 16, 8192)
    args.layers = args.layers or small[0]
    args.requests = args.requests or small[1]
    args.tokens = args.tokens or small[2]
    return args


def cuda_ready() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


class Plan:
    """Block ids: per round and request, Prefill's (device cache) and Decode's (destinations)."""

    def __init__(self, args: argparse.Namespace) -> None:
        import numpy as np

        per = -(-args.tokens // args.block_tokens)
        self.blocks_per_request, self.step_blocks = per, per * args.requests
        self.prefill_blocks = self.step_blocks * 2 + 7  # room for ids other than 0..n-1
        self.decode_blocks = self.step_blocks + 5
        rng = np.random.default_rng(2202)
        self.rounds = []
        for _ in range(2 * args.rounds):
            p = rng.permutation(self.prefill_blocks)[: self.step_blocks].reshape(args.requests, per)
            d = rng.permutation(self.decode_blocks)[: self.step_blocks].reshape(args.requests, per)
            self.rounds.append((p.tolist(), d.tolist()))


def pattern(torch: Any, ids: Any, row_bytes: int, layer: int, role: int) -> Any:
    """The bytes of blocks ``ids`` of one tensor: a hash of (layer, role, block, offset)."""
    off = torch.arange(row_bytes, dtype=torch.int64, device=ids.device)
    x = ids.to(torch.int64)[:, None] * 0x9E3779B1 + off[None, :] * 0x85EBCA77 + (layer * 7 + role) * 0xC2B2AE3D
    x = x & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & 0xFFFFFFFF
    x = x ^ (x >> 12)
    x = (x * 0x297A2D39) & 0xFFFFFFFF
    return ((x ^ (x >> 15)) & 0xFF).to(torch.uint8)


def tensors(torch: Any, blocks: int, bt: int, where: dict[str, Any], layers: int, fill: bool) -> dict[str, Any]:
    """Every layer's main, indexer and scale tensors; ``where`` maps role -> (device, pinned)."""
    from rd2h.api import LayerTensors

    out = {}
    for layer in range(layers):
        made = []
        for role, (name, per_token) in enumerate(ROLES):
            device, pinned = where[name]
            t = torch.zeros(blocks, bt, per_token, dtype=torch.uint8, device=device, pin_memory=pinned)
            if fill:
                for lo in range(0, blocks, 512):
                    ids = torch.arange(lo, min(lo + 512, blocks), device=device)
                    t[lo : lo + len(ids)] = pattern(torch, ids, bt * per_token, layer, role).view(len(ids), bt, per_token)
            made.append(t)
        out[f"model.layers.{layer}"] = LayerTensors(main=[made[0]], indexer=made[1], scale=made[2])
    return out


def setup(stand_in: bool) -> tuple[Any, Any, Any]:
    import torch

    from rd2h.device import HostStandIn, TorchDevice

    if stand_in:
        return torch, "cpu", HostStandIn()
    return torch, "cuda:0", TorchDevice(torch.cuda, torch.device("cuda:0"))


def sync(torch: Any, stand_in: bool) -> None:
    if not stand_in:
        torch.cuda.synchronize()


def decode_proc(args: argparse.Namespace, engine: str, conn: Any, results: Any) -> None:
    try:
        results.put(("decode", _decode(args, engine, conn)))
    except BaseException as exc:  # noqa: BLE001 - the parent reports it
        results.put(("decode", {"error": f"{type(exc).__name__}: {exc}"}))


def _decode(args: argparse.Namespace, engine: str, conn: Any) -> dict[str, Any]:
    from rd2h.api import DecodeLanding, KVSink

    torch, dev, adapter = setup(args.cpu_stand_in)
    plan = Plan(args)
    bt = args.block_tokens
    pinned = not args.cpu_stand_in
    dst = tensors(torch, plan.decode_blocks, bt, {"main": ("cpu", pinned), "indexer": (dev, False), "scale": (dev, False)},
                  args.layers, fill=False)  # fmt: skip
    landing = None
    if engine == "local":
        staged = [t for layer in dst.values() for t in (layer.indexer, layer.scale)]
        landing = DecodeLanding(staged, capacity_bytes=256 << 20, device=adapter)
    verified, times = True, []
    with KVSink(dst, kv_port=args.kv_port, engine=engine, channel=args.channel, landing=landing,
                main_split="replicated") as sink:  # fmt: skip
        conn.send(sink.endpoint)
        for r, (_, d_ids) in enumerate(plan.rounds):
            ids = [f"r{r}-{i}" for i in range(args.requests)]
            for ext_id, blocks in zip(ids, d_ids):
                sink.expect(ext_id, main_blocks=blocks)
            conn.send(("ready", r))
            assert conn.recv() == ("started", r)  # Prefill's own set-up (filling its cache) is not waited for
            out = sink.wait(ids, args.timeout)
            times.append(time.monotonic())
            verified &= all(o.ok for o in out.values()) and check(torch, dst, plan.rounds[r], bt)
            for t in dst.values():  # the next round must not pass on this one's bytes
                for x in (t.main[0], t.indexer, t.scale):
                    x.zero_()
    return {"done_at": times, "verified": verified}


def check(torch: Any, dst: dict[str, Any], ids: tuple[list[list[int]], list[list[int]]], bt: int) -> bool:
    p_ids, d_ids = (torch.tensor(sum(x, []), dtype=torch.int64) for x in ids)
    for layer, t in enumerate(dst.values()):
        for role, ((_, per_token), x) in enumerate(zip(ROLES, (t.main[0], t.indexer, t.scale))):
            want = pattern(torch, p_ids.to(x.device), bt * per_token, layer, role)
            if not torch.equal(x[d_ids.to(x.device)].reshape(len(d_ids), -1), want):
                return False
    return True


def prefill_proc(args: argparse.Namespace, engine: str, conn: Any, results: Any) -> None:
    try:
        results.put(("prefill", _prefill(args, engine, conn)))
    except BaseException as exc:  # noqa: BLE001
        results.put(("prefill", {"error": f"{type(exc).__name__}: {exc}"}))


def _prefill(args: argparse.Namespace, engine: str, conn: Any) -> dict[str, Any]:
    import numpy as np

    from rd2h.api import KVSource, PrefillMirror, StagedKVSource

    torch, dev, adapter = setup(args.cpu_stand_in)
    plan = Plan(args)
    bt = args.block_tokens
    src = tensors(torch, plan.prefill_blocks, bt, {r: (dev, False) for r, _ in ROLES}, args.layers, fill=True)
    sync(torch, args.cpu_stand_in)
    report: dict[str, Any] = {}
    options = {"block_size": bt, "engine": engine, "channel": args.channel, "reply_timeout": args.timeout}
    if engine == "local":
        mirror = PrefillMirror(src, blocks_per_slot=plan.step_blocks, slots=args.slots, device=adapter)
        source: Any = StagedKVSource(mirror=mirror, **options)
        report["mirror_bytes"] = mirror.nbytes
        report["copy"] = copy_pass(torch, args, mirror, np.array(sum(plan.rounds[0][0], []), np.int64))
    else:
        source = KVSource(src, **options)
    endpoint = conn.recv()
    compute_s = 0.0
    starts, ends, finished = [], [], []
    with source:
        for r, (p_ids, _) in enumerate(plan.rounds):
            with_compute = r >= args.rounds
            if with_compute and not compute_s:  # one pull layer long: compute and transfer balanced
                compute_s = statistics.median(f - s for f, s in zip(finished, starts)) / args.layers
            assert conn.recv() == ("ready", r)
            ids = [f"r{r}-{i}" for i in range(args.requests)]
            for ext_id, blocks in zip(ids, p_ids):
                source.add_request(ext_id, endpoint, main_block_ids=blocks, num_tokens=args.tokens)
            conn.send(("started", r))
            starts.append(time.monotonic())
            source.schedule(dict.fromkeys(ids, args.tokens))
            event = None
            for name in src:
                source.wait_for_layer_send(name)
                if with_compute:
                    event = simulate(torch, args.cpu_stand_in, compute_s)
                source.layer_ready(name, event)
            if event is not None:
                event.synchronize()
            ends.append(time.monotonic())  # the last layer computed (or announced)
            out = source.wait_finished(ids, args.timeout)
            finished.append(time.monotonic())  # every reply in: Prefill's view of the pull's end
            if not all(o.ok for o in out.values()):
                raise RuntimeError(f"round {r}: {[str(o.error) for o in out.values() if not o.ok][:2]}")
    report.update(starts=starts, compute_ends=ends, compute_s=compute_s)
    return report


def simulate(torch: Any, stand_in: bool, seconds: float) -> Any:
    """One layer's compute: a GPU kernel that spins ``seconds`` on the current stream (host
    stand-in: the calling thread sleeps); the event after it, or None when already done."""
    if stand_in:
        time.sleep(seconds)
        return None
    torch.cuda._sleep(int(seconds * _cycles_per_second(torch)))
    event = torch.cuda.Event(blocking=True)
    event.record()
    return event


_CYCLES: list[float] = []


def _cycles_per_second(torch: Any) -> float:
    if not _CYCLES:
        torch.cuda.synchronize()
        start = time.perf_counter()
        torch.cuda._sleep(50_000_000)
        torch.cuda.synchronize()
        _CYCLES.append(50_000_000 / (time.perf_counter() - start))
    return _CYCLES[0]


def copy_pass(torch: Any, args: argparse.Namespace, mirror: Any, ids: Any) -> dict[str, Any]:
    """The staging copy of a step's blocks, layer by layer, against a bare device-to-host copy
    of the same bytes; interleaved passes, medians."""
    names = list(mirror.layouts)
    per_layer = len(ids) * args.block_tokens * sum(b for _, b in ROLES)
    device = "cpu" if args.cpu_stand_in else "cuda:0"
    bare_src = torch.full((per_layer,), 7, dtype=torch.uint8, device=device)
    bare_dst = torch.zeros(per_layer, dtype=torch.uint8, pin_memory=not args.cpu_stand_in)
    staged, bare = [], []
    for _ in range(args.copies):
        sync(torch, args.cpu_stand_in)
        t0 = time.perf_counter()
        event = None
        for name in names:
            event = mirror.copy(name, ids, ids, None)
        if event is not None:
            event.synchronize()
        staged.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for _ in names:
            bare_dst.copy_(bare_src, non_blocking=True)
        sync(torch, args.cpu_stand_in)
        bare.append(time.perf_counter() - t0)
    total = per_layer * len(names)
    s, b = statistics.median(staged), statistics.median(bare)
    return {"bytes": total, "staging_gbps": total / s / 1e9, "bare_gbps": total / b / 1e9, "ratio": b / s}


def skip_reason(engine: str, stand_in: bool) -> str | None:
    from rd2h import plugins

    if engine == "local":
        return None
    if stand_in:
        return "the host stand-in checks staging only"
    try:
        cls = plugins.engine_class(engine)
    except Exception as exc:  # noqa: BLE001 - not installed, or cannot run here
        return f"{engine} not available: {exc}"
    kinds = getattr(cls, "memory_kinds", None)
    if kinds is None or "cuda" not in kinds().reads_from or "cuda" not in kinds().writes_to:
        return f"{engine} does not declare CUDA memory here"
    return None


def run_engine(args: argparse.Namespace, engine: str) -> dict[str, Any]:
    ctx = mp.get_context("spawn")  # CUDA in children needs spawn
    results = ctx.Queue()
    p_conn, d_conn = ctx.Pipe()
    procs = [ctx.Process(target=decode_proc, args=(args, engine, d_conn, results)),
             ctx.Process(target=prefill_proc, args=(args, engine, p_conn, results))]  # fmt: skip
    for proc in procs:
        proc.start()
    got: dict[str, Any] = {}
    try:
        while len(got) < 2:
            role, report = results.get(timeout=args.timeout * (2 * args.rounds + 2))
            got[role] = report
            if "error" in report:
                break
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    errors = {role: r["error"] for role, r in got.items() if "error" in r}
    if errors or len(got) < 2:
        return {"verified": False, "errors": errors or {"run": "a process did not report"}}
    return summarize(args, got["prefill"], got["decode"])


def summarize(args: argparse.Namespace, prefill: dict[str, Any], decode: dict[str, Any]) -> dict[str, Any]:
    plan = Plan(args)
    nbytes = plan.step_blocks * args.block_tokens * sum(b for _, b in ROLES) * args.layers
    done = decode["done_at"]
    pull = [d - s for d, s in zip(done[: args.rounds], prefill["starts"])]
    exposed = [d - e for d, e in zip(done[args.rounds :], prefill["compute_ends"][args.rounds :])]
    layer_s = statistics.median(pull) / args.layers
    out: dict[str, Any] = {"verified": decode["verified"], "bytes_per_step": nbytes, "pull_gbps": nbytes / statistics.median(pull) / 1e9,
                           "exposed_ms": statistics.median(exposed) * 1e3, "layer_transfer_ms": layer_s * 1e3,
                           "exposed_over_layer": statistics.median(exposed) / layer_s, "compute_ms_per_layer": prefill["compute_s"] * 1e3}  # fmt: skip
    if "copy" in prefill:
        out["copy"] = prefill["copy"]
        out["pull_over_bare"] = out["pull_gbps"] / prefill["copy"]["bare_gbps"]
        out["mirror_bytes"] = prefill["mirror_bytes"]
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if not args.cpu_stand_in and not cuda_ready():
        print("no CUDA device (bench/device_check.py --cpu-stand-in runs the same logic on host tensors)")
        return 2
    import torch

    machine = "host stand-in (no device)" if args.cpu_stand_in else torch.cuda.get_device_name(0)
    report: dict[str, Any] = {"machine": machine, "torch": torch.__version__, "args": {
        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "engines": {}}  # fmt: skip
    for i, engine in enumerate(e for e in args.engines.split(",") if e):
        reason = skip_reason(engine, args.cpu_stand_in)
        if reason is not None:
            report["engines"][engine] = {"skipped": reason}
        else:
            args.kv_port += 16 * i
            report["engines"][engine] = run_engine(args, engine)
        print(f"{engine}: {json.dumps(report['engines'][engine])}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    ran = [r for r in report["engines"].values() if "skipped" not in r]
    return 0 if ran and all(r.get("verified") for r in ran) else 1


if __name__ == "__main__":
    sys.exit(main())
