"""The proxy vouches for rd2h's part of ``kv_transfer_params``; engines check it (no vLLM import).

An API client can put anything in ``kv_transfer_params``: talking to an engine directly, or
through a proxy that passes them on. The fields that steer a transfer (the rd2h id, the
Decode endpoints Prefill dials) are therefore accepted only when signed with a secret that
the proxy and the engines share and clients never see: an HMAC-SHA256 over the canonical
JSON of the fields, with an expiry. Anything else (no signature, a wrong one, an expired one,
a malformed value) is refused with a reason, and the engine serves the request as a plain
local one. The secret comes from ``RD2H_SECRET`` or a file (``secret_file``), never from a
request; docs/security.md states the whole trust model.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Mapping
from typing import Any

from rd2h.errors import ConfigError

__all__ = ["SECRET_ENV", "VouchError", "load_secret", "sign", "verify", "token"]

SECRET_ENV = "RD2H_SECRET"
DEFAULT_TTL = 900.0  # seconds a signature stays valid: far above any rendezvous wait
_MIN_SECRET_BYTES = 16


class VouchError(ValueError):
    """rd2h's fields of a request are not vouched for: the reason, for the log line."""


def load_secret(secret_file: str | None = None, *, env: Mapping[str, str] | None = None) -> bytes:
    """The shared secret: ``secret_file``'s content if given, else ``$RD2H_SECRET``.

    Raises ConfigError naming both ways when neither is set, and for a secret shorter than
    16 bytes (``openssl rand -hex 32`` makes a good one).
    """
    env = os.environ if env is None else env
    if secret_file:
        try:
            with open(secret_file, "rb") as f:
                secret = f.read().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read the rd2h secret file {secret_file!r}: {exc}") from None
        where = f"file {secret_file!r}"
    else:
        secret = env.get(SECRET_ENV, "").strip().encode()
        where = f"${SECRET_ENV}"
        if not secret:
            raise ConfigError(
                f"rd2h needs a secret shared by the proxy and the engines: set ${SECRET_ENV} (e.g. "
                f"`export {SECRET_ENV}=$(openssl rand -hex 32)`) or give secret_file / --secret-file"
            )
    if len(secret) < _MIN_SECRET_BYTES:
        raise ConfigError(f"the rd2h secret in {where} is {len(secret)} bytes; use at least {_MIN_SECRET_BYTES}")
    return secret


def _canonical(fields: Mapping[str, Any]) -> bytes:
    return json.dumps(fields, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def _mac(secret: bytes, payload: bytes) -> str:
    return hmac.new(secret, payload, hashlib.sha256).hexdigest()


def sign(secret: bytes, fields: Mapping[str, Any], now: float, ttl: float = DEFAULT_TTL) -> dict[str, Any]:
    """``fields`` with an expiry (``exp``, seconds since the epoch) and their signature (``sig``)."""
    signed = {k: v for k, v in fields.items() if k != "sig"}
    signed["exp"] = int(now + ttl)
    signed["sig"] = _mac(secret, _canonical(signed))
    return signed


def verify(secret: bytes, fields: object, now: float) -> dict[str, Any]:
    """``fields`` without ``sig`` when the signature is good and not expired; else VouchError."""
    if not isinstance(fields, Mapping):
        raise VouchError(f"expected an object, got {type(fields).__name__}")
    sig = fields.get("sig")
    if not isinstance(sig, str):
        raise VouchError("not signed by the proxy (no 'sig')")
    body = {k: v for k, v in fields.items() if k != "sig"}
    try:
        payload = _canonical(body)
    except (TypeError, ValueError) as exc:  # NaN, infinity, values JSON cannot hold
        raise VouchError(f"not canonical JSON: {exc}") from None
    except RecursionError:  # "[[[[...": a peer's or client's nesting, parsed just under the limit
        raise VouchError("nested too deeply to be signed fields") from None
    if not hmac.compare_digest(sig, _mac(secret, payload)):
        raise VouchError("the signature does not match (another secret, or fields changed)")
    exp = body.get("exp")
    if isinstance(exp, bool) or not isinstance(exp, int) or exp < now:
        raise VouchError(f"the signature expired (exp {exp!r})")
    return body


def token(secret: bytes, purpose: str) -> str:
    """A bearer token for one purpose (e.g. reading the proxy's request list), derived from
    the secret so that it can be handed out without the secret itself."""
    return _mac(secret, f"rd2h-token:{purpose}".encode())
