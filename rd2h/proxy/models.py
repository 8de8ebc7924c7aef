"""The models the Decode engines serve, as their ``GET /v1/models`` lists them: the proxy's own
``/v1/models`` (a Decode's answer, passed on) and each model's ``max_model_len``, learned once
per Decode instance and process (its ``epoch``), and asked again in the background once older
than ``MAX_AGE`` (a Decode restarted with another length between two health checks keeps its
epoch: its new length is known within ``MAX_AGE``).

The first-token mode needs the length: Prefill's leg asks for one token, so Prefill takes a
request whose prompt fits but whose prompt plus ``max_tokens`` does not; only Decode refuses it,
after the client had its first token. With the length known, the proxy refuses it as one engine
does, before that token (:func:`refusal`), when no Decode up can take it; one that cannot is not
sent it. Where a Decode's length is not known (its list failed, or names no ``max_model_len``), it
may take any request, and its refusal follows the first token, as before.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import httpx
from fastapi import Request
from fastapi.responses import Response

from rd2h.proxy.failures import cancel, error_answer
from rd2h.proxy.first_token import read_json
from rd2h.proxy.instances import Instance, Pool

if TYPE_CHECKING:
    from rd2h.proxy.app import Proxy

__all__ = ["FORWARDED_HEADERS", "MAX_AGE", "ModelLengths", "forwarded", "lengths_of", "models_answer", "refusal",
           "too_long"]

log = logging.getLogger("rd2h.proxy")

FORWARDED_HEADERS = ("authorization", "x-request-id")
MAX_AGE = 60.0  # seconds a learned length is used before it is asked again (behind the requests, never before one)


def forwarded(request: Request) -> dict[str, str]:
    """The client's headers an engine hears too (its key, its request id)."""
    return {k: v for k in FORWARDED_HEADERS if (v := request.headers.get(k))}


def lengths_of(listing: Any) -> dict[str, int]:
    """``{model id: max_model_len}`` of a ``/v1/models`` answer (what is not shaped so is left out)."""
    data = listing.get("data") if isinstance(listing, dict) else None
    if not isinstance(data, list):
        return {}
    return {card["id"]: card["max_model_len"] for card in data
            if isinstance(card, dict) and isinstance(card.get("id"), str)
            and isinstance(card.get("max_model_len"), int) and not isinstance(card["max_model_len"], bool)
            and card["max_model_len"] > 0}  # fmt: skip


class _Known(NamedTuple):
    epoch: int  # the Decode process that said it
    lengths: dict[str, int]  # {model: max_model_len}
    when: float  # the clock's time it was said


class ModelLengths:
    """``max_model_len`` per Decode instance, learned from its ``/v1/models`` once per epoch (a
    restarted engine may serve another length) and asked again, in the background, once older than
    ``max_age`` (a restart the health checks did not see). A failed listing is not asked again in
    that epoch, except one refused for the client's key (401, 403: the listing goes with the
    client's headers); a failed refresh keeps what the process said until ``max_age`` more."""

    def __init__(self, max_age: float = MAX_AGE, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_age, self._clock = max_age, clock
        self._known: dict[str, _Known] = {}  # url -> what its listing said, in which epoch, when
        self._asking: dict[str, asyncio.Task[None]] = {}  # one listing in flight per instance

    def note(self, instance: Instance, listing: Any) -> None:
        self._known[instance.url] = _Known(instance.epoch, lengths_of(listing), self._clock())

    def _in_epoch(self, url: str, epoch: int) -> _Known | None:
        """What ``url``'s listing said in ``epoch`` (an earlier process's lengths are not its own)."""
        known = self._known.get(url)
        return known if known is not None and known.epoch == epoch else None

    def learn(self, client: httpx.AsyncClient, pool: Pool, timeout: float,
              headers: dict[str, str]) -> asyncio.Future[Any] | None:
        """The listings still to learn (up instances not known in their epoch), asked concurrently
        (with the client's ``headers``: an engine may want its API key); None when there is none.
        Each is shared by every request that waits for it. A length known but older than
        ``max_age`` is asked again too, but nobody waits for it: the known one serves meanwhile."""
        tasks = []
        for instance in pool.instances:
            known = self._in_epoch(instance.url, instance.epoch)
            if not instance.up or (known is not None and self._clock() - known.when < self.max_age):
                continue
            task = self._asking.get(instance.url)
            if task is None or task.done():
                task = self._asking[instance.url] = asyncio.create_task(
                    self._ask(client, instance, timeout, headers))
            if known is None:
                tasks.append(task)
        return asyncio.gather(*tasks) if tasks else None

    async def _ask(self, client: httpx.AsyncClient, instance: Instance, timeout: float,
                   headers: dict[str, str]) -> None:
        epoch = instance.epoch
        try:
            answer = await client.get(instance.url + "/v1/models", timeout=timeout, headers=headers)
            if answer.status_code in (401, 403):  # this client's key, not Decode's length: the next client asks
                log.info("decode %s: /v1/models refused the client's key (%d)", instance.url, answer.status_code)
                return
            listing = read_json(answer.content, "its listing") if answer.status_code == 200 else None
        except (httpx.HTTPError, ValueError) as exc:  # ValueError: also a listing too deep for json to read
            log.info("decode %s: /v1/models: %s: its max_model_len stays unknown", instance.url, exc)
            listing = None
        if instance.epoch != epoch:
            return
        known = self._in_epoch(instance.url, epoch)
        if listing is None and known is not None:  # a refresh failed: what it said stands
            lengths = known.lengths
        else:
            lengths = lengths_of(listing)
        self._known[instance.url] = _Known(epoch, lengths, self._clock())

    def lengths(self, pool: Pool, model: Any) -> dict[str, int | None]:
        """Each up Decode instance's ``max_model_len`` for ``model`` (a request without a model: the
        first one it lists, as vLLM serves it); None where it is not known."""
        found: dict[str, int | None] = {}
        for instance in pool.instances:
            if not instance.up:
                continue
            known = self._in_epoch(instance.url, instance.epoch)
            lengths = known.lengths if known is not None else {}
            found[instance.url] = (lengths.get(model) if isinstance(model, str)
                                   else next(iter(lengths.values()), None))  # fmt: skip
        return found

    async def stop(self) -> None:
        """The listings in flight end (the proxy stops)."""
        for task in list(self._asking.values()):
            await cancel(task)
        self._asking.clear()


def refusal(prompt_tokens: int, max_tokens: int, lengths: dict[str, int | None]) -> tuple[str | None, frozenset[str]]:
    """``(vLLM's refusal, the instances known too short)`` of a request, given each up Decode's length
    (:meth:`ModelLengths.lengths`): refused (with the largest length) only when every one is known too
    short; otherwise the request may go on, but not to those (Decode's instance is picked later, among
    the others: the length checked is that of any instance it may go to)."""
    short = frozenset(url for url, length in lengths.items()
                      if length is not None and prompt_tokens + max_tokens > length)  # fmt: skip
    if not lengths or len(short) < len(lengths):
        return None, short
    return too_long(prompt_tokens, max_tokens, max(n for n in lengths.values() if n is not None)), short


def too_long(prompt_tokens: int, max_tokens: int, limit: int | None) -> str | None:
    """vLLM's refusal of a request longer than the model's context, or None when it fits (or the
    length is not known)."""
    if limit is None or prompt_tokens + max_tokens <= limit:
        return None
    return (f"'max_tokens' is too large: {max_tokens}. This model's maximum context length is {limit} tokens "
            f"and your request has {prompt_tokens} input tokens ({max_tokens} > {limit} - {prompt_tokens}).")


async def models_answer(proxy: Proxy, request: Request) -> Response:
    """A Decode's model list (both kinds serve the same model); its lengths are noted on the way."""
    assert proxy.client is not None
    headers = forwarded(request)
    instance = proxy.decode_pool.pick()
    if instance is None:
        return error_answer("no decode instance is up", 503)
    try:
        answer = await proxy.client.get(instance.url + "/v1/models", headers=headers, timeout=httpx.Timeout(
            30.0, connect=proxy.config.connect_timeout))
    except httpx.HTTPError as exc:  # unreachable, or an answer httpx cannot decode (alive: it answered)
        if isinstance(exc, httpx.TransportError):
            proxy.decode_pool.mark_down(instance, f"{type(exc).__name__}: {exc}")
        return error_answer(f"{instance.url}: {type(exc).__name__}: {exc}", 502)
    if answer.status_code == 200:
        try:
            proxy.model_lengths.note(instance, read_json(answer.content, "its listing"))
        except ValueError:  # also a listing too deep for json to read (read_json)
            pass  # passed on as it is: the client reads what Decode said
    return Response(answer.content, answer.status_code, media_type=answer.headers.get("content-type"))
