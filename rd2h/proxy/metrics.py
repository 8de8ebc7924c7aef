"""The proxy's Prometheus series (``GET /metrics`` on its internal listener).

One registry per proxy (not prometheus_client's global one), so that two proxies in one
process, as in the tests, count apart. Time to first token is split into its parts: the
wait for Decode's rendezvous, Prefill's answer, and Decode from then to its first byte.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from rd2h.proxy.instances import Pool

__all__ = ["CONTENT_TYPE", "ProxyMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _Instances(Collector):
    """Per-instance gauges read at scrape time from the pools (nothing to keep in step)."""

    def __init__(self, pools: Callable[[], Iterable[Pool]]) -> None:
        self._pools = pools

    def collect(self) -> Iterable[GaugeMetricFamily]:
        outstanding = GaugeMetricFamily("rd2h_proxy_outstanding_requests", "Requests sent to an engine and not yet "
                                        "answered in full", labels=["role", "instance"])
        up = GaugeMetricFamily("rd2h_proxy_instance_up", "1 while an engine's last health check answered",
                               labels=["role", "instance"])
        warm = GaugeMetricFamily("rd2h_proxy_instance_warm", "1 while an engine is warm (a warm-up went through "
                                 "it since it came up): with up, in rotation", labels=["role", "instance"])
        for pool in self._pools():
            for i in pool.instances:
                outstanding.add_metric([i.role, i.url], i.outstanding)
                up.add_metric([i.role, i.url], 1.0 if i.up else 0.0)
                warm.add_metric([i.role, i.url], 1.0 if i.warm else 0.0)
        yield outstanding
        yield up
        yield warm


class ProxyMetrics:
    def __init__(self, pools: Callable[[], Iterable[Pool]]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("rd2h_proxy_requests", "Client requests by route and HTTP status answered",
                                ["route", "status"], registry=self.registry)
        self.errors = Counter("rd2h_proxy_errors", "Failed or refused client requests by kind",
                              ["kind"], registry=self.registry)
        self.recomputed = Counter("rd2h_proxy_recomputed", "Requests whose Prefill failed, computed by a "
                                  "Decode (its kv_load_failure_policy is recompute)", registry=self.registry)
        self.prefill_skipped = Counter("rd2h_proxy_prefill_skipped", "Requests Decode loads nothing of (every "
                                       "prompt's rendezvous said so): no Prefill leg, or the one sent at once "
                                       "cancelled", registry=self.registry)
        self.ttft = Histogram("rd2h_proxy_ttft_seconds", "From the client's request to Decode's first byte",
                              buckets=_SECONDS, registry=self.registry)
        self.rendezvous = Histogram("rd2h_proxy_rendezvous_seconds", "Waiting for Decode's rendezvous (every "
                                    "prompt of the request)", buckets=_SECONDS, registry=self.registry)
        self.prefill = Histogram("rd2h_proxy_prefill_seconds", "Prefill's answer to the one-token leg",
                                 buckets=_SECONDS, registry=self.registry)
        self.decode = Histogram("rd2h_proxy_decode_first_byte_seconds", "From Prefill's answer to Decode's "
                                "first byte", buckets=_SECONDS, registry=self.registry)
        self.warmups = Counter("rd2h_proxy_warmups", "Warm-up requests through a Prefill/Decode pair, by result "
                               "(ok, failed)", ["result"], registry=self.registry)
        self.warmup_seconds = Histogram("rd2h_proxy_warmup_seconds", "A successful warm-up request, whole",
                                        buckets=_SECONDS, registry=self.registry)
        self.first_token = Counter("rd2h_proxy_first_token_requests", "Requests whose first token came from "
                                   "Prefill (--first-token-from-prefill), by outcome: continued (Decode generated "
                                   "the rest), ended_at_first (the first token ended it), failed",
                                   ["outcome"], registry=self.registry)
        self.first_token_fallbacks = Counter("rd2h_proxy_first_token_fallbacks", "Requests that took the normal flow "
                                             "under --first-token-from-prefill, by reason (chat, prompt_list, n, "
                                             "sampling, seed, logprobs, echo, stop, penalties, min_tokens, "
                                             "max_tokens, other_field; split_character: Prefill's token was part "
                                             "of a character, Decode generated every token)", ["reason"],
                                             registry=self.registry)
        self.first_token_seconds = Histogram("rd2h_proxy_first_token_seconds", "From the client's request to its "
                                             "first token sent, Prefill's (--first-token-from-prefill)",
                                             buckets=_SECONDS, registry=self.registry)
        self.ready = Gauge("rd2h_proxy_ready", "1 while /health answers 200: a warm Prefill and Decode in "
                           "rotation, not draining", registry=self.registry)
        self.registry.register(_Instances(pools))

    def scrape(self) -> bytes:
        return generate_latest(self.registry)
