"""Transfer statistics through vLLM's ``KVConnectorStats``: its log line and its ``/metrics``.

vLLM (0.32 here) asks every worker's connector for :class:`RD2HStats` after each step
(``get_kv_connector_stats``), sums them over the TP workers (``aggregate``), adds what the
scheduler's connector reports the same way, and sends the sum's ``data`` to the API process.
There :meth:`RD2HStats.reduce` makes the periodic "KV Transfer metrics" log line and
:class:`RD2HPromMetrics` (built by ``build_prom_metrics``) adds it to the ``vllm:rd2h_*``
series. ``data`` holds only numbers, lists and dicts: it crosses processes.

Where these come from: :class:`WorkerTally` (one per worker) takes deltas of the sink's
cumulative counters (and of host staging's copy counters, where the worker stages),
drains what the sink's loop thread observed (one entry per read batch or handshake, never
per block) and counts the outcomes the worker collects anyway;
:class:`SchedulerTally` takes deltas of the scheduler's ``stats``. Request counts are per TP
rank: each rank pulls (or sends) its share, so a request counts once on every rank.

On a vLLM without these classes this module still imports; nothing calls into it there.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rd2h.errors import wire_kind
from rd2h.outcome import Outcome, TerminalState

try:  # a vLLM with connector stats (0.32 has them)
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
    )
except ImportError:  # pragma: no cover - older vLLM, or none: the same shape, nothing registered

    @dataclass
    class KVConnectorStats:  # type: ignore[no-redef]
        data: dict[str, Any] = field(default_factory=dict)

    KVConnectorPromMetrics = None  # type: ignore[assignment,misc]

__all__ = ["LOCAL_REASONS", "RD2HPromMetrics", "RD2HStats", "SchedulerTally", "WorkerTally", "build_prom_metrics"]

# the scheduler's stats keys that count a request (or sample) computed here instead of pulled
LOCAL_REASONS = (
    "refused_params", "samples_computed_here", "no_handoff", "handoff_failed", "load_not_taken", "state_uncut",
    "nothing_to_pull", "scheduler_error",
)  # fmt: skip
_MAX_EVENTS = 1 << 14  # observations awaiting the next take (vLLM takes each step); past it the oldest go


def _empty() -> dict[str, Any]:
    return {
        "pulled_bytes": 0, "read_time": 0.0, "pulled": 0, "sent": 0,  # totals over the interval
        "staged_bytes": 0, "landed_bytes": 0,  # host staging's copies (rd2h.staging), totals too
        "read_batch_seconds": [], "handshake_seconds": [],  # one value per read batch / handshake
        "pull_failures": {}, "send_failures": {}, "local": {},  # counts by error class / reason
        "hook_errors": {},  # vLLM hook calls rd2h raised in (a bug, caught), by hook
    }  # fmt: skip


def _merge(into: dict[str, Any], other: Mapping[str, Any]) -> None:
    """Add ``other``'s values to ``into``'s (which owns its containers); unknown keys are
    ignored, so stats from another rd2h version aggregate what both know."""
    for key, value in other.items():
        mine = into.get(key)
        if isinstance(mine, list):
            mine.extend(value)
        elif isinstance(mine, dict):
            for name, count in value.items():
                mine[name] = mine.get(name, 0) + count
        elif mine is not None:
            into[key] = mine + value


@dataclass
class RD2HStats(KVConnectorStats):  # type: ignore[misc,valid-type]
    """One interval's transfer statistics (see the module docstring for the keys' sources)."""

    def __post_init__(self) -> None:
        # own containers: vLLM may hand the same payload to several loggers
        given, self.data = self.data, _empty()
        _merge(self.data, given or {})

    def reset(self) -> None:
        self.data = _empty()

    def aggregate(self, other: KVConnectorStats) -> RD2HStats:
        _merge(self.data, other.data)
        return self

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def reduce(self) -> dict[str, int | float]:
        """The log line's values; a side with nothing to say is left out."""
        d = self.data
        out: dict[str, int | float] = {}
        if d["pulled"] or d["pulled_bytes"] or d["read_batch_seconds"] or d["pull_failures"]:
            reads = d["read_batch_seconds"]
            out["Pulled requests"] = d["pulled"]
            out["Pulled GB"] = round(d["pulled_bytes"] / 1e9, 3)
            out["Read GB/s"] = round(d["pulled_bytes"] / 1e9 / d["read_time"], 3) if d["read_time"] else 0
            out["Read batches"] = len(reads)
            out["Avg read batch (ms)"] = round(1e3 * sum(reads) / len(reads), 3) if reads else 0
            out["P90 read batch (ms)"] = round(1e3 * _p90(reads), 3) if reads else 0
            out["Failed pulls"] = sum(d["pull_failures"].values())
        if d["sent"] or d["send_failures"]:
            out["Sent requests"] = d["sent"]
            out["Failed sends"] = sum(d["send_failures"].values())
        if d["handshake_seconds"]:
            out["Handshakes"] = len(d["handshake_seconds"])
            out["Max handshake (ms)"] = round(1e3 * max(d["handshake_seconds"]), 3)
        if d["local"]:
            out["Computed locally"] = sum(d["local"].values())
        if d["hook_errors"]:
            out["Hook errors"] = sum(d["hook_errors"].values())
        if d["staged_bytes"]:
            out["Staged GB"] = round(d["staged_bytes"] / 1e9, 3)
        if d["landed_bytes"]:
            out["Landed GB"] = round(d["landed_bytes"] / 1e9, 3)
        return out


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]  # nearest rank


def _kind(error: BaseException | None) -> str:
    # the class name within rd2h's error tree, else "RD2HError": a label set that stays small
    return wire_kind(error) if error is not None else "RD2HError"


class WorkerTally:
    """One worker's statistics since the last :meth:`take`.

    :meth:`on_layer` and :meth:`on_handshake` run on the sink's loop thread and only append
    to bounded deques (thread-safe); everything else runs on vLLM's worker thread.
    """

    def __init__(self) -> None:
        self._reads: deque[float] = deque(maxlen=_MAX_EVENTS)
        self._handshakes: deque[float] = deque(maxlen=_MAX_EVENTS)
        self._stats = RD2HStats()
        self._sink_seen = (0, 0.0)  # the sink's (bytes_read, read_seconds) at the last take
        self._staging: Callable[[], tuple[int, int]] | None = None
        self._staging_seen = (0, 0)

    def watch_staging(self, counters: Callable[[], tuple[int, int]]) -> None:
        """Report host staging's cumulative ``(staged_bytes, landed_bytes)`` from now on
        (``rd2h.staging.choice.WorkerStaging.counters``)."""
        self._staging = counters

    def watch(self, sink: Any) -> None:
        """Observe ``sink``'s read batches and handshakes from now on."""
        sink.on_layer = self.on_layer
        sink.on_handshake = self.on_handshake

    def on_layer(self, stat: Any) -> None:
        if stat.descriptors:  # a readiness answered without a read moved nothing
            self._reads.append(stat.read_seconds)

    def on_handshake(self, seconds: float) -> None:
        self._handshakes.append(seconds)

    def pulled(self, outcome: Outcome) -> None:
        """Decode: a request's pull ended on this rank (an abort is neither pulled nor failed)."""
        if outcome.ok:
            self._stats.data["pulled"] += 1
        elif outcome.state is TerminalState.FAILED:
            self.pull_failed(outcome.error)

    def pull_failed(self, error: BaseException | None) -> None:
        _count(self._stats.data["pull_failures"], _kind(error))

    def hook_error(self, hook: str) -> None:
        """A worker hook raised (caught by the connector's guard: the engine goes on)."""
        _count(self._stats.data["hook_errors"], hook)

    def local(self, reason: str) -> None:
        """A request this rank did not transfer (e.g. ``hold_expired``: nobody asked for it)."""
        _count(self._stats.data["local"], reason)

    def sent(self, outcome: Outcome) -> None:
        """Prefill: a request's send ended on this rank."""
        if outcome.ok:
            self._stats.data["sent"] += 1
        elif outcome.state is TerminalState.FAILED:
            _count(self._stats.data["send_failures"], _kind(outcome.error))

    def take(self, sink: Any = None) -> RD2HStats | None:
        """What happened since the last call (None: nothing), and start counting anew."""
        stats, self._stats = self._stats, RD2HStats()
        if sink is not None:  # the sink's counters only grow: their deltas are this interval's
            counters = sink.counters
            now = (counters.bytes_read, counters.read_seconds)
            stats.data["pulled_bytes"] = now[0] - self._sink_seen[0]
            stats.data["read_time"] = now[1] - self._sink_seen[1]
            self._sink_seen = now
        if self._staging is not None:
            now_staged = self._staging()
            stats.data["staged_bytes"] = now_staged[0] - self._staging_seen[0]
            stats.data["landed_bytes"] = now_staged[1] - self._staging_seen[1]
            self._staging_seen = now_staged
        stats.data["read_batch_seconds"] = _drain(self._reads)
        stats.data["handshake_seconds"] = _drain(self._handshakes)
        return None if stats.is_empty() else stats


def _count(counts: dict[str, int], name: str) -> None:
    counts[name] = counts.get(name, 0) + 1


def _drain(events: deque[float]) -> list[float]:
    """Pop what is there now (the loop thread may append meanwhile: that waits for the next)."""
    return [events.popleft() for _ in range(len(events))]


class SchedulerTally:
    """Deltas of the scheduler's cumulative ``stats`` that say a request was computed here,
    and the scheduler hooks that raised since the last :meth:`take`."""

    def __init__(self) -> None:
        self._seen: dict[str, int] = {}
        self._hook_errors: dict[str, int] = {}

    def hook_error(self, hook: str) -> None:
        """A scheduler hook raised (caught by the connector's guard: the engine goes on)."""
        _count(self._hook_errors, hook)

    def take(self, counts: Mapping[str, int]) -> RD2HStats | None:
        local = {}
        for reason in LOCAL_REASONS:
            grown = counts.get(reason, 0) - self._seen.get(reason, 0)
            if grown:
                local[reason] = grown
                self._seen[reason] = counts[reason]
        errors, self._hook_errors = self._hook_errors, {}
        return RD2HStats(data={"local": local, "hook_errors": errors}) if local or errors else None


# Prometheus series: (attribute, name, documentation). Counters get "_total" when exposed.
_COUNTERS = (
    ("pulled_bytes", "vllm:rd2h_pulled_bytes", "KV cache bytes Decode read from Prefill, summed over TP ranks."),
    (
        "read_time",
        "vllm:rd2h_read_seconds",
        "Seconds Decode spent in batched reads that succeeded; "
        "rate(pulled_bytes) / rate(read_seconds) is the read throughput.",
    ),
    ("pulled", "vllm:rd2h_pulled_requests", "Requests whose KV arrived whole, once per Decode TP rank."),
    ("sent", "vllm:rd2h_sent_requests", "Requests every Decode rank finished reading, once per Prefill TP rank."),
    (
        "staged_bytes",
        "vllm:rd2h_staged_bytes",
        "KV cache bytes Prefill copied device-to-host into its host staging mirror (RD2H_STAGING), "
        "summed over TP ranks.",
    ),
    (
        "landed_bytes",
        "vllm:rd2h_landed_bytes",
        "KV cache bytes Decode copied host-to-device from its staging landing buffer (RD2H_STAGING), "
        "summed over TP ranks.",
    ),
)
_BY_LABEL = (
    ("pull_failures", "kind", "vllm:rd2h_pull_failures", "Failed pulls per Decode TP rank, by rd2h error class."),
    ("send_failures", "kind", "vllm:rd2h_send_failures", "Failed sends per Prefill TP rank, by rd2h error class."),
    (
        "local",
        "reason",
        "vllm:rd2h_local_recomputes",
        "Requests (or samples) computed here instead of "
        "transferred: refused_params (unsigned, altered, stale or replayed rd2h fields), samples_computed_here "
        "(n > 1 on a Decode without prefix caching), no_handoff (vLLM's P/D convention asked of a Prefill without "
        "handoff_port), handoff_failed (Decode: a Prefill refused or did not answer the ask), hold_expired "
        "(Prefill, per TP rank: held blocks nobody asked for in time, freed), handoff_released (Prefill, per TP "
        "rank: held blocks freed at once, their Decode loading none of them), load_not_taken (Decode: vLLM "
        "gave the load to another connector listed before rd2h under MultiConnector, or dropped it), state_uncut "
        "(Prefill of a Mamba model: a prompt not computed short of its last token, e.g. one token, is not sent), "
        "nothing_to_pull (Decode: nothing of the prompt to load, a one-token prompt with several KV cache groups or "
        "every loadable token in its prefix cache; the proxy is told so and sends no Prefill leg for it, or under "
        "vLLM's P/D convention Prefill is told to free the held blocks), "
        "scheduler_error (rd2h's scheduler raised matching the request, a bug: served without rd2h; "
        "also in hook_errors).",
    ),
    (
        "hook_errors",
        "hook",
        "vllm:rd2h_hook_errors",
        "vLLM hook calls that raised inside rd2h (a bug, logged with its traceback) and were caught so that the "
        "engine goes on, by hook: on_new_request, get_num_new_matched_tokens, update_state_after_alloc, "
        "request_finished, build_connector_meta, update_connector_output (scheduler), bind_connector_metadata "
        "(per worker).",
    ),
)
_HISTOGRAMS = (
    (
        "read_batch_seconds",
        "vllm:rd2h_read_batch_seconds",
        "Seconds of one batched read: one layer of one readiness on one Decode TP rank.",
        (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
    ),
    (
        "handshake_seconds",
        "vllm:rd2h_handshake_seconds",
        "Seconds from a Prefill rank's introduction (mf_meta) to its admission or refusal on a Decode TP rank.",
        (1e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0),
    ),
)


class RD2HPromMetrics(KVConnectorPromMetrics or object):  # type: ignore[misc]
    """The ``vllm:rd2h_*`` series, labelled per engine as vLLM labels its own
    (``labelnames``, usually model_name and engine), plus ``kind`` or ``reason``."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            key: self._per_engine(self._counter_cls(name=name, documentation=doc, labelnames=labelnames))
            for key, name, doc in _COUNTERS
        }
        self._labelled = {  # children made as labels appear: the kinds are not known up front
            key: self._counter_cls(name=name, documentation=doc, labelnames=[*labelnames, label])
            for key, label, name, doc in _BY_LABEL
        }
        self._histograms = {
            key: self._per_engine(
                self._histogram_cls(name=name, documentation=doc, buckets=buckets, labelnames=labelnames)
            )
            for key, name, doc, buckets in _HISTOGRAMS
        }

    def _per_engine(self, metric: Any) -> dict[int, Any]:
        return {engine: metric.labels(*values) for engine, values in self.per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        data = RD2HStats(data=transfer_stats_data).data  # defaults for keys an older rd2h did not send
        for key, per_engine in self._counters.items():
            if data[key]:
                per_engine[engine_idx].inc(data[key])
        engine_labels = self.per_engine_labelvalues[engine_idx]
        for key, metric in self._labelled.items():
            for label, count in data[key].items():
                metric.labels(*engine_labels, label).inc(count)
        for key, per_engine in self._histograms.items():
            for value in data[key]:
                per_engine[engine_idx].observe(value)


def build_prom_metrics(
    vllm_config: Any,
    metric_types: dict[type, Any],
    labelnames: list[str],
    per_engine_labelvalues: dict[int, list[object]],
) -> RD2HPromMetrics | None:
    """The connector's ``build_prom_metrics`` (None on a vLLM without the mechanism)."""
    if KVConnectorPromMetrics is None:
        return None
    return RD2HPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
