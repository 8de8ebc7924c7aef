"""``rd2h proxy``: an OpenAI-compatible front for Prefill and Decode vLLM engines, with the
metaserver through which Decode tells Prefill where a request's KV must go.

Decode first: each request goes to a Decode engine with ``do_remote_prefill``; Decode
allocates the destination blocks and posts its rendezvous to the metaserver; once every
child of the request (an OpenAI prompt list expands into one engine request per prompt)
has posted, the original request goes to a Prefill engine once, with ``max_tokens=1`` and
``do_remote_decode`` naming each child's Decode endpoint. Needs the ``[proxy]`` extra.
"""

from rd2h.proxy.app import ProxyConfig
from rd2h.proxy.routes import create_apps

__all__ = ["ProxyConfig", "create_apps"]
