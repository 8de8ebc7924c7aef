"""The client's first token from Prefill (``rd2h proxy --first-token-from-prefill``): the
proxy's decisions and the answers it assembles (pure, no I/O; the flow is
:mod:`rd2h.proxy.first_flow`).

Prefill samples a first token anyway (its leg has ``max_tokens=1``). In this mode the proxy
sends Prefill its leg at once (its targets fetched later, :mod:`rd2h.proxy.early`), relays
the token Prefill sampled to the client as its first, and only then sends Decode its leg:
the prompt as Prefill's token ids plus that token, ``max_tokens`` one less. Decode loads the
KV of every prompt token Prefill computed (its signed fields say ``tail``: the last token is
Prefill's sampled one, never computed there) and computes that token's position itself,
generating the second token on. The client's answer is the first token, then Decode's.

Only what is token for token one engine's takes this path: ``/v1/completions`` of one prompt
and one sample, greedy (``temperature`` 0, said by the client: an absent temperature is the
model's default), no seed, logprobs, echo, stop strings, presence or frequency penalty,
``min_tokens``, structured output or any field not known to be safe here
(:data:`SAFE_FIELDS`). Anything else takes the normal flow, counted by reason
(:func:`why_not`). Where the first token ends the request (``max_tokens`` 1, or Prefill
stopped: an end-of-text or stop token) the answer is Prefill's alone. Where the first token
may be part of a character (:func:`splits_a_character`) Decode generates every token, Prefill's
sent at once (counted as ``split_character``): the text would not be one engine's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from rd2h.proxy.bodies import event

__all__ = [
    "DEFAULT_MAX_TOKENS", "REASONS", "SAFE_FIELDS", "First", "StreamRewriter",
    "decode_leg", "ends_at_first", "first_chunks", "first_of", "merged_body", "prefill_only_body", "read_json",
    "splits_a_character", "why_not",
]  # fmt: skip

DEFAULT_MAX_TOKENS = 16  # vLLM's /v1/completions default when a client gives none
# fields whose meaning is the same for the first token sampled on Prefill and the rest on
# Decode (per-token sampling limits, output shaping, the token-level stop a Prefill reports)
SAFE_FIELDS = frozenset({
    "model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "stream", "stream_options", "user",
    "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "return_token_ids", "stop_token_ids",
    "repetition_penalty", "logit_bias", "allowed_token_ids", "add_special_tokens", "priority", "kv_transfer_params",
    "n", "best_of", "seed", "logprobs", "echo", "stop", "presence_penalty", "frequency_penalty", "min_tokens",
})  # fmt: skip
# the reasons a request takes the normal flow (the label of rd2h_proxy_first_token_fallbacks_total)
REASONS = ("chat", "prompt_list", "n", "sampling", "seed", "logprobs", "echo", "stop", "penalties", "min_tokens",
           "max_tokens", "other_field")  # fmt: skip


def why_not(path: str, body: dict[str, Any]) -> str | None:
    """Why this request cannot take its first token from Prefill (one of :data:`REASONS`), or None."""
    if not path.endswith("/v1/completions"):
        return "chat"
    prompt = body.get("prompt")
    if not (isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt))):  # fmt: skip
        return "prompt_list"  # a list of prompts (or of token-id lists), embeddings, none
    if body.get("n", 1) not in (None, 1) or body.get("best_of") not in (None, 1) or body.get("use_beam_search"):
        return "n"
    temperature = body.get("temperature")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or temperature != 0:
        return "sampling"  # absent: the model's default, which may sample
    if body.get("seed") is not None:
        return "seed"
    if body.get("logprobs") is not None or body.get("prompt_logprobs") is not None:
        return "logprobs"
    if body.get("echo"):
        return "echo"
    if body.get("stop"):  # a stop string may span the first token and the second: Decode sees only its own text
        return "stop"
    if body.get("presence_penalty") or body.get("frequency_penalty"):  # count output tokens only
        return "penalties"
    if body.get("min_tokens"):
        return "min_tokens"
    limit = body.get("max_tokens", DEFAULT_MAX_TOKENS)
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        # the normal flow answers vLLM's own error; null means vLLM's default (16 here, up to the model's
        # length in others): one token less of that is not ours to write, the normal flow passes it on
        return "max_tokens"
    if any(key not in SAFE_FIELDS for key in body) or not _stream_options_ok(body):
        return "other_field"
    return None


_STREAM_OPTIONS = frozenset({"include_usage", "continuous_usage_stats"})


def _stream_options_ok(body: dict[str, Any]) -> bool:
    """``stream_options`` as vLLM takes them, or none: Prefill's leg drops them, so one it would
    refuse (not streamed, an unknown key or value) would be refused only by Decode, after the
    first token; the normal flow passes vLLM's own error on."""
    options = body.get("stream_options")
    if not options:
        return True
    return bool(body.get("stream") is True and isinstance(options, dict) and set(options) <= _STREAM_OPTIONS
                and all(v is None or isinstance(v, bool) for v in options.values()))  # fmt: skip


@dataclass(frozen=True)
class First:
    """What Prefill's answer to its leg says: the prompt's token ids and the token it sampled."""

    prompt_ids: list[int]
    token_id: int
    text: str
    finish_reason: str | None
    stop_reason: Any
    answer: dict[str, Any]  # Prefill's whole answer (id, created, model, usage)


def first_of(answer: Any) -> First:
    """Prefill's answer (asked with ``return_token_ids``); ValueError when it is not one choice
    with its prompt's token ids and one sampled token."""
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        raise ValueError("Prefill's answer is not one choice")
    choice = choices[0]
    prompt, tokens = choice.get("prompt_token_ids"), choice.get("token_ids")
    if not (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
        raise ValueError("Prefill's answer has no prompt_token_ids (a vLLM without return_token_ids?)")
    if not (isinstance(tokens, list) and len(tokens) == 1 and isinstance(tokens[0], int)):
        raise ValueError(f"Prefill's answer has not one sampled token but {tokens!r}")
    return First(list(prompt), tokens[0], str(choice.get("text") or ""), choice.get("finish_reason"),
                 choice.get("stop_reason"), answer)  # fmt: skip


def ends_at_first(first: First, body: dict[str, Any]) -> bool:
    """The first token ends the request: one token asked for, or Prefill stopped (not at its
    length of one: an end-of-text or stop token)."""
    return body.get("max_tokens", DEFAULT_MAX_TOKENS) == 1 or first.finish_reason != "length"


def splits_a_character(first: First) -> bool:
    """Prefill's first token may be part of a character: its text is empty (vLLM holds back an
    incomplete UTF-8 sequence; a special token skipped is empty too) or holds U+FFFD. One engine
    writes such bytes with the next token, and a Decode given that token as its prompt's last
    writes other text for the next one (seen: the whole prompt's text again). Tokens would
    match, text not: Decode must generate the first token itself."""
    return not first.text or "\ufffd" in first.text


def decode_leg(body: dict[str, Any], first: First) -> dict[str, Any]:
    """Decode's leg: the prompt as token ids with the first token last, one token less to go."""
    leg = {k: v for k, v in body.items() if k not in ("kv_transfer_params", "add_special_tokens")}
    leg["prompt"] = [*first.prompt_ids, first.token_id]  # token ids: Decode adds no special token
    leg["max_tokens"] = body.get("max_tokens", DEFAULT_MAX_TOKENS) - 1  # an int >= 1 (why_not)
    return leg


def _wants_ids(body: dict[str, Any]) -> bool:
    return bool(body.get("return_token_ids"))


def _usage(usage: Any) -> Any:
    """Decode's usage as one engine's: its prompt was one token longer, its completion one shorter."""
    if not isinstance(usage, dict):
        return usage
    fixed = dict(usage)
    if isinstance(fixed.get("prompt_tokens"), int):
        fixed["prompt_tokens"] -= 1
    if isinstance(fixed.get("completion_tokens"), int):
        fixed["completion_tokens"] += 1
    return fixed


def prefill_only_body(first: First, body: dict[str, Any]) -> dict[str, Any]:
    """The whole (non-streamed) answer when the first token ends the request: Prefill's."""
    answer = dict(first.answer)
    if "kv_transfer_params" in answer:  # Prefill's, never the client's (the normal flow answers Decode's)
        answer["kv_transfer_params"] = None
    choice = dict(answer["choices"][0])
    if not _wants_ids(body):
        choice.update(prompt_token_ids=None, token_ids=None)
    answer["choices"] = [choice]
    return answer


def read_json(data: bytes, who: str) -> Any:
    """An engine's JSON answer; ValueError naming ``who`` when it is none (also one nested too deep to read)."""
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"{who} sent no JSON ({type(exc).__name__}): {data[:100]!r}") from None


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _check_choice(choice: Any, where: str) -> None:
    """ValueError unless ``choice`` is a choice the proxy can merge: an object, its text a string
    and its token ids lists of ints, where it has them."""
    if not isinstance(choice, dict):
        raise ValueError(f"{where}: a choice is not an object but {type(choice).__name__}")
    if choice.get("text") is not None and not isinstance(choice["text"], str):
        raise ValueError(f"{where}: its text is not a string but {type(choice['text']).__name__}")
    for key in ("token_ids", "prompt_token_ids"):
        if choice.get(key) is not None and not _int_list(choice[key]):
            raise ValueError(f"{where}: its {key} is not a list of token ids: {str(choice[key])[:100]}")


def _check_usage(usage: Any, where: str) -> None:
    if usage is None:
        return
    if not isinstance(usage, dict) or not all(
            usage.get(k) is None or (isinstance(usage[k], int) and not isinstance(usage[k], bool))
            for k in ("prompt_tokens", "completion_tokens", "total_tokens")):  # fmt: skip
        raise ValueError(f"{where}: its usage is not token counts: {str(usage)[:100]}")


def merged_body(first: First, decode: Any, body: dict[str, Any]) -> dict[str, Any]:
    """The whole (non-streamed) answer: Decode's, its text and tokens after the first, under
    Prefill's id; ValueError naming what is wrong when Decode's answer is not one choice of
    the shape an engine answers."""
    if not isinstance(decode, dict):
        raise ValueError(f"Decode's answer is not a JSON object but {type(decode).__name__}")
    choices = decode.get("choices")
    if not isinstance(choices, list) or len(choices) != 1:
        raise ValueError(f"Decode's answer is not one choice: its choices are {str(choices)[:100]}")
    _check_choice(choices[0], "Decode's answer")
    _check_usage(decode.get("usage"), "Decode's answer")
    answer = {**decode, "id": first.answer.get("id", decode.get("id")),
              "created": first.answer.get("created", decode.get("created"))}  # fmt: skip
    choice = dict(choices[0])
    choice["text"] = first.text + (choice.get("text") or "")
    if _wants_ids(body):
        choice.update(prompt_token_ids=first.prompt_ids, token_ids=[first.token_id, *(choice.get("token_ids") or ())])
    answer["choices"] = [choice]
    if "usage" in answer:
        answer["usage"] = _usage(answer["usage"])
    return answer


def first_chunks(first: First, body: dict[str, Any], *, last: bool) -> bytes:
    """The stream's first event (the first token, in one engine's chunk shape); with ``last``
    (the first token ends the request) its finish, the usage chunk asked for and ``[DONE]``."""
    wants_ids, options = _wants_ids(body), body.get("stream_options") or {}
    head = {k: first.answer.get(k) for k in ("id", "created", "model")}
    choice = {
        "index": 0, "text": first.text, "logprobs": None, "finish_reason": first.finish_reason if last else None,
        "stop_reason": first.stop_reason if last else None,
        "prompt_token_ids": first.prompt_ids if wants_ids else None,
        "token_ids": [first.token_id] if wants_ids else None,
    }  # fmt: skip
    usage = {"prompt_tokens": len(first.prompt_ids), "completion_tokens": 1, "total_tokens": len(first.prompt_ids) + 1}
    chunk = {**head, "object": "text_completion", "choices": [choice]}
    if isinstance(options, dict) and options.get("include_usage") and options.get("continuous_usage_stats"):
        chunk["usage"] = usage
    out = event(chunk)
    if last:
        if isinstance(options, dict) and options.get("include_usage"):
            out += event({**head, "object": "text_completion", "choices": [], "usage": usage})
        out += b"data: [DONE]\n\n"
    return out


class StreamRewriter:
    """Decode's stream as the rest of one engine's: each event under Prefill's id, no prompt
    token ids (the first event carried them), usage counted as one engine counts. Events are
    cut at blank lines across the raw chunks; what is not a data event passes unchanged, and a
    data event that is not an engine's chunk is a ValueError (:meth:`feed`) naming what is wrong."""

    def __init__(self, first: First) -> None:
        self.first = first
        self._buffer = b""

    def feed(self, raw: bytes) -> bytes:
        self._buffer += raw
        *events, self._buffer = self._buffer.split(b"\n\n")
        return b"".join(self._rewrite(one) for one in events)

    def flush(self) -> bytes:
        rest, self._buffer = self._buffer, b""
        return rest

    def _rewrite(self, one: bytes) -> bytes:
        """One event rewritten; ValueError naming what is wrong with a data event that is not an
        engine's chunk (an error event passes as it is)."""
        if not one.startswith(b"data: ") or one == b"data: [DONE]":
            return one + b"\n\n"  # not data (a comment, a field) or the end: as Decode sent it
        chunk = read_json(one[6:], "Decode's stream (an event)")
        if not isinstance(chunk, dict):
            raise ValueError(f"Decode's stream: an event is not a JSON object but {type(chunk).__name__}")
        if "error" in chunk:
            return one + b"\n\n"
        choices = chunk.get("choices")
        if not isinstance(choices, list):
            raise ValueError(f"Decode's stream: an event's choices are not a list: {str(choices)[:100]}")
        for choice in choices:
            _check_choice(choice, "Decode's stream")
        _check_usage(chunk.get("usage"), "Decode's stream")
        for key in ("id", "created"):
            if key in self.first.answer and key in chunk:
                chunk[key] = self.first.answer[key]
        chunk["choices"] = [{**c, "prompt_token_ids": None} if c.get("prompt_token_ids") else c for c in choices]
        if "usage" in chunk:
            chunk["usage"] = _usage(chunk["usage"])
        return event(chunk)
