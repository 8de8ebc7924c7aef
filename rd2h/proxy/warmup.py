"""Warm-up: one tiny P/D request through every Prefill/Decode pair before the proxy says ready.

A fresh pair pays once what no later request pays: Prefill's first connection to each Decode
rank (the control channel's connect, the ``mf_meta`` introduction and Decode's admission of
it), Decode's first rendezvous post (its poster's HTTP connection to this proxy), the proxy's
own first connections to each engine, and each engine's first forward of the shapes a P/D
request takes (on CPU with ``--enforce-eager`` and an explicit KV cache size vLLM skips its
own warm-up forward, and the first one pays oneDNN's kernel creation). The proxy pays it
itself: after each health check, every pair whose two instances are up and that has not been
warmed since they last came up gets one request (a short prompt with a fresh prefix so no
prefix cache answers it, two tokens), pinned to that pair; when both legs answered 200 the
two instances are warm and in rotation (:class:`~rd2h.proxy.instances.Pool`), and
``/health`` answers 200 once a Prefill and a Decode are. A failed warm-up is logged with
its reason, counted, and tried again after a backoff (doubled per failure, up to a minute).

:class:`PairTable` is the bookkeeping (pure: the caller passes the time); :func:`warm_up_pairs`
runs the requests through a :class:`~rd2h.proxy.app.Proxy`.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rd2h.proxy.abandon import stop_legs
from rd2h.proxy.failures import EngineError
from rd2h.proxy.instances import Instance
from rd2h.proxy.readiness import note_readiness

if TYPE_CHECKING:
    from rd2h.proxy.app import Proxy

__all__ = ["PairTable", "WarmupFailed", "warm_up_pair", "warm_up_pairs", "warmup_body"]

log = logging.getLogger("rd2h.proxy")

WARMUP_PATH = "/v1/completions"
# about 60 words: more than one KV block of most tokenizers at block size 16 or 32, so the
# warm-up pulls whole blocks and a partial one, as user requests do
_WORDS = ("the quick brown fox jumps over the lazy dog while a small model learns to prefill and "
          "decode key value caches across two engines ").split()
MAX_BACKOFF = 60.0


class WarmupFailed(Exception):
    """A warm-up request did not go through its pair; the message says where it stopped."""


def warmup_body(tag: str) -> dict[str, Any]:
    """The warm-up request: no ``model`` (each engine's default), greedy, two tokens, a prompt
    starting with ``tag`` so that no prefix cache holds it."""
    words = [_WORDS[i % len(_WORDS)] for i in range(60)]
    return {"prompt": f"rd2h warm-up {tag}: " + " ".join(words), "max_tokens": 2, "temperature": 0,
            "ignore_eos": True}


def _key(prefill: Instance, decode: Instance) -> tuple[str, int, str, int]:
    return (prefill.url, prefill.epoch, decode.url, decode.epoch)


@dataclass
class _Attempts:
    failures: int = 0
    retry_at: float = 0.0
    error: str = ""


class PairTable:
    """Which Prefill/Decode pairs are warm, for the processes that answer now: a pair is keyed
    by both URLs and both instances' ``epoch``, so an instance that went down (and may have
    come back as a new process) makes its pairs cold."""

    def __init__(self, retry_after: float) -> None:
        self.retry_after = max(retry_after, 0.1)  # first backoff after a failure, doubled each time
        self.warm: dict[tuple[str, int, str, int], float] = {}  # pair -> warm-up seconds
        self.attempts: dict[tuple[str, int, str, int], _Attempts] = {}
        self.ok = 0
        self.failed = 0

    def cold(self, prefills: Iterable[Instance], decodes: Iterable[Instance],
             now: float) -> list[tuple[Instance, Instance]]:
        """Pairs of up instances not warmed in their current epochs and not backing off."""
        decodes = list(decodes)
        return [(p, d) for p in prefills if p.up for d in decodes if d.up
                and _key(p, d) not in self.warm and self.attempts.get(_key(p, d), _Attempts()).retry_at <= now]

    def succeeded(self, prefill: Instance, decode: Instance, seconds: float) -> None:
        key = _key(prefill, decode)
        self.warm = {k: v for k, v in self.warm.items() if (k[0], k[2]) != (key[0], key[2])}  # older epochs
        self.warm[key] = seconds
        self.attempts.pop(key, None)
        self.ok += 1

    def failed_once(self, prefill: Instance, decode: Instance, error: str, now: float) -> float:
        """Record a failure; the seconds until the pair is tried again."""
        key = _key(prefill, decode)
        for old in [k for k in self.attempts if (k[0], k[2]) == (key[0], key[2]) and k != key]:
            del self.attempts[old]
        attempts = self.attempts.setdefault(key, _Attempts())
        attempts.failures += 1
        delay = min(self.retry_after * 2 ** (attempts.failures - 1), MAX_BACKOFF)
        attempts.retry_at, attempts.error = now + delay, error
        self.failed += 1
        return delay

    def describe(self, prefills: Iterable[Instance], decodes: Iterable[Instance]) -> list[dict[str, Any]]:
        """Every pair's state, for ``/health``."""
        decodes = list(decodes)
        pairs = []
        for p in prefills:
            for d in decodes:
                key = _key(p, d)
                entry: dict[str, Any] = {"prefill": p.url, "decode": d.url, "warm": key in self.warm}
                if key in self.warm:
                    entry["warmup_ms"] = round(self.warm[key] * 1e3, 1)
                elif key in self.attempts:
                    entry.update(failures=self.attempts[key].failures, error=self.attempts[key].error)
                pairs.append(entry)
        return pairs


async def warm_up_pairs(proxy: Proxy) -> None:
    """One warm-up round: every cold pair of up instances at once, each bounded by the proxy's
    ``warmup_timeout``. Never raises: a failure is the pair's, logged and counted."""
    table = proxy.warmth
    pairs = table.cold(proxy.prefill_pool.instances, proxy.decode_pool.instances, time.monotonic())
    if pairs:
        await asyncio.gather(*(_warm_one(proxy, p, d) for p, d in pairs))
        note_readiness(proxy)


async def _warm_one(proxy: Proxy, prefill: Instance, decode: Instance) -> None:
    started = time.monotonic()
    epochs = (prefill.epoch, decode.epoch)
    try:
        await asyncio.wait_for(warm_up_pair(proxy, prefill, decode, warmup_body(secrets.token_hex(4))),
                               proxy.config.warmup_timeout)
    except Exception as exc:  # a pair's failure, never the loop's
        error = str(exc) or type(exc).__name__
        if isinstance(exc, asyncio.TimeoutError):
            error = f"no answer within {proxy.config.warmup_timeout:g} s"
        delay = proxy.warmth.failed_once(prefill, decode, error, time.monotonic())
        proxy.metrics.warmups.labels("failed").inc()
        log.warning("warm-up %s -> %s failed (%d failed so far): %s; tried again in %.1f s",
                    prefill.url, decode.url, proxy.warmth.failed, error, delay)
        return
    seconds = time.monotonic() - started
    if (prefill.epoch, decode.epoch) != epochs:  # one of them went down meanwhile: that process is gone
        return
    proxy.warmth.succeeded(prefill, decode, seconds)
    proxy.metrics.warmups.labels("ok").inc()
    proxy.metrics.warmup_seconds.observe(seconds)
    log.info("warm-up %s -> %s: %.0f ms", prefill.url, decode.url, seconds * 1e3)
    proxy.prefill_pool.mark_warm(prefill)
    proxy.decode_pool.mark_warm(decode)


async def warm_up_pair(proxy: Proxy, prefill: Instance, decode: Instance, body: dict[str, Any]) -> None:
    """One P/D request through this pair only, as a client's goes: both legs must answer 200 and
    Decode must have posted its rendezvous (else it computed the prompt itself and nothing was
    transferred). Raises :class:`WarmupFailed` saying where it stopped."""
    headers = {"x-request-id": f"rd2h-warmup-{secrets.token_hex(4)}"}
    pending, prefill_leg, decode_leg = proxy.begin(WARMUP_PATH, body, (1, 1), headers,
                                                   pinned={"prefill": prefill, "decode": decode})
    status, error = 502, "cancelled"
    try:
        try:
            response = await proxy.first_answer(decode_leg, prefill_leg)
            data = await response.aread()
            await response.aclose()
            if response.status_code != 200:
                raise WarmupFailed(f"Decode answered {response.status_code}: {data[:300]!r}")
            if not all(f.done() for f in pending.futures):
                raise WarmupFailed("Decode answered without posting its rendezvous: it computed the prompt "
                                   "itself (its log says why; do the engines and the proxy share one secret?)")
            await prefill_leg  # Prefill's answer too: its way back is warm as well
        except EngineError as exc:
            raise WarmupFailed(f"{exc.kind}: {exc}") from exc
        status, error = 200, ""
    except WarmupFailed as exc:
        error = str(exc)
        raise
    finally:
        try:  # both legs cancelled at once: a cancellation of this task while awaiting them leaves none running
            await stop_legs(prefill_leg, decode_leg)
        finally:
            proxy.finish(pending, status, error, kind="warmup")
