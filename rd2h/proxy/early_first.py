"""``rd2h proxy --early-first-token``: the normal flow, the client's first token from Prefill's answer.

In the normal flow Decode loads the prompt's KV as Prefill computes it, layer by layer, then
computes the last prompt token itself and samples the first token; Prefill samples one too (its
leg has ``max_tokens=1``), and its answer often reaches the proxy before Decode's first chunk.
With this option both legs are asked with ``return_token_ids`` and, for a streamed request
that is token for token one engine's (:func:`rd2h.proxy.first_token.why_not`: greedy
``/v1/completions`` of one prompt...), the token in Prefill's answer goes to the client as soon
as it comes, if Decode's first chunk did not come first. Decode's stream follows
(:class:`~rd2h.proxy.continuation.Continuation`): its own first token is dropped once it is
Prefill's. Where it is not (:class:`~rd2h.proxy.continuation.Mismatch`: two engines, two
batch shapes), Decode's stream is closed and a Decode computes the rest as a plain request,
the prompt's token ids and Prefill's token its prompt (counted ``mismatch``, logged): the
client's tokens are still one engine's. Decode generates every token itself, so nothing about
the transfer, ``max_tokens`` or usage changes; only who delivers the first token.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from rd2h.proxy.bodies import error_event
from rd2h.proxy.continuation import Continuation, Mismatch
from rd2h.proxy.failures import EngineError
from rd2h.proxy.first_token import (
    First,
    StreamRewriter,
    decode_leg,
    first_chunks,
    first_of,
    read_json,
    splits_a_character,
    why_not,
)

if TYPE_CHECKING:
    from rd2h.proxy.app import Proxy
    from rd2h.proxy.pending import Pending

__all__ = ["EarlyFirst", "early_for"]

log = logging.getLogger("rd2h.proxy")


def early_for(proxy: Proxy, path: str, body: dict[str, Any]) -> EarlyFirst | None:
    """This request's early first token, or None where it takes the normal flow unchanged
    (not asked for; not streamed: nothing to send early; or not one engine's token for token:
    counted by reason in rd2h_proxy_first_token_fallbacks_total)."""
    if not proxy.config.early_first:
        return None
    reason = "not_streamed" if body.get("stream") is not True else why_not(path, body)
    if reason is not None:
        proxy.metrics.first_token_fallbacks.labels(reason).inc()
        return None
    return EarlyFirst(body)


class EarlyFirst:
    """One request's early first token: learnt from Prefill's answer (:meth:`learn`), sent by
    the relay while Decode's first chunk has not come (:meth:`take`)."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body
        self.known: asyncio.Future[First | None] = asyncio.get_running_loop().create_future()
        self.continuation = Continuation(body)
        self.sent = False  # take() ran: the first token went out, or will not

    def learn(self, data: bytes) -> None:
        """Prefill's answer to its leg; one that names no usable token sends nothing early."""
        if self.known.done():
            return
        try:
            first: First | None = first_of(read_json(data, "Prefill"))
        except ValueError as exc:
            log.warning("early first token: %s; Decode's stream goes whole", exc)
            first = None
        self.known.set_result(first)

    def waits(self) -> set[asyncio.Future[Any]]:
        """What the relay waits on besides Decode's first chunk and Prefill's task."""
        return set() if self.sent else {self.known}

    def due(self) -> bool:
        return not self.sent and self.known.done()

    def take(self, proxy: Proxy, pending: Pending) -> bytes:
        """The client's first event, Prefill's token (b"" where it is not to be sent)."""
        self.sent = True
        first = self.known.result()
        if first is None:
            return b""
        if splits_a_character(first):  # its text is not the client's: Decode's stream goes whole
            proxy.metrics.first_token_fallbacks.labels("split_character").inc()
            return b""
        self.continuation.follow(first)
        pending.record["first_token"] = "early"
        pending.mark("first_token_out")
        if not pending.warmup:
            proxy.metrics.first_token_seconds.observe(time.monotonic() - pending.started)
        return first_chunks(first, self.body, last=False)

    def finished(self, proxy: Proxy) -> None:
        """Decode's stream ended: count what Prefill's token did."""
        if self.continuation.first is not None and self.continuation.dropped:
            proxy.metrics.first_token.labels("early").inc()

    async def recomputed(self, proxy: Proxy, pending: Pending, path: str, why: Mismatch) -> AsyncIterator[bytes]:
        """Decode's first token was not Prefill's: a Decode computes the rest as a plain request
        (the prompt's ids and Prefill's token), relayed as the rest of the client's stream."""
        first = self.continuation.first
        assert first is not None
        proxy.metrics.first_token.labels("mismatch").inc()
        pending.record["first_token"] = f"mismatch: {why}"
        log.warning("request %s: %s; a Decode computes the rest after Prefill's token as a plain request",
                    pending.rid, why)
        rewriter = StreamRewriter(first)
        try:
            response = await proxy._send(proxy.decode_pool, path, decode_leg(self.body, first), stream=True,
                                         pending=pending)  # fmt: skip
        except EngineError as exc:
            yield error_event(f"Decode, computing the rest after a first-token mismatch: {exc}", 502)
            return
        try:
            if response.status_code >= 400:
                data = await response.aread()
                yield error_event(f"Decode answered {response.status_code}: {data[:300].decode(errors='replace')}",
                                  502)  # fmt: skip
                return
            async for raw in response.aiter_raw():
                if out := rewriter.feed(raw):
                    yield out
            if rest := rewriter.flush():
                yield rest
        except ValueError as exc:  # Decode sent what the rewriter cannot read
            yield error_event(f"Decode: {exc}", 502)
        finally:
            await response.aclose()
