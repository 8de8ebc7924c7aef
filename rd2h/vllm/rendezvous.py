"""Decode's rendezvous: post where a request's KV must go to the proxy's metaserver.

Posting happens on threads owned by :class:`RendezvousPoster`, so a slow or absent proxy never
stalls vLLM's scheduler. Each metaserver URL has its own queue and thread: an unreachable URL
retries for as long as its deadline allows, and that must not delay what goes to a URL that
answers. A rendezvous older than its deadline is worth nothing (its request waits on the proxy
with its own deadline), so it is dropped, logged and counted rather than retried into the void;
a retry never sleeps when no try can follow. An HTTP error answer counts as heard (``refused``):
the proxy logs why, and the request fails on its deadline. Memory is bounded however long
Decode runs: counters, a short list of recent ids, a bounded queue per URL and a bounded number
of URLs. ``cancel`` drops a rendezvous not yet posted (its request was aborted); ``close`` drops
all of them and wakes every thread at once, even one in a backoff pause.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RendezvousPoster"]

log = logging.getLogger("rd2h.vllm.rendezvous")

Post = Callable[[str, Mapping[str, Any]], int]  # (url, json) -> HTTP status; raises ConnectionError on transport errors
_TimedPost = Callable[[str, Mapping[str, Any], float], int]  # the same, told the seconds it may take


class _HttpxPost:
    """The default post: one pooled client for every URL, a timeout per request."""

    def __init__(self) -> None:
        import httpx

        self._httpx = httpx
        self._client = httpx.Client()

    def __call__(self, url: str, body: Mapping[str, Any], timeout: float) -> int:
        try:  # httpx bounds each phase; a dead peer stalls in one (connect or read), not all
            return self._client.post(url, json=dict(body), timeout=timeout).status_code
        except self._httpx.TransportError as exc:
            raise ConnectionError(str(exc)) from exc

    def close(self) -> None:
        self._client.close()


def _untimed(post: Post) -> _TimedPost:
    return lambda url, body, _timeout: post(url, body)


def _next_pause(attempt: int, retries: int, backoff: float, left: float) -> float | None:
    """The pause after failed try ``attempt`` (from 0), or None when no try follows: that was
    the last one, or the next could only start at or past the deadline (``left`` seconds away)."""
    if attempt >= retries:
        return None
    pause = backoff * 2**attempt
    return pause if pause < left else None


@dataclass
class _Item:
    ext_id: str
    url: str
    body: dict[str, Any]
    deadline: float  # on the poster's clock


@dataclass
class _Lane:
    """One URL's queue and the thread that empties it."""

    ready: threading.Condition
    queue: deque[_Item] = field(default_factory=deque)
    thread: threading.Thread | None = None


class RendezvousPoster:
    """Posts rendezvous, in order per URL, each URL on its own thread; ``close`` joins them.

    ``deadline``: seconds from ``submit`` within which a rendezvous must be posted, else it is
    dropped. ``max_urls`` and ``max_queued`` (per URL) bound memory: past them ``submit`` drops.
    ``post`` replaces HTTP (an injected one enforces its own timeout); ``clock`` and ``wait``
    (``wait(seconds)`` returns True when woken by ``close``) replace time, for tests.
    ``stats`` counts outcomes: ``delivered`` and ``refused`` (an HTTP error answer) were heard by
    the proxy; ``expired``, ``failed`` (retries spent), ``dropped`` (at submit) and ``cancelled``
    were not; ``queued`` is how many wait or are being posted now.
    """

    def __init__(
        self,
        *,
        retries: int = 5,
        backoff: float = 0.2,
        timeout: float = 5.0,
        post: Post | None = None,
        deadline: float = 30.0,
        max_urls: int = 8,
        max_queued: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
        wait: Callable[[float], bool] | None = None,
    ) -> None:
        self._default: _HttpxPost | None = None  # ours to close
        self._post: _TimedPost
        if post is None:
            self._default = self._post = _HttpxPost()
        else:
            self._post = _untimed(post)
        self._retries, self._backoff, self._timeout, self._deadline = retries, backoff, timeout, deadline
        self._max_urls, self._max_queued = max_urls, max_queued
        self._clock = clock
        self._stop = threading.Event()  # set by close: cuts every backoff pause short
        self._wait = wait or self._stop.wait
        self._lock = threading.Lock()  # guards lanes, stats, recent; every condition shares it
        self._settled = threading.Condition(self._lock)
        self._lanes: dict[str, _Lane] = {}
        self._closed = False
        self.stats = dict.fromkeys(("delivered", "refused", "expired", "failed", "dropped", "cancelled", "queued"), 0)
        self.recent: deque[str] = deque(maxlen=100)  # ext ids the proxy heard, latest last

    def submit(self, ext_id: str, url: str, body: Mapping[str, Any]) -> None:
        item = _Item(ext_id, url, dict(body), self._clock() + self._deadline)
        with self._lock:
            if self._closed:
                return
            why = self._enqueue(item)
            if why:
                self.stats["dropped"] += 1
        if why:
            log.error("rendezvous of %s to %s dropped: %s", ext_id, url, why)

    def cancel(self, ext_id: str) -> None:
        with self._lock:
            for lane in self._lanes.values():
                kept = deque(item for item in lane.queue if item.ext_id != ext_id)
                gone, lane.queue = len(lane.queue) - len(kept), kept
                self.stats["cancelled"] += gone
                self.stats["queued"] -= gone
            self._settled.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every rendezvous submitted so far was posted or dropped; False on timeout."""
        with self._settled:
            return self._settled.wait_for(lambda: self.stats["queued"] == 0, timeout)

    def close(self, timeout: float = 10.0) -> bool:
        """Drop what is not posted, stop every thread, join them within ``timeout`` seconds in
        all (a post in flight is not interrupted). True if every thread ended."""
        with self._lock:
            self._closed = True
            dropped = sum(len(lane.queue) for lane in self._lanes.values())
            for lane in self._lanes.values():
                lane.queue.clear()
                lane.ready.notify_all()
            self.stats["queued"] -= dropped
            self._settled.notify_all()
        self._stop.set()
        if dropped:
            log.info("closing: %d rendezvous not posted", dropped)
        end = time.monotonic() + timeout
        threads = [lane.thread for lane in self._lanes.values() if lane.thread is not None]
        for thread in threads:
            thread.join(max(0.0, end - time.monotonic()))
        ended = not any(thread.is_alive() for thread in threads)
        if ended and self._default is not None:  # a thread still posting keeps the client
            self._default.close()
        return ended

    def __enter__(self) -> RendezvousPoster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _enqueue(self, item: _Item) -> str:
        """Queue ``item`` on its URL's lane (opened on first use); the reason if it cannot be."""
        lane = self._lanes.get(item.url)
        if lane is None:
            if len(self._lanes) >= self._max_urls:
                return f"already posting to {self._max_urls} URLs"
            lane = self._lanes[item.url] = _Lane(threading.Condition(self._lock))
            name = f"rd2h-rendezvous-{len(self._lanes)}"
            lane.thread = threading.Thread(target=self._work, args=(lane,), name=name, daemon=True)
            lane.thread.start()  # it waits for our lock before reading its queue
        if len(lane.queue) >= self._max_queued:
            return f"{self._max_queued} already wait for that URL"
        lane.queue.append(item)
        self.stats["queued"] += 1
        lane.ready.notify()
        return ""

    def _work(self, lane: _Lane) -> None:
        while (item := self._take(lane)) is not None:
            try:
                outcome = self._deliver(item)
            except Exception:  # a bug in post must not leave this URL's queue unserved
                log.exception("rendezvous of %s to %s dropped", item.ext_id, item.url)
                outcome = "failed"
            self._settle(item, outcome)

    def _take(self, lane: _Lane) -> _Item | None:
        with self._lock:
            lane.ready.wait_for(lambda: lane.queue or self._closed)
            return None if self._closed else lane.queue.popleft()

    def _deliver(self, item: _Item) -> str:
        """Post with retries inside the deadline; the outcome (a ``stats`` key, or "closed")."""
        attempt, error = 0, "it waited in the queue"
        while (left := item.deadline - self._clock()) > 0:
            try:
                status = self._post(item.url, item.body, min(self._timeout, left))
            except ConnectionError as exc:
                error = str(exc) or type(exc).__name__
                log.debug("rendezvous of %s to %s, try %d: %s", item.ext_id, item.url, attempt + 1, error)
            else:
                if status >= 400:
                    log.error("metaserver %s answered %d to the rendezvous of %s", item.url, status, item.ext_id)
                return "refused" if status >= 400 else "delivered"
            pause = _next_pause(attempt, self._retries, self._backoff, item.deadline - self._clock())
            attempt += 1
            if pause is None:
                return self._give_up(item, "failed" if attempt > self._retries else "expired", attempt, error)
            if self._wait(pause):
                return "closed"
        return self._give_up(item, "expired", attempt, error)

    def _give_up(self, item: _Item, outcome: str, tries: int, error: str) -> str:
        log.error("rendezvous of %s to %s dropped (%s after %d tries): %s", item.ext_id, item.url, outcome, tries,
                  error)
        return outcome

    def _settle(self, item: _Item, outcome: str) -> None:
        with self._lock:
            if outcome != "closed":
                self.stats[outcome] += 1
            if outcome in ("delivered", "refused"):
                self.recent.append(item.ext_id)
            self.stats["queued"] -= 1
            self._settled.notify_all()
