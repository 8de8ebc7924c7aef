"""Decode: a request that loads nothing says so to the proxy at once (no vLLM import).

Decode loads a prompt's tokens (all but the last with several KV cache groups or a Mamba group,
:func:`rd2h.vllm.kv_groups.transfer_tokens`) less a local prefix-cache hit. Where that is none (a
one-token prompt under several groups; every loadable token already in Decode's prefix cache),
no block is pulled and no worker is told, yet the proxy waits for that prompt's rendezvous
before it sends Prefill its leg (or, Prefill asked at once, its targets). Posting nothing made
the proxy wait out its ``--rendezvous-timeout``: a 502 when Decode's answer took longer, else a
Prefill held idle until then. So the scheduler posts a rendezvous that names no endpoint but
``nothing``, the reason, signed like every rendezvous (only holders of the shared secret are
heard), releases its claim on the id (a sample of ``n`` waiting for the pull goes on), and
counts it (``nothing_to_pull``: ``vllm:rd2h_local_recomputes_total{reason="nothing_to_pull"}``).
A proxy that knows the field counts the prompt as heard and, when every prompt of the request
loads nothing, sends no Prefill leg (or cancels the one sent at once); an older proxy refuses
it (403, no endpoint: ``rendezvous_refused``) and behaves as before.

vLLM's P/D convention (:mod:`rd2h.vllm.handoff`): Prefill holds a finished request's blocks until
a Decode asks for them. A Decode that claimed the hand-off and loads none of it (its prefix cache
has every loadable token; or it never asks: vLLM gave the load to another connector, or the
request ended before its allocation) sends every Prefill rank a signed release instead, so that
the blocks are freed at once, not at ``hold_timeout`` (Prefill counts ``handoff_released``). The
first case is also counted here as ``nothing_to_pull``; a release Prefill refused or never
answered is logged and counted in ``stats["release_failed"]`` (it then frees at hold_timeout).
"""

from __future__ import annotations

import logging
from typing import Any

from rd2h.vllm.handoff import Handoff, ask_urls, release_fields
from rd2h.vllm.vouch import sign

__all__ = ["NOTHING_REASONS", "NothingToPull", "nothing_body"]

log = logging.getLogger("rd2h.vllm.scheduler")

# short_prompt: Decode loads no token of it (one token, several groups); prefix_cached: it has them all
NOTHING_REASONS = ("short_prompt", "prefix_cached")
_REMEMBERED = 4096  # ext ids said lately: a replay of their fields is computed here, never pulled


def nothing_body(ext_id: str, num_tokens: int, reason: str, mode: str) -> dict[str, Any]:
    """The unsigned rendezvous of a prompt Decode loads nothing of (no endpoint: nothing to dial)."""
    return {"ext_id": ext_id, "nothing": reason, "num_tokens": num_tokens, "mode": mode}


class NothingToPull:
    """The part of :class:`~rd2h.vllm.scheduler.RD2HScheduler` that tells the proxy a claimed
    request loads nothing (its state is the scheduler's)."""

    config: Any
    stats: dict[str, int]
    _secret: bytes
    _clock: Any
    _poster: Any
    _claims: dict[str, str]
    _claimed: dict[str, str]
    _landed: set[str]
    _said_nothing: dict[str, None]  # oldest first, at most _REMEMBERED
    _refuse: Any  # the scheduler's: logged and counted in ``refused_params``
    _asker: Any  # Decode's HandoffAsker, made on first use
    _releasing: dict[str, str]  # ext id -> the req id whose release is out
    _handoffs: dict[str, Handoff]  # req id -> the hand-off it claimed, not yet asked for

    def _handoff_asker(self) -> Any:
        if self._asker is None:
            from rd2h.vllm.handoff_net import HandoffAsker

            self._asker = HandoffAsker(timeout=self.config.handoff_timeout)
        return self._asker

    def _unclaim_id(self, req_id: str) -> None:
        """``req_id``'s claim on an id (if any) goes: another request may pull that id."""
        claimed = self._claimed.pop(req_id, None)
        if claimed is not None:
            self._claims.pop(claimed, None)
            self._landed.discard(claimed)

    def _unclaim(self, request: Any) -> None:
        """Nothing lands for ``request``: its claim goes at once and its ``do_remote_prefill`` is
        consumed (a preempted request never pulls later)."""
        self._unclaim_id(request.request_id)
        params = getattr(request, "kv_transfer_params", None) or {}
        request.kv_transfer_params = {**params, "do_remote_prefill": False}

    def _release_handoff(self, request: Any, handoff: Handoff, *, nothing: bool) -> tuple[int, bool]:
        """``request`` claimed ``handoff`` and will not pull it (``nothing``: it loads none of its
        prompt, counted in ``nothing_to_pull``): its claim is dropped, its ``do_remote_prefill``
        consumed (a preempted request never asks later) and every Prefill rank told to free the
        held blocks now. ``(0, False)``: the request is computed here."""
        req_id, ext_id = request.request_id, handoff.ext_id
        self._handoffs.pop(req_id, None)  # matched before: not asked for, nor released again
        self._unclaim(request)
        if nothing:
            self.stats["nothing_to_pull"] += 1
        self.stats["handoff_released"] += 1
        log.info("request %s: Decode loads none of hand-off %s; every Prefill rank is told to free its blocks "
                 "(%d such releases so far)", req_id, ext_id, self.stats["handoff_released"])  # fmt: skip
        self._releasing[ext_id] = req_id
        body = release_fields(self._secret, ext_id, handoff.num_tokens, self._clock())
        self._handoff_asker().submit(ext_id, ask_urls(handoff), body)
        return 0, False

    def _release_answered(self, ext_id: str, error: str | None) -> bool:
        """Whether ``ext_id``'s answer was a release's (a failed one logged and counted)."""
        req_id = self._releasing.pop(ext_id, None)
        if req_id is None:
            return False
        if error is not None:
            self.stats["release_failed"] += 1
            log.warning("request %s: the release of hand-off %s failed (%s); Prefill frees its blocks at its "
                        "hold_timeout (%d failed releases so far)", req_id, ext_id, error,
                        self.stats["release_failed"])  # fmt: skip
        return True

    def _told_nothing(self, ext_id: str) -> bool:
        """The proxy was told lately that ``ext_id`` loads nothing: a later claim of it (a replay of
        its signed fields) must not pull what the proxy will never send."""
        return ext_id in self._said_nothing

    def _nothing_to_pull(self, request: Any, ext_id: str, loadable: int) -> None:
        """``request`` claimed ``ext_id`` and loads nothing of its prompt (``loadable``: what it
        would load without a prefix-cache hit): the proxy is told once, signed, and the claim and
        the request's ``do_remote_prefill`` are released (a preempted request never pulls later)."""
        req_id, num_tokens = request.request_id, len(request.prompt_token_ids or ())
        self._unclaim(request)
        said = self._said_nothing
        if ext_id in said:  # a replay of its fields: computed here, said once, refused (counted)
            self._refuse(req_id, f"id {ext_id} was said to load nothing already (a replay of its fields)")
            return
        said[ext_id] = None
        if len(said) > _REMEMBERED:
            del said[next(iter(said))]
        reason = NOTHING_REASONS[0] if loadable <= 0 else NOTHING_REASONS[1]
        self.stats["nothing_to_pull"] += 1
        log.info(
            "request %s: Decode loads nothing of its %d prompt tokens (%s); computed here, the proxy is told so "
            "(%d such requests so far)", req_id, num_tokens, reason, self.stats["nothing_to_pull"],
        )  # fmt: skip
        if self.config.metaserver is None or self._poster is None:  # refused at startup; unit-built schedulers
            return
        body = nothing_body(ext_id, num_tokens, reason, self.config.mode.value)
        self._poster.submit(ext_id, self.config.metaserver, sign(self._secret, body, self._clock()))
