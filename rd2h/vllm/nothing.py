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
"""

from __future__ import annotations

import logging
from typing import Any

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
    _said_nothing: dict[str, None]  # oldest first, at most _REMEMBERED
    _refuse: Any  # the scheduler's: logged and counted in ``refused_params``

    def _told_nothing(self, ext_id: str) -> bool:
        """The proxy was told lately that ``ext_id`` loads nothing: a later claim of it (a replay of
        its signed fields) must not pull what the proxy will never send."""
        return ext_id in self._said_nothing

    def _nothing_to_pull(self, request: Any, ext_id: str, loadable: int) -> None:
        """``request`` claimed ``ext_id`` and loads nothing of its prompt (``loadable``: what it
        would load without a prefix-cache hit): the proxy is told once, signed, and the claim and
        the request's ``do_remote_prefill`` are released (a preempted request never pulls later)."""
        req_id, num_tokens = request.request_id, len(request.prompt_token_ids or ())
        if self._claims.get(ext_id) == req_id:  # nothing lands under it: release it at once
            del self._claims[ext_id]
        self._claimed.pop(req_id, None)
        params = getattr(request, "kv_transfer_params", None) or {}
        request.kv_transfer_params = {**params, "do_remote_prefill": False}
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
