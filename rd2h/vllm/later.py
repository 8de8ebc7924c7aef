"""Prefill's targets, learnt after it started: asks to the proxy, on a thread of their own.

The proxy sends a request to Prefill and Decode at once; Prefill's signed fields name where its
targets come from (:class:`~rd2h.vllm.params.Later`). For each such request the scheduler side
asks that URL once (a body signed with the shared secret); the proxy answers when every Decode
rendezvous is in, with Prefill fields carrying the targets, signed by it. The asks run on one
event-loop thread owned by :class:`TargetAsker`, so that vLLM's scheduler never waits on the
network; each is bounded by the request's ``wait`` (the HTTP timeout too).
Results are taken by the scheduler each step; :meth:`TargetAsker.wait` lets an idle step wait
for the next one (woken by its arrival, not polled).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

__all__ = ["TargetAsker"]

log = logging.getLogger("rd2h.vllm.later")

# (url, json, timeout) -> (HTTP status, the answer's JSON or None); raises on transport errors
AsyncPost = Callable[[str, Mapping[str, Any], float], Awaitable[tuple[int, Any]]]
Result = tuple[str, Any, str]  # (req id, the answer's JSON, "" or why there is none)


class TargetAsker:
    """One ask per request id; ``take`` returns the answers (or errors) that came since the last
    call; ``cancel`` drops an ask (its request ended); ``close`` stops the thread."""

    def __init__(self, *, post: AsyncPost | None = None) -> None:
        self._post = post
        self._client: Any = None
        self._lock = threading.Lock()
        self._results: list[Result] = []
        self._asks: dict[str, concurrent.futures.Future[None]] = {}
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rd2h-targets", daemon=True)
        self._thread.start()

    def ask(self, req_id: str, url: str, body: Mapping[str, Any], wait: float) -> None:
        self._asks[req_id] = asyncio.run_coroutine_threadsafe(self._ask(req_id, url, dict(body), wait), self._loop)

    def cancel(self, req_id: str) -> None:
        future = self._asks.pop(req_id, None)
        if future is not None:
            future.cancel()

    def take(self) -> list[Result]:
        with self._lock:
            results, self._results = self._results, []
            self._ready.clear()
        for req_id, _, _ in results:
            self._asks.pop(req_id, None)
        return results

    def wait(self, timeout: float) -> bool:
        """Until a result is in (True) or ``timeout`` seconds passed."""
        return self._ready.wait(timeout)

    def __len__(self) -> int:
        return len(self._asks)

    async def _ask(self, req_id: str, url: str, body: dict[str, Any], wait: float) -> None:
        try:
            status, answer = await asyncio.wait_for(self._send(url, body, wait), wait)
            error = "" if status == 200 else f"the proxy answered {status}: {str(answer)[:300]}"
        except asyncio.CancelledError:
            return
        except asyncio.TimeoutError:
            answer, error = None, f"no targets within {wait:g} s"
        except Exception as exc:  # noqa: BLE001 - any failure is this request's, told to the scheduler
            answer, error = None, f"{type(exc).__name__}: {exc}"
        with self._lock:
            self._results.append((req_id, answer, error))
            self._ready.set()

    async def _send(self, url: str, body: dict[str, Any], timeout: float) -> tuple[int, Any]:
        if self._post is not None:
            return await self._post(url, body, timeout)
        if self._client is None:
            import httpx

            self._client = httpx.AsyncClient()
        response = await self._client.post(url, json=body, timeout=timeout)
        try:
            answer = response.json()
        except ValueError:
            answer = response.text
        return response.status_code, answer

    def close(self, timeout: float = 5.0) -> None:
        for future in list(self._asks.values()):
            future.cancel()
        self._asks.clear()

        async def stop() -> None:
            if self._client is not None:
                await self._client.aclose()
            self._loop.stop()

        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(stop()))
            self._thread.join(timeout)
