"""Running the proxy: the public listener (clients) and the internal one (engines' rendezvous,
operators' metrics and request list) in one process, one event loop, one shared state.

Slow clients cannot hold the proxy: a connection must send its request headers within
``header_timeout`` (uvicorn bounds the idle time between requests, not a request's headers),
a body must arrive within the same bound (:mod:`rd2h.proxy.app`), and connections past
``max_connections`` get 503. SIGTERM drains: health says ``draining`` (503), new requests
are refused with 503, requests in flight finish (up to ``drain_timeout``) while the internal
listener still hears their rendezvous; then both listeners close.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from rd2h.proxy.app import ProxyConfig
from rd2h.proxy.routes import create_apps

__all__ = ["Listen", "header_deadline_protocol", "serve"]

log = logging.getLogger("rd2h.proxy")

_TOO_SLOW = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


@dataclass(frozen=True)
class Listen:
    host: str = "127.0.0.1"
    port: int = 8000
    rendezvous_host: str = "127.0.0.1"
    rendezvous_port: int = 8001
    header_timeout: float = 10.0
    max_connections: int = 2048
    drain_timeout: float = 60.0
    log_level: str = "info"


def header_deadline_protocol(header_timeout: float) -> type[H11Protocol]:
    """uvicorn's HTTP/1.1 protocol, closing (408) a connection whose request headers are not
    complete ``header_timeout`` seconds after it opened or after its previous answer."""

    class HeaderDeadline(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not None and not self.cycle.response_complete:  # headers are in
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(header_timeout, self._too_slow)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _too_slow(self) -> None:
            self._deadline = None
            if self.cycle is None or self.cycle.response_complete:
                self.transport.write(_TOO_SLOW)
                self.transport.close()

    return HeaderDeadline


class _Server(uvicorn.Server):
    """A uvicorn server that leaves signals to :func:`serve` (two servers share one process)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve(config: ProxyConfig, listen: Listen) -> None:
    public_app, internal_app = create_apps(config)
    proxy = public_app.state.proxy
    protocol = header_deadline_protocol(listen.header_timeout)

    def server(app: Any, host: str, port: int) -> _Server:
        return _Server(uvicorn.Config(
            app, host=host, port=port, http=protocol, log_level=listen.log_level,
            limit_concurrency=listen.max_connections, timeout_graceful_shutdown=int(listen.drain_timeout),
        ))

    public = server(public_app, listen.host, listen.port)
    internal = server(internal_app, listen.rendezvous_host, listen.rendezvous_port)

    def drain() -> None:
        if not proxy.draining:
            log.warning("draining: %d request(s) in flight, new ones refused", len(proxy.pending))
        proxy.draining = True
        public.should_exit = True

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, drain)
    internal_task = asyncio.create_task(internal.serve())
    try:
        await public.serve()  # returns once drained (or failed to start)
    finally:
        internal.should_exit = True
        await internal_task
