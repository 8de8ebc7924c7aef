"""Decode's rendezvous: post where a request's KV must go to the proxy's metaserver.

Posting happens on a thread owned by :class:`RendezvousPoster`, so a slow or absent proxy
never stalls vLLM's scheduler. A transport error is retried with exponential backoff; an
HTTP error response counts as delivered (the proxy heard us and said no: it logs why, and
the request fails on its deadline). ``cancel`` drops a rendezvous not yet posted (its
request was aborted); ``close`` drops all of them.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["RendezvousPoster"]

log = logging.getLogger("rd2h.vllm.rendezvous")

Post = Callable[[str, Mapping[str, Any]], int]  # (url, json) -> HTTP status; raises on transport errors


def _httpx_post(timeout: float) -> Post:
    import httpx

    client = httpx.Client(timeout=timeout)

    def post(url: str, body: Mapping[str, Any]) -> int:
        try:
            return client.post(url, json=dict(body)).status_code
        except httpx.TransportError as exc:
            raise ConnectionError(str(exc)) from exc

    return post


class RendezvousPoster:
    """Posts rendezvous in order on its own thread; start on construction, ``close`` joins."""

    def __init__(
        self, *, retries: int = 5, backoff: float = 0.2, timeout: float = 5.0, post: Post | None = None
    ) -> None:
        self._post = post or _httpx_post(timeout)
        self._retries, self._backoff = retries, backoff
        self._queue: deque[tuple[str, str, dict[str, Any]]] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self.delivered: list[str] = []  # ext ids, in order (for tests and stats)
        self._thread = threading.Thread(target=self._run, name="rd2h-rendezvous", daemon=True)
        self._thread.start()

    def submit(self, ext_id: str, url: str, body: Mapping[str, Any]) -> None:
        with self._cond:
            if not self._closed:
                self._queue.append((ext_id, url, dict(body)))
                self._cond.notify()

    def cancel(self, ext_id: str) -> None:
        with self._cond:
            self._queue = deque(item for item in self._queue if item[0] != ext_id)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._cond.notify()
        self._thread.join(10.0)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                ext_id, url, body = self._queue[0]
            self._deliver(ext_id, url, body)
            with self._cond:
                if self._queue and self._queue[0][0] == ext_id:
                    self._queue.popleft()

    def _deliver(self, ext_id: str, url: str, body: dict[str, Any]) -> None:
        delay = self._backoff
        for attempt in range(self._retries + 1):
            try:
                status = self._post(url, body)
            except ConnectionError as exc:
                log.warning("rendezvous of %s to %s failed (attempt %d): %s", ext_id, url, attempt + 1, exc)
                with self._cond:  # back off, but wake at once on close
                    if self._cond.wait_for(lambda: self._closed, delay):
                        return
                delay *= 2
                continue
            if status >= 400:
                log.error("metaserver %s answered %d to the rendezvous of %s", url, status, ext_id)
            self.delivered.append(ext_id)
            return
        log.error("rendezvous of %s to %s not delivered after %d attempts", ext_id, url, self._retries + 1)
