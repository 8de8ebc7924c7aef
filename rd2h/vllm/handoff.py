"""vLLM's own P/D convention over rd2h: the hand-off of an already computed request (no vLLM import).

vLLM's example proxy and the routers built like it ask Prefill first, with
``kv_transfer_params = {"do_remote_decode": true}`` and ``max_tokens=1``, take the
``kv_transfer_params`` Prefill's answer carries and send the request to Decode with them.
rd2h's transfer is a pull by announcement (Decode listens, Prefill dials and announces
layers), so a request computed before any Decode was named is *held*: Prefill keeps its
blocks, and names in its answer where it can be asked for them. Decode, once every worker
expects the request, asks every Prefill rank with its own endpoint; each rank then dials
that Decode and announces every layer from the held blocks.

Trust: the params pass through the client and the router, so Prefill signs them with the
secret it shares with the Decodes (the proxy's secret, :mod:`rd2h.vllm.vouch`), for no longer
than it holds the blocks; Decode refuses unsigned, altered or stale ones and those of another
prompt (a digest of the prompt's token ids is signed). Decode's ask is signed too, and a held
request is sent once: to the first valid ask, within the hold time. After it the blocks are
freed and the request counted (``hold_expired``). A Decode that loads none of it (its prefix
cache has every token; vLLM gave the load to another connector, or aborted the request first)
sends a *release* instead, signed like an ask: the blocks are freed at once
(``handoff_released``). A release of a request already claimed (being sent), expired or
released is refused and counted as a refused ask; it never frees blocks being sent.

This module is the pure part: the params Prefill returns and Decode accepts, the ask, and
the :class:`HoldTable` each Prefill rank keeps (every method under one lock: the listener
thread claims, vLLM's worker thread holds, serves and expires). Every refusal is a
ValueError naming what is wrong; the sockets are in :mod:`rd2h.vllm.handoff_net`.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rd2h.vllm.params import PARAMS_KEY
from rd2h.vllm.vouch import VouchError, sign, verify
from rd2h.wire.endpoint import DecodeEndpoint

__all__ = [
    "HANDOFF_LEG", "ASK_LEG", "Handoff", "Ask", "Held", "HoldTable", "prompt_digest", "handoff_params",
    "accept_handoff", "ask_fields", "release_fields", "accept_ask", "ask_urls",
]  # fmt: skip

HANDOFF_LEG = "handoff"  # Prefill's answer: what Decode may ask for, and where
ASK_LEG = "ask"  # Decode's ask to a Prefill rank
RELEASE_LEG = "release"  # Decode's word that it loads none of a held request: free it now
MAX_ASK_BYTES = 64 * 1024  # an ask is a few hundred bytes
_RECENT = 4096  # ids settled lately (sent or expired): a late ask is told so, not "try again"


@dataclass(frozen=True, slots=True)
class Handoff:
    """What Decode accepted from Prefill's params: the id and every Prefill rank's address."""

    ext_id: str
    host: str
    port: int  # Prefill rank r listens on port + r
    tp: int
    num_tokens: int


@dataclass(frozen=True, slots=True)
class Ask:
    """A Decode's valid ask: pull ``ext_id`` into ``endpoint`` from ``first_block`` on; a
    release (``endpoint`` None): free ``ext_id``'s blocks, nothing is pulled."""

    ext_id: str
    endpoint: DecodeEndpoint | None
    first_block: int
    num_tokens: int


@dataclass(frozen=True, slots=True)
class Held:
    """A finished request whose blocks Prefill keeps until it is asked for or expires."""

    ext_id: str
    req_id: str
    blocks: tuple[tuple[int, ...], ...]  # per KV cache group, the prompt's blocks only
    num_tokens: int
    deadline: float  # monotonic


def prompt_digest(token_ids: Sequence[int]) -> str:
    """Binds the params to one prompt: Decode given them with another refuses them."""
    return hashlib.sha256(",".join(str(int(t)) for t in token_ids).encode()).hexdigest()[:32]


def handoff_params(
    secret: bytes, *, ext_id: str, engine_id: str, host: str, port: int, tp: int, token_ids: Sequence[int],
    blocks: Sequence[Sequence[int]], block_size: int, mode: str, now: float, ttl: float,
) -> dict[str, Any]:
    """The ``kv_transfer_params`` a Prefill returns for a held request, in vLLM's field names
    (``do_remote_prefill`` set: a router forwards them to Decode as they are); rd2h's part,
    the only one Decode believes, is signed for ``ttl`` seconds (the hold time)."""
    fields = {
        "leg": HANDOFF_LEG, "id": ext_id, "engine": engine_id, "host": host, "port": port, "tp": tp,
        "num_tokens": len(token_ids), "prompt": prompt_digest(token_ids), "block_size": block_size, "mode": mode,
    }  # fmt: skip
    return {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": engine_id,
        "remote_request_id": ext_id, "remote_host": host, "remote_port": port, "tp_size": tp,
        "remote_block_ids": [list(g) for g in blocks], "remote_num_tokens": len(token_ids),
        PARAMS_KEY: sign(secret, fields, now, ttl),
    }  # fmt: skip


def _int(fields: Mapping[str, Any], key: str, low: int, high: int) -> int:
    value = fields.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{key!r} must be an int in {low}..{high}, got {value!r}")
    return value


def _verified(secret: bytes, raw: object, now: float, leg: str) -> dict[str, Any]:
    try:
        fields = verify(secret, raw, now)
    except VouchError as exc:  # deep nesting included: verify re-encodes what it got
        raise ValueError(str(exc)) from None
    if fields.get("leg") != leg:
        raise ValueError(f"signed for the {fields.get('leg')!r} leg, not {leg!r}")
    if not isinstance(fields.get("id"), str) or not 16 <= len(fields["id"]) <= 64:
        raise ValueError(f"'id' must be a string of 16-64 characters, got {fields.get('id')!r}")
    return fields


def accept_handoff(
    secret: bytes, raw: object, token_ids: Sequence[int], now: float, *, block_size: int, mode: str
) -> Handoff:
    """Decode: the signed part of Prefill's params, checked against this request's prompt and
    this engine's layout; ValueError naming what is wrong (the caller computes it here)."""
    fields = _verified(secret, raw, now, HANDOFF_LEG)
    if not isinstance(fields.get("host"), str) or not fields["host"]:
        raise ValueError(f"'host' must be a host name, got {fields.get('host')!r}")
    port, tp = _int(fields, "port", 1, 65535), _int(fields, "tp", 1, 1024)
    if port + tp - 1 > 65535:
        raise ValueError(f"ports {port}..{port + tp - 1} are not all port numbers")
    if fields.get("num_tokens") != len(token_ids) or fields.get("prompt") != prompt_digest(token_ids):
        raise ValueError("they were made for another prompt (its digest or length differs)")
    if fields.get("block_size") != block_size or fields.get("mode") != mode:
        raise ValueError(
            f"Prefill's block size {fields.get('block_size')!r} and mode {fields.get('mode')!r} are not this "
            f"engine's ({block_size}, {mode!r})"
        )
    return Handoff(fields["id"], fields["host"], port, tp, len(token_ids))


def ask_urls(handoff: Handoff) -> list[str]:
    """Every Prefill rank's listener, rank order."""
    host = f"[{handoff.host}]" if ":" in handoff.host else handoff.host
    return [f"tcp://{host}:{handoff.port + rank}" for rank in range(handoff.tp)]


def ask_fields(secret: bytes, ext_id: str, endpoint: str, first_block: int, num_tokens: int, now: float) -> dict:
    fields = {"leg": ASK_LEG, "id": ext_id, "endpoint": endpoint, "first_block": first_block, "num_tokens": num_tokens}
    return sign(secret, fields, now)


def release_fields(secret: bytes, ext_id: str, num_tokens: int, now: float) -> dict:
    return sign(secret, {"leg": RELEASE_LEG, "id": ext_id, "num_tokens": num_tokens}, now)


def accept_ask(secret: bytes, raw: bytes, now: float) -> Ask:
    """Prefill: a Decode's ask (or release) from its bytes; ValueError naming what is wrong."""
    if len(raw) > MAX_ASK_BYTES:
        raise ValueError(f"an ask of {len(raw)} bytes (at most {MAX_ASK_BYTES})")
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:  # RecursionError: "[[[[..."
        raise ValueError(f"not JSON: {exc}") from None
    if isinstance(body, dict) and body.get("leg") == RELEASE_LEG:  # what the signature covers decides
        fields = _verified(secret, body, now, RELEASE_LEG)
        return Ask(fields["id"], None, 0, _int(fields, "num_tokens", 1, 1 << 30))
    fields = _verified(secret, body, now, ASK_LEG)
    if not isinstance(fields.get("endpoint"), str):
        raise ValueError(f"'endpoint' must be a string, got {fields.get('endpoint')!r}")
    try:
        endpoint = DecodeEndpoint.parse(fields["endpoint"])
    except Exception as exc:  # noqa: BLE001 - any malformed endpoint is this ask's problem
        raise ValueError(f"bad endpoint {fields['endpoint']!r}: {exc}") from None
    return Ask(fields["id"], endpoint, _int(fields, "first_block", 0, 1 << 30), _int(fields, "num_tokens", 1, 1 << 30))


class HoldTable:
    """One Prefill rank's held requests. ``answer`` runs on the listener's thread; ``hold``,
    ``take_claimed``, ``take_freed``, ``expire`` and ``wait`` on vLLM's worker thread."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._held: dict[str, Held] = {}
        self._claimed: list[tuple[Held, Ask]] = []
        self._released: list[Held] = []  # released by their Decode: the worker frees them
        self._recent: OrderedDict[str, str] = OrderedDict()  # ext id -> what became of it
        self.counts = {"asked": 0, "refused": 0, "expired": 0, "released": 0}

    def __len__(self) -> int:
        with self._cond:
            return len(self._held) + len(self._claimed) + len(self._released)

    def hold(self, held: Held) -> None:
        with self._cond:
            self._held[held.ext_id] = held

    def answer(self, secret: bytes, raw: bytes, now: float, mono: float) -> dict[str, Any]:
        """The reply to one ask: ``{"id", "ok": true}`` (claimed: it will be announced),
        ``{"id", "retry": why}`` (not held yet: the step that holds it may not have run), or
        ``{"id", "error": why}``; to a release, ``ok`` once it is freed. Never raises."""
        try:
            ask = accept_ask(secret, raw, now)
        except ValueError as exc:
            with self._cond:
                self.counts["refused"] += 1
            return {"id": None, "error": f"ask refused: {exc}"}
        with self._cond:
            held = self._held.get(ask.ext_id)
            if held is None:
                fate = self._recent.get(ask.ext_id)
                if fate is None:
                    return {"id": ask.ext_id, "retry": "not held yet"}
                if ask.endpoint is None:  # a release of what was sent or freed: refused, frees nothing
                    self.counts["refused"] += 1
                return {"id": ask.ext_id, "error": fate}
            if mono > held.deadline:  # the worker frees it on its next step
                self.counts["refused"] += ask.endpoint is None  # a release of it: refused, as documented
                return {"id": ask.ext_id, "error": "its hold expired; the blocks are freed"}
            if ask.num_tokens != held.num_tokens:
                self.counts["refused"] += 1
                return {"id": ask.ext_id, "error": f"asked for {ask.num_tokens} tokens, {held.num_tokens} held"}
            del self._held[ask.ext_id]
            if ask.endpoint is None:
                return self._release(held)
            self._settled(ask.ext_id, "already sent to the Decode that asked first")
            self._claimed.append((held, ask))
            self.counts["asked"] += 1
            self._cond.notify_all()
            return {"id": ask.ext_id, "ok": True}

    def _release(self, held: Held) -> dict[str, Any]:
        self._settled(held.ext_id, "released by a Decode that loads none of it; the blocks are freed")
        self._released.append(held)
        self.counts["released"] += 1
        self._cond.notify_all()
        return {"id": held.ext_id, "ok": True}

    def take_claimed(self) -> list[tuple[Held, Ask]]:
        with self._cond:
            claimed, self._claimed = self._claimed, []
            return claimed

    def expire(self, mono: float) -> list[Held]:
        """Held requests past their deadline, removed (their blocks may be freed)."""
        with self._cond:
            gone = [h for h in self._held.values() if mono > h.deadline]
            for held in gone:
                del self._held[held.ext_id]
                self._settled(held.ext_id, "its hold expired; the blocks are freed")
            self.counts["expired"] += len(gone)
            return gone

    def take_freed(self, mono: float) -> list[tuple[Held, str]]:
        """Held requests whose blocks may be freed now, removed, each with why (a local reason):
        ``hold_expired`` (past its deadline) or ``handoff_released`` (its Decode released it)."""
        expired = self.expire(mono)
        with self._cond:
            released, self._released = self._released, []
        return [(h, "hold_expired") for h in expired] + [(h, "handoff_released") for h in released]

    def wait(self, timeout: float) -> bool:
        """Block until an ask was claimed or a hold released (``timeout`` seconds at most);
        whether one was."""
        with self._cond:
            return self._cond.wait_for(lambda: bool(self._claimed or self._released), timeout)

    def next_deadline(self) -> float | None:
        with self._cond:
            return min((h.deadline for h in self._held.values()), default=None)

    def _settled(self, ext_id: str, fate: str) -> None:
        self._recent[ext_id] = fate
        while len(self._recent) > _RECENT:
            self._recent.popitem(last=False)
