"""rd2h's part of ``kv_transfer_params``: what the proxy writes, what the engines accept (no vLLM import).

One client request becomes ``prompts x samples`` engine requests: vLLM makes a child per
prompt of a prompt list (``<id>-<prompt>-<8 chars>``) and, for ``n > 1``, a child per sample
of each (``<sample>_<that id>``), and every child carries the same ``kv_transfer_params``.
Each child has an id of its own, ``<rd2h id>-<prompt>-<sample>``, so no two engine requests
ever share one. The samples of a prompt share its blocks in Decode's prefix cache: only sample
0 pulls (its rendezvous names the prompt's one target), and Prefill computes each prompt once
(the proxy asks it for one sample).

The proxy signs both legs (:mod:`rd2h.vllm.vouch`)::

    Decode:  {"leg": "decode", "id": "<hex>", "prompts": P, "samples": S, "exp": ..., "sig": ...}
             (+ "tail": 1 when the prompt's last token is Prefill's first sampled token: Decode
             loads every token but that one, which Prefill never computed; rd2h proxy
             --first-token-from-prefill)
    Prefill: {"leg": "prefill", "id": "<hex>", "prompts": P, "samples": 1,
              "targets": {"<prompt>": [{"endpoint": "host:port/tp", "first_block": k}]},
              "exp": ..., "sig": ...}

Prefill may also be asked at once, before any rendezvous (the proxy sends both legs together):
its fields then name no targets but where to fetch them, and for how long they may be waited for::

    Prefill: {"leg": "prefill", "id": "<hex>", "prompts": P, "samples": 1,
              "targets_from": "http://proxy/v1/rd2h/targets", "wait": 60.0, "exp": ..., "sig": ...}

Its connector asks that URL (a body signed with the secret, :func:`targets_ask`) and accepts the
answer only as Prefill fields with targets signed by the proxy, for the same id (:func:`accept_late`).

``targets[p][s]`` is the Decode request of prompt ``p``, sample ``s`` that pulls (the proxy
names sample 0 only): the endpoint and first block its rendezvous said. ``targets[p] == []``:
Decode loads nothing of prompt ``p`` (its rendezvous said ``nothing``, :mod:`rd2h.vllm.nothing`),
Prefill computes it and sends it nowhere (an older Prefill refuses such fields: computed, counted). The format allows
several, for a Decode that would pull each sample. Every parse error is a ValueError naming what is wrong; the caller
serves the request locally and counts it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rd2h.vllm.vouch import VouchError, sign, verify
from rd2h.wire.endpoint import DecodeEndpoint

__all__ = [
    "PARAMS_KEY", "MAX_CHILDREN", "Target", "ext_id", "prompt_index", "sample_index",
    "decode_fields", "prefill_fields", "accept_prefill",
    "accept_decode_leg", "decode_tail", "Later", "later_fields", "accept_later", "accept_prefill_leg", "targets_ask", "accept_targets_ask", "accept_late", "MAX_WAIT",
]  # fmt: skip

PARAMS_KEY = "rd2h"
MAX_WAIT = 600.0  # seconds a Prefill keeps blocks for targets that do not come, at most
MAX_CHILDREN = 4096  # prompts x samples of one client request; far above any real one
_ID = re.compile(r"[0-9a-f]{16,64}")
_SAMPLE = re.compile(r"(\d+)_")


@dataclass(frozen=True, slots=True)
class Target:
    """Where one sample's KV goes: its id on both sides, the Decode endpoint, its first block."""

    ext_id: str
    endpoint: DecodeEndpoint
    first_block: int


@dataclass(frozen=True, slots=True)
class Later:
    """Prefill asked before any rendezvous: where its targets come from, and the most it waits."""

    rid: str
    prompt: int
    url: str
    wait: float
    first: bool = False  # its sampled token is the client's first token: the prompt is computed whole


def ext_id(rid: str, prompt: int, sample: int) -> str:
    return f"{rid}-{prompt}-{sample}"


def prompt_index(req_id: str, prompts: int) -> int:
    """Which prompt of the client's list engine request ``req_id`` serves (0 for one prompt)."""
    if prompts <= 1:
        return 0
    try:
        index = int(req_id.rsplit("-", 2)[-2])
    except (IndexError, ValueError):
        raise ValueError(f"request id {req_id!r} does not name a prompt of a list of {prompts}") from None
    if not 0 <= index < prompts:
        raise ValueError(f"request id {req_id!r}: prompt {index} outside 0..{prompts - 1}")
    return index


def sample_index(req_id: str, samples: int) -> int:
    """Which sample (``n``) engine request ``req_id`` is (0 when one sample is asked for)."""
    if samples <= 1:
        return 0
    match = _SAMPLE.match(req_id)
    if match is None or not 0 <= int(match.group(1)) < samples:
        raise ValueError(f"request id {req_id!r} does not name a sample of {samples}")
    return int(match.group(1))


def _count(fields: Mapping[str, Any], key: str) -> int:
    value = fields.get(key, 1)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_CHILDREN:
        raise ValueError(f"{key!r} must be an int in 1..{MAX_CHILDREN}, got {value!r}")
    return value


def _checked(secret: bytes, raw: object, now: float, leg: str) -> tuple[dict[str, Any], str, int, int]:
    try:
        fields = verify(secret, raw, now)
    except VouchError as exc:
        raise ValueError(str(exc)) from None
    if fields.get("leg") != leg:  # one leg's fields never serve as the other's
        raise ValueError(f"signed for the {fields.get('leg')!r} leg, not {leg!r}")
    rid = fields.get("id")
    if not isinstance(rid, str) or not _ID.fullmatch(rid):
        raise ValueError(f"'id' must be 16-64 lowercase hex digits, got {rid!r}")
    prompts, samples = _count(fields, "prompts"), _count(fields, "samples")
    if prompts * samples > MAX_CHILDREN:
        raise ValueError(f"{prompts} prompts x {samples} samples is more than {MAX_CHILDREN} requests")
    return fields, rid, prompts, samples


# -- the proxy ---------------------------------------------------------------------------------


def decode_fields(secret: bytes, rid: str, prompts: int, samples: int, now: float, tail: int = 0) -> dict[str, Any]:
    """``tail``: the prompt's last tokens Prefill did not compute (1: its first sampled token)."""
    fields = {"leg": "decode", "id": rid, "prompts": prompts, "samples": samples}
    return sign(secret, {**fields, "tail": tail} if tail else fields, now)


def prefill_fields(
    secret: bytes, rid: str, prompts: int, samples: int, targets: Mapping[int, list[Mapping[str, Any]]], now: float
) -> dict[str, Any]:
    """``targets[prompt][sample]``: ``{"endpoint", "first_block"}`` from that child's rendezvous."""
    fields = {
        "leg": "prefill", "id": rid, "prompts": prompts, "samples": samples,
        "targets": {
            str(p): [{"endpoint": str(t["endpoint"]), "first_block": int(t.get("first_block", 0))} for t in ts]
            for p, ts in targets.items()
        },
    }  # fmt: skip
    return sign(secret, fields, now)


# -- the engines -------------------------------------------------------------------------------


def accept_decode_leg(secret: bytes, raw: object, req_id: str, now: float) -> tuple[str, int, int, int]:
    """Decode: ``(ext id, prompt, sample, tail)`` of engine request ``req_id``, ValueError
    otherwise; ``tail`` (0 or 1, one prompt of one sample
    only): the prompt's last tokens Prefill did not compute, which Decode computes itself."""
    fields, rid, prompts, samples = _checked(secret, raw, now, "decode")
    prompt, sample = prompt_index(req_id, prompts), sample_index(req_id, samples)
    tail = decode_tail(fields)
    if tail and prompts * samples != 1:
        raise ValueError(f"'tail' is for one prompt of one sample, not {prompts} x {samples}")
    return ext_id(rid, prompt, sample), prompt, sample, tail


def decode_tail(fields: Mapping[str, Any]) -> int:
    """The ``tail`` of Decode fields already accepted (:func:`accept_decode_leg`): 0 or 1."""
    tail = fields.get("tail", 0)
    if tail not in (0, 1) or isinstance(tail, bool):
        raise ValueError(f"'tail' must be 0 or 1, got {tail!r}")
    return int(tail)


def accept_prefill(secret: bytes, raw: object, req_id: str, now: float) -> list[Target]:
    """Prefill: one target per sample of the prompt ``req_id`` computes; ValueError otherwise."""
    fields, rid, prompts, samples = _checked(secret, raw, now, "prefill")
    prompt = prompt_index(req_id, prompts)
    targets = fields.get("targets")
    mine = targets.get(str(prompt)) if isinstance(targets, Mapping) else None
    if mine == []:  # Decode loads nothing of this prompt (its rendezvous said so): computed, sent nowhere
        return []
    if not isinstance(mine, list) or len(mine) != samples:
        raise ValueError(f"'targets' must list {samples} target(s) for prompt {prompt}")
    accepted = []
    for sample, target in enumerate(mine):
        if not isinstance(target, Mapping) or not isinstance(target.get("endpoint"), str):
            raise ValueError(f"target {prompt}/{sample} must be an object with an 'endpoint'")
        first_block = target.get("first_block", 0)
        if isinstance(first_block, bool) or not isinstance(first_block, int) or first_block < 0:
            raise ValueError(f"target {prompt}/{sample}: first_block must be an int >= 0, got {first_block!r}")
        try:
            endpoint = DecodeEndpoint.parse(target["endpoint"])
        except Exception as exc:  # noqa: BLE001 - any malformed endpoint is this request's problem
            raise ValueError(f"target {prompt}/{sample}: {exc}") from None
        accepted.append(Target(ext_id(rid, prompt, sample), endpoint, first_block))
    return accepted


# -- targets learnt after Prefill started --------------------------------------------------------


def later_fields(secret: bytes, rid: str, prompts: int, url: str, wait: float, now: float,
                 first: bool = False) -> dict[str, Any]:
    """The proxy: Prefill's fields that name no targets yet, but where to fetch them (signed).
    ``first``: Prefill's sampled token is the client's first token (its prompt is computed whole)."""
    fields = {"leg": "prefill", "id": rid, "prompts": prompts, "samples": 1, "targets_from": url, "wait": float(wait)}
    return sign(secret, {**fields, "first_token": True} if first else fields, now)


def accept_later(secret: bytes, raw: object, req_id: str, now: float) -> Later | None:
    """Prefill: the :class:`Later` of fields that name no targets (None for fields with
    targets: :func:`accept_prefill` takes those); ValueError when they are not vouched for."""
    if not (isinstance(raw, Mapping) and "targets_from" in raw and "targets" not in raw):
        return None
    fields, rid, prompts, _ = _checked(secret, raw, now, "prefill")
    url, wait = fields.get("targets_from"), fields.get("wait")
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(f"'targets_from' must be an http(s) URL, got {url!r}")
    if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 < wait <= MAX_WAIT:
        raise ValueError(f"'wait' must be seconds in (0, {MAX_WAIT:g}], got {wait!r}")
    return Later(rid, prompt_index(req_id, prompts), url, float(wait), fields.get("first_token") is True)


def accept_prefill_leg(secret: bytes, raw: object, req_id: str, now: float) -> tuple[list[Target], Later | None]:
    """Prefill: the targets its fields name, or none yet and the :class:`Later` they come from;
    ValueError when the fields are not vouched for (:func:`accept_later`, :func:`accept_prefill`)."""
    later = accept_later(secret, raw, req_id, now)
    return ([], later) if later is not None else (accept_prefill(secret, raw, req_id, now), None)


def targets_ask(secret: bytes, rid: str, now: float) -> dict[str, Any]:
    """Prefill's ask for the targets of request ``rid`` (signed: only engines may ask)."""
    return sign(secret, {"want": "targets", "id": rid}, now)


def accept_targets_ask(secret: bytes, raw: object, now: float) -> str:
    """The proxy: the request id a signed ask names; ValueError otherwise."""
    try:
        fields = verify(secret, raw, now)
    except VouchError as exc:
        raise ValueError(str(exc)) from None
    rid = fields.get("id")
    if fields.get("want") != "targets" or not isinstance(rid, str) or not _ID.fullmatch(rid):
        raise ValueError("not an ask for targets")
    return rid


def accept_late(secret: bytes, later: Later, raw: object, req_id: str, now: float) -> list[Target]:
    """Prefill: the targets the proxy answered for ``later``: Prefill fields with targets, signed
    by the proxy, for the same request id (a signed answer for another request is refused)."""
    if not isinstance(raw, Mapping) or raw.get("id") != later.rid:
        raise ValueError(f"the answer is not for request {later.rid}")
    targets = accept_prefill(secret, raw, req_id, now)
    if not targets:  # its blocks, held for targets, are freed: nothing waits for them
        raise ValueError(f"Decode loads nothing of prompt {later.prompt}: there is nothing to send")
    return targets
