"""What ``rd2h proxy`` says of its readiness: ``GET /health``'s answer and the log line of each
change (the first, ``rd2h proxy ready: ...``, is the one users wait for).

Ready means: not draining, and a Prefill and a Decode in rotation, i.e. up (their last health
check answered 200) and warm (with warm-up on, a P/D request went through them since they came
up: :mod:`rd2h.proxy.warmup`). ``status`` says which: ``ok`` (ready), ``warming`` (a Prefill
and a Decode answer, no pair is warm yet), ``unavailable`` (no Prefill or no Decode answers),
``draining`` (SIGTERM).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rd2h.proxy.app import Proxy

__all__ = ["health_body", "note_readiness"]

log = logging.getLogger("rd2h.proxy")


def note_readiness(proxy: Proxy) -> None:
    """Logs each change of ``proxy.ready()`` (called after each health check and warm-up round)."""
    ready = proxy.ready()
    if ready == proxy.was_ready:
        return
    proxy.was_ready = ready
    pools = (proxy.prefill_pool, proxy.decode_pool)
    rotation = {pool.role: [i.url for i in pool.instances if i.in_rotation] for pool in pools}
    if ready:
        how = f"{proxy.warmth.ok} warm-up(s) done" if proxy.config.warms_up else "warm-up off"
        log.info("rd2h proxy ready: prefill %s, decode %s in rotation (%s)", ", ".join(rotation["prefill"]),
                 ", ".join(rotation["decode"]), how)
    elif not proxy.draining:
        log.warning("rd2h proxy not ready: no %s in rotation (GET /health says why)",
                    " and no ".join(role for role, urls in rotation.items() if not urls))


def health_body(proxy: Proxy) -> dict[str, Any]:
    if proxy.draining:
        status = "draining"
    elif proxy.ready():
        status = "ok"
    elif proxy.prefill_pool.any_up() and proxy.decode_pool.any_up() and proxy.config.warms_up:
        status = "warming"
    else:
        status = "unavailable"
    prefills, decodes = proxy.prefill_pool.instances, proxy.decode_pool.instances
    warmth = proxy.warmth
    return {
        "status": status, "ready": status == "ok", "pending": len(proxy.pending), "recomputed": proxy.recomputed,
        "prefill_at_once": proxy.config.targets_url is not None,
        "warmup": {"enabled": proxy.config.warms_up, "ok": warmth.ok, "failed": warmth.failed,
                   "pairs": warmth.describe(prefills, decodes) if proxy.config.warms_up else []},
        "prefill": [i.describe() for i in prefills],
        "decode": [i.describe() for i in decodes],
    }
