"""The models the Decode engines serve, as their ``GET /v1/models`` lists them: the proxy's own
``/v1/models`` (a Decode's answer, passed on) and each model's ``max_model_len``, learned once
per Decode instance and process (its ``epoch``) and kept.

The first-token mode needs the length: Prefill's leg asks for one token, so Prefill takes a
request whose prompt fits but whose prompt plus ``max_tokens`` does not; only Decode refuses it,
after the client had its first token. With the length known, the proxy refuses it as one engine
does, before that token (:func:`too_long`). Where no Decode's length is known (its list failed,
or names no ``max_model_len``), nothing is checked and Decode's refusal follows the first token,
as before.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

import httpx
from fastapi import Request
from fastapi.responses import Response

from rd2h.proxy.failures import error_answer
from rd2h.proxy.first_token import read_json
from rd2h.proxy.instances import Instance, Pool

if TYPE_CHECKING:
    from rd2h.proxy.app import Proxy

__all__ = ["ModelLengths", "lengths_of", "models_answer", "too_long"]

log = logging.getLogger("rd2h.proxy")

FORWARDED_HEADERS = ("authorization", "x-request-id")


def lengths_of(listing: Any) -> dict[str, int]:
    """``{model id: max_model_len}`` of a ``/v1/models`` answer (what is not shaped so is left out)."""
    data = listing.get("data") if isinstance(listing, dict) else None
    if not isinstance(data, list):
        return {}
    return {card["id"]: card["max_model_len"] for card in data
            if isinstance(card, dict) and isinstance(card.get("id"), str)
            and isinstance(card.get("max_model_len"), int) and not isinstance(card["max_model_len"], bool)
            and card["max_model_len"] > 0}  # fmt: skip


class ModelLengths:
    """``max_model_len`` per Decode instance, learned from its ``/v1/models`` once per epoch (a
    restarted engine may serve another length). A failed listing is not asked again in that epoch,
    except one refused for the client's key (401, 403: the listing goes with the client's headers)."""

    def __init__(self) -> None:
        self._known: dict[str, tuple[int, dict[str, int]]] = {}  # url -> (epoch, {model id: length})
        self._asking: dict[str, asyncio.Task[None]] = {}  # one listing in flight per instance

    def note(self, instance: Instance, listing: Any) -> None:
        self._known[instance.url] = (instance.epoch, lengths_of(listing))

    def learn(self, client: httpx.AsyncClient, pool: Pool, timeout: float,
              headers: dict[str, str]) -> asyncio.Future[Any] | None:
        """The listings still to learn (up instances not known in their epoch), asked concurrently
        (with the client's ``headers``: an engine may want its API key); None when there is none.
        Each is shared by every request that waits for it."""
        tasks = []
        for instance in pool.instances:
            known = self._known.get(instance.url)
            if not instance.up or (known is not None and known[0] == instance.epoch):
                continue
            task = self._asking.get(instance.url)
            if task is None or task.done():
                task = self._asking[instance.url] = asyncio.create_task(
                    self._ask(client, instance, timeout, headers))
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
        if instance.epoch == epoch:
            self._known[instance.url] = (epoch, lengths_of(listing))

    def limit(self, pool: Pool, model: Any) -> int | None:
        """The smallest ``max_model_len`` a Decode instance knows for ``model`` (a request without a
        model: the first one each lists, as vLLM serves it), or None when none is known."""
        found = []
        for instance in pool.instances:
            known = self._known.get(instance.url)
            if known is None or known[0] != instance.epoch or not known[1]:
                continue
            lengths = known[1]
            length = lengths.get(model) if isinstance(model, str) else next(iter(lengths.values()))
            if length is not None:
                found.append(length)
        return min(found) if found else None


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
    headers = {k: v for k in FORWARDED_HEADERS if (v := request.headers.get(k))}
    instance = proxy.decode_pool.pick()
    if instance is None:
        return error_answer("no decode instance is up", 503)
    try:
        answer = await proxy.client.get(instance.url + "/v1/models", headers=headers, timeout=httpx.Timeout(
            30.0, connect=proxy.config.connect_timeout))
    except httpx.TransportError as exc:
        proxy.decode_pool.mark_down(instance, f"{type(exc).__name__}: {exc}")
        return error_answer(f"{instance.url}: {exc}", 502)
    if answer.status_code == 200:
        try:
            proxy.model_lengths.note(instance, read_json(answer.content, "its listing"))
        except ValueError:  # also a listing too deep for json to read (read_json)
            pass  # passed on as it is: the client reads what Decode said
    return Response(answer.content, answer.status_code, media_type=answer.headers.get("content-type"))
