"""A router that follows vLLM's own P/D convention step by step, as vLLM's example proxy
(``toy_proxy_server.py``) and the routers built on it do; it knows nothing of rd2h.

1. Prefill gets the client's request with ``max_tokens=1``, no streaming, and
   ``kv_transfer_params = {"do_remote_decode": true, ...}`` (the other fields None).
2. Prefill's answer carries ``kv_transfer_params``; the router takes them as they are.
3. Decode gets the client's request with those ``kv_transfer_params``; its answer is the
   client's.

``tamper`` changes the params between 2 and 3 (a router or client that alters them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx

# what vLLM's example proxy sends to Prefill
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}


class ConventionRouter:
    def __init__(self, prefill: str, decode: str, *, timeout: float = 240.0) -> None:
        self.prefill, self.decode = prefill, decode
        self._client = httpx.Client(timeout=timeout)
        self.last_params: dict[str, Any] | None = None  # what Prefill returned, for the tests

    def completions(self, body: dict[str, Any],
                    tamper: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> httpx.Response:
        prefill_body = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
        prefill_body.update(max_tokens=1, stream=False, kv_transfer_params=dict(PREFILL_PARAMS))
        answer = self._client.post(self.prefill + "/v1/completions", json=prefill_body)
        answer.raise_for_status()
        params = answer.json().get("kv_transfer_params")
        self.last_params = params
        decode_body = dict(body)
        if params:  # as the example proxy: forwarded as they are
            decode_body["kv_transfer_params"] = tamper(params) if tamper else params
        return self._client.post(self.decode + "/v1/completions", json=decode_body)

    def close(self) -> None:
        self._client.close()
