"""Decode's whole stream as the rest of a client's stream whose first token was Prefill's (pure).

With ``rd2h proxy --early-first-token`` the client gets the token Prefill sampled as soon as
Prefill answers, while Decode, sent the normal flow's leg (asked with ``return_token_ids``),
generates every token, the first included. :class:`Continuation` rewrites Decode's stream as
what follows: Decode's first token is dropped once it is the one Prefill sampled, with the same
text (:class:`Mismatch` otherwise: the client holds Prefill's, and what Decode generated after
its own is not a continuation of it); every event goes under Prefill's id; token ids are kept
only where the client asked for them. Until :meth:`Continuation.follow` is called (Prefill's
token was not sent: Decode's first chunk came first, or Prefill's answer was unusable) Decode's
stream passes whole, its ids stripped as the client asked.
"""

from __future__ import annotations

import json
from typing import Any

from rd2h.proxy.bodies import event
from rd2h.proxy.first_token import First

__all__ = ["Continuation", "Mismatch"]


class Mismatch(ValueError):
    """Decode's first token is not the one Prefill sampled (the client has Prefill's)."""


class Continuation:
    """Feed Decode's raw stream, get the client's bytes (events are cut at blank lines)."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.first: First | None = None
        self.wants_ids = bool(body.get("return_token_ids"))
        self.dropped = True  # nothing to drop until follow()
        self._buffer = b""

    def follow(self, first: First) -> None:
        """Prefill's ``first`` went to the client: Decode's first token is to be checked and dropped."""
        self.first, self.dropped = first, False

    def feed(self, raw: bytes) -> bytes:
        self._buffer += raw
        *events, self._buffer = self._buffer.split(b"\n\n")
        return b"".join(self._rewrite(one) for one in events)

    def flush(self) -> bytes:
        rest, self._buffer = self._buffer, b""
        return rest

    def _rewrite(self, one: bytes) -> bytes:
        if not one.startswith(b"data: ") or one == b"data: [DONE]":
            return one + b"\n\n"
        try:
            chunk = json.loads(one[6:])
        except (ValueError, RecursionError):
            return one + b"\n\n"  # not an engine's chunk: as Decode sent it
        if not isinstance(chunk, dict) or "error" in chunk:
            return one + b"\n\n"
        choices = chunk.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            choice = dict(choices[0])
            if not self.dropped and isinstance(choice.get("token_ids"), list) and choice["token_ids"]:
                if not self._drop_first(choice):
                    return b""  # the first token's event, nothing else in it
            if not self.wants_ids:
                choice.update(prompt_token_ids=None, token_ids=None)
            elif choice.get("prompt_token_ids") and self.first is not None:
                choice["prompt_token_ids"] = None  # Prefill's first event carried them
            chunk["choices"] = [choice, *choices[1:]]
        if self.first is not None:
            for key in ("id", "created"):
                if key in self.first.answer and key in chunk:
                    chunk[key] = self.first.answer[key]
        return event(chunk)

    def _drop_first(self, choice: dict[str, Any]) -> bool:
        """Take the first token out of ``choice`` (Mismatch when it is not Prefill's); False when
        nothing of the event is left to send."""
        assert self.first is not None
        ids, text = list(choice["token_ids"]), str(choice.get("text") or "")
        if ids[0] != self.first.token_id:
            raise Mismatch(f"Decode's first token {ids[0]!r} is not Prefill's {self.first.token_id}")
        if not text.startswith(self.first.text):
            raise Mismatch(f"Decode's first text {text!r} does not begin with Prefill's {self.first.text!r}")
        self.dropped = True
        choice["token_ids"], choice["text"] = ids[1:], text[len(self.first.text):]
        return bool(choice["token_ids"] or choice["text"] or choice.get("finish_reason"))
