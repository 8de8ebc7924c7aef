"""Prefill started before Decode's rendezvous: the proxy's half.

With ``ProxyConfig.targets_url`` the proxy sends a request to Prefill at the same time as to
Decode: Prefill computes while Decode admits its request, and its signed fields name no
targets, only where to fetch them (:func:`rd2h.vllm.params.later_fields`). Prefill's connector
asks that URL with a body signed with the shared secret; the answer waits until every Decode
rendezvous of the request is in and is then Prefill's fields with every target, signed by the
proxy, as the sequential flow puts in Prefill's request body. Only the proxy steers where
bytes go: an ask that is not signed is refused (403), one for an id the proxy does not wait
for gets 404, and one for a request that ended or whose rendezvous never came gets 410 (Prefill
then frees the blocks it held for it).

Prefill answers its leg once it computed the prompt, usually before its KV went to Decode (its
targets came later, or the transfer is still under way). Until Decode answers, that Prefill
still owes the request its KV, and Decode learns of a Prefill only from its first announcement:
one that dies before that reaches Decode (waiting for its targets, or its first layer still
queued on a connection not up yet) is seen by nobody but the proxy. So the Prefill part of the
request (:func:`prefill_owes`) waits, after the leg, for the instance that answered it to be
found gone (a health check or a call refused, or a connection it dropped; a timeout, which a
loaded but live engine gives, fails nothing): the request then fails as a failed Prefill leg does
(502, or Decode computes the prompt under its ``recompute`` policy) instead of waiting for
Decode's ``request_timeout``. Decode's first byte ends the wait: it had the KV whole.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from fastapi.responses import JSONResponse, Response

from rd2h.proxy.failures import PrefillFailed, cancel, refused, settle
from rd2h.vllm.params import accept_targets_ask, prefill_fields

if TYPE_CHECKING:
    from rd2h.proxy.app import Proxy
    from rd2h.proxy.pending import Pending

__all__ = ["TARGETS_PATH", "all_heard", "answer_targets", "leg_unless_nothing", "nothing_to_prefill", "prefill_owes"]

TARGETS_PATH = "/v1/rd2h/targets"


def all_heard(proxy: Proxy, pending: Pending) -> None:
    """Every child's rendezvous is in: Prefill's targets are signed, its leg (or its ask) may go."""
    found = [f.result() for f in pending.futures]
    waited = time.monotonic() - pending.started
    pending.mark("rendezvous_all")
    proxy.metrics.rendezvous.observe(waited)
    pending.record["rendezvous_ms"] = round(waited * 1e3, 1)
    pending.record["children"] = [
        {k: r[k] for k in ("endpoint", "first_block", "num_tokens", "nothing") if k in r} for r in found
    ]
    pulled = [r for r in found if "nothing" not in r]  # a prompt Decode loads nothing of: no target, no KV
    pending.recompute = bool(pulled) and all(r.get("on_load_failure") == "recompute" for r in pulled)
    pending.nothing = not pulled
    if pulled:  # the others get an empty list: Prefill computes them and sends them nowhere
        targets = {p: [] if "nothing" in found[p] else [found[p]] for p in range(pending.prompts)}
        pending.targets = prefill_fields(proxy.config.secret, pending.rid, pending.prompts, 1, targets, time.time())
    settle(pending.all_in, None)


def nothing_to_prefill(proxy: Proxy, pending: Pending) -> None:
    """Every rendezvous said Decode loads nothing: no Prefill leg was sent, or the one sent at once
    was cancelled (vLLM aborts it and frees its blocks) or had answered (its ask for targets gets 410)."""
    if not proxy.config.targets_url:
        pending.record["prefill"] = "skipped: Decode loads nothing"
    elif "prefill_cancelled" in pending.record.get("t", {}):
        pending.record["prefill"] = "cancelled: Decode loads nothing"
    else:
        pending.record["prefill"] = "answered before every rendezvous was in: Decode loads nothing (410 to its ask)"
    if not pending.warmup:
        proxy.metrics.prefill_skipped.inc()


async def leg_unless_nothing(pending: Pending, leg: Coroutine[Any, Any, None]) -> None:
    """Prefill's leg sent at once: awaited, unless every rendezvous comes in first saying Decode
    loads nothing; then it is cancelled (its connection closed: vLLM aborts the request)."""
    task = asyncio.ensure_future(leg)
    try:
        await asyncio.wait({task, pending.all_in}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done() and pending.nothing:
            pending.mark("prefill_cancelled")
            await cancel(task)
            return
        await task
    finally:
        if not task.done():  # this request was cancelled meanwhile
            await cancel(task)


async def answer_targets(proxy: Proxy, body: Any) -> Response:
    """A Prefill's signed ask for a request's targets: answered once every rendezvous is in."""
    try:
        rid = accept_targets_ask(proxy.config.secret, body, time.time())
    except ValueError as exc:
        return refused(proxy.metrics, "targets", exc)
    pending = proxy.pending.get(rid)
    if pending is None:
        return JSONResponse({"error": "no request waits for targets under this id"}, status_code=404)
    pending.mark("targets_asked")
    try:
        await asyncio.shield(pending.all_in)  # Prefill hanging up must not settle the request
    except Exception as exc:  # noqa: BLE001 - the rendezvous timed out, or the request ended
        return JSONResponse({"error": f"no targets: {exc}"}, status_code=410)
    if pending.targets is None:  # every rendezvous said Decode loads nothing: nothing will be pulled
        pending.mark("targets_none")
        return JSONResponse({"error": "no targets: Decode loads nothing of this request"}, status_code=410)
    pending.mark("targets_sent")
    return JSONResponse(pending.targets)


async def prefill_owes(pending: Pending) -> None:
    """Prefill answered its leg before Decode answered: fail (PrefillFailed) if the instance that
    answered it is found gone meanwhile (``Pool.mark_down(dead=True)``). Runs until cancelled
    (Decode answered: the proxy settles the Prefill task) or until that instance goes down."""
    instance = pending.answered_by.get("prefill")
    if instance is None:
        return
    why = await asyncio.shield(instance.gone())  # shared by every request that instance owes
    if "first_byte" in pending.record.get("t", {}):
        return  # Decode had the KV whole: nothing is owed any more
    pending.mark("prefill_gone")
    raise PrefillFailed(f"Prefill {instance.url} went down before Decode had the request's KV: {why}")
