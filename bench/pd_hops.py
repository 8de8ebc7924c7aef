"""One P/D request's time to first token, hop by hop, from the marks ``bench/vllm_pd.py`` collects
(pure: no engines, no files, no clock).

Every mark is a ``time.monotonic()`` reading (CLOCK_MONOTONIC, one clock for every process on the
host): the client's (sent, first token), the proxy's (its request record: ``t_origin`` plus ``t``,
ms from it) and the engines' (``bench/pd_trace.py``'s events). A hop is the time between two
consecutive boundaries, so the hops of a request add up to its TTFT exactly; a boundary an engine
did not record (an older trace) leaves its two hops merged into the later one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = ["HOPS", "SINGLE_HOPS", "pd_boundaries", "single_boundaries", "hops", "layer_transfers"]

# (row key, label): the hop that ends at each boundary after the client's send, in order
HOPS = (
    ("proxy_in_ms", "proxy: the client's request in, Decode's leg out"),
    ("decode_api_ms", "Decode: HTTP, tokenize, to its scheduler"),
    ("decode_sched_ms", "Decode: schedule, workers expect, rendezvous posted"),
    ("rendezvous_ms", "rendezvous: Decode's post to the proxy"),
    ("proxy_mid_ms", "proxy: rendezvous in, Prefill's leg out"),
    ("prefill_queue_ms", "Prefill: HTTP, tokenize, queue to its first step"),
    ("prefill_compute_ms", "Prefill: compute until the last layer is announced"),
    ("last_layer_ms", "transfer: the last layer, announced to read"),
    ("recv_report_ms", "Decode: read done to finished-receiving"),
    ("decode_wait_ms", "Decode: to the step that computes the last token"),
    ("decode_step_ms", "Decode: that step (compute, sample)"),
    ("decode_out_ms", "Decode: output, detokenize, to the proxy"),
    ("response_ms", "response: proxy to the client"),
)
SINGLE_HOPS = (
    ("s_api_ms", "HTTP, tokenize, to the scheduler"),
    ("s_queue_ms", "queue to its first step"),
    ("s_compute_ms", "the prompt's step: compute and sample the first token"),
    ("s_response_ms", "output, detokenize, response to the client"),
)


def _vllm_id(tag: str) -> str:
    """What names a request of X-Request-Id ``tag`` in vLLM's ids (``cmpl-<tag>-0-<8 hex>``),
    and no request whose tag merely contains ``tag``."""
    return f"cmpl-{tag}-"


def _first(events: Iterable[Mapping[str, Any]], ev: str, match: str) -> float | None:
    times = [e["t"] for e in events if e.get("ev") == ev and match in str(e.get("id") or e.get("ext") or "")]
    return min(times) if times else None


def _last(events: Iterable[Mapping[str, Any]], ev: str, match: str | None, lo: float, hi: float) -> float | None:
    times = [
        e["t"] for e in events
        if e.get("ev") == ev and lo <= e["t"] <= hi
        and (match is None or match in str(e.get("id") or "") or any(match in x for x in e.get("exts", ())))
    ]  # fmt: skip
    return max(times) if times else None


def pd_boundaries(
    sent: float, first: float, record: Mapping[str, Any], decode: Sequence[Mapping[str, Any]],
    prefill: Sequence[Mapping[str, Any]], tag: str,
) -> list[float | None]:
    """The boundaries of a P/D request (monotonic s), the client's send first and its first
    token last: one per hop of :data:`HOPS` after the first. ``record``: the proxy's;
    ``decode``/``prefill``: each engine's events; ``tag``: the X-Request-Id the client sent
    (it names the request in both engines)."""
    origin, t = record.get("t_origin"), record.get("t", {})  # an older proxy has neither

    def proxy(name: str) -> float | None:
        return float(origin) + t[name] / 1e3 if origin is not None and name in t else None

    rid, tag = str(record.get("id", "")), _vllm_id(tag)
    announce = _last(prefill, "announce", None, sent, first)
    return [
        sent,
        proxy("decode_sent"),
        _first(decode, "matched", tag),
        _first(decode, "posted", rid),
        proxy("rendezvous_0"),
        proxy("prefill_sent"),
        _first(prefill, "compute", tag),
        announce,
        _last(decode, "layer<", rid, sent, first),
        _first(decode, "recv_done", tag),
        _first(decode, "compute", tag),
        _first(decode, "step_end", tag),
        proxy("first_byte"),
        first,
    ]


def single_boundaries(sent: float, first: float, events: Sequence[Mapping[str, Any]], tag: str) -> list[float | None]:
    """The one-engine arm's boundaries (:data:`SINGLE_HOPS`), from the engine's events."""
    tag = _vllm_id(tag)
    return [sent, _first(events, "matched", tag), _first(events, "compute", tag), _first(events, "step_end", tag),
            first]


def hops(boundaries: Sequence[float | None], keys: Sequence[tuple[str, str]]) -> dict[str, float | None]:
    """Each hop's ms (``keys``' row keys, one per boundary after the first). A missing
    boundary gives its hop None and the next hop the whole span; a boundary out of order
    (clock readings of two threads around the same instant) is clamped to the previous."""
    out: dict[str, float | None] = {}
    last = boundaries[0]
    assert last is not None, "the client's send is always known"
    for (key, _), at in zip(keys, boundaries[1:]):
        if at is None:
            out[key] = None
            continue
        at = max(at, last)
        out[key] = round((at - last) * 1e3, 3)
        last = at
    return out


def layer_transfers(decode: Sequence[Mapping[str, Any]], prefill: Sequence[Mapping[str, Any]], lo: float,
                    hi: float) -> list[float]:
    """ms from each layer's announcement (Prefill) to the end of its read and reply (Decode),
    in announcement order, within ``[lo, hi]``: the layers of one request."""
    announced = sorted(e["t"] for e in prefill if e.get("ev") == "announce" and lo <= e["t"] <= hi)
    done = sorted(e["t"] for e in decode if e.get("ev") == "layer<" and lo <= e["t"] <= hi)
    return [round((d - a) * 1e3, 3) for a, d in zip(announced, done)]
