"""What the proxy reads from a client and what it sends each engine (pure, no I/O but the
body read): limits on the body, the shape of a request, the Prefill leg's changes."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from starlette.requests import Request

from rd2h.vllm.params import MAX_CHILDREN

__all__ = [
    "Refused", "children_of", "error_body", "error_event", "event", "parse_body", "prefill_body", "read_limited",
    "shape_of",
]  # fmt: skip


class Refused(ValueError):
    """A client request rd2h cannot serve as asked: answered ``status`` with this message."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def error_body(message: str, kind: str, status: int) -> dict[str, Any]:
    """OpenAI's error shape (what vLLM answers too): ``{"error": {message, type, param, code}}``."""
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def event(payload: Any) -> bytes:
    """One server-sent event as vLLM streams them: ``data: <compact JSON>`` and a blank line."""
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


def error_event(message: str, status: int) -> bytes:
    """The event a stream that failed after its headers ends with (no ``[DONE]`` follows)."""
    return event(error_body(message, "rd2h_proxy_error", status))


def parse_body(raw: bytes) -> dict[str, Any]:
    """A client's JSON object; Refused naming what is wrong (not UTF-8, not JSON, not an object)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise Refused(f"the body is not UTF-8 (byte {exc.start})") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise Refused(f"the body is not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:  # "[[[[...": a client's input must not raise out of the handler
        raise Refused("the body is nested too deeply to read") from None
    if not isinstance(body, dict):
        raise Refused("the body must be a JSON object")
    return body


def children_of(body: dict[str, Any], path: str) -> int:
    """How many engine requests vLLM makes of this body: one per prompt of a prompt list."""
    if path.endswith("chat/completions"):
        return 1
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return len(prompt)
    return 1


def shape_of(body: dict[str, Any], path: str) -> tuple[int, int]:
    """``(prompts, samples)`` of a client request; Refused for what rd2h cannot serve."""
    prompts = children_of(body, path)
    samples = body.get("n", 1)
    if samples is None:
        samples = 1
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise Refused(f"n must be an integer >= 1, got {samples!r}")
    if prompts * samples > MAX_CHILDREN:
        raise Refused(f"{prompts} prompts x n={samples} is more than the {MAX_CHILDREN} requests one call may make")
    if body.get("prompt_logprobs") is not None or (body.get("echo") and body.get("logprobs") is not None):
        raise Refused(
            "prompt_logprobs (and echo with logprobs) need the prompt computed by the engine that answers; "
            "with rd2h the Decode engine loads it: ask an engine directly for those"
        )
    return prompts, samples


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The Prefill leg: the client's request with what must change for one prefill."""
    leg = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "n", "best_of", "min_tokens")}
    leg.update(max_tokens=1, stream=False)
    if "max_completion_tokens" in body:
        leg["max_completion_tokens"] = 1
    return leg


async def read_limited(request: Request, limit: int, timeout: float = 10.0) -> bytes:
    """The body, refused with 413 past ``limit`` bytes before more of it is read, and with 408
    when it takes more than ``timeout`` seconds to arrive."""
    try:
        return await asyncio.wait_for(_read_capped(request, limit), timeout)
    except asyncio.TimeoutError:
        raise Refused(f"the body did not arrive within {timeout:g} s", status=408) from None


async def _read_capped(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise Refused(f"the body is {int(declared)} bytes, more than the {limit} this proxy takes", status=413)
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise Refused(f"the body is more than the {limit} bytes this proxy takes", status=413)
        parts.append(part)
    return b"".join(parts)
