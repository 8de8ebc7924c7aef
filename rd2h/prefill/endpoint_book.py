"""The Decode endpoints one Prefill rank knows, bounded (pure: time comes in as ``now``).

Prefill dials every Decode address a request names and keeps a record for it (its state, the
readiness it owes replies to) and, in the dialer, a socket. Decodes come and go (a proxy
routes to whichever is up), so without a bound both grow with every address ever dialled.
:class:`EndpointBook` forgets an endpoint that is *unused*: no live request names it and it
owes no reply. An unused endpoint is forgotten

- once it has been unused for ``idle_seconds``, or
- while more than ``max_endpoints`` are known, least recently used first, once it has been
  unused for ``grace_seconds`` (the reply timeout: the notices queued for it had that long
  to leave before its connection is closed).

A forgotten endpoint named again is dialled again from scratch: a new connection, ``mf_meta``
first. One that was abandoned (SILENT, or revived and not yet acknowledged) may still answer
readiness of the old connection on the new one (the dialer keeps its identity), so it comes
back as SILENT and is revived, whose replies before the new ACK are dropped as stale: a
bounded memory of such addresses (``max_endpoints`` of them) keeps that true.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import ItemsView, ValuesView

from rd2h.errors import ConfigError
from rd2h.prefill.send_states import STALE, EndpointState
from rd2h.prefill.send_steps import EndpointRecord

__all__ = ["EndpointBook"]

_UNSETTLED = STALE | {EndpointState.SILENT}  # replies of an old connection may still come


class EndpointBook:
    """Endpoint records by address, least recently used first. Raises ConfigError on bad bounds."""

    def __init__(self, *, idle_seconds: float, max_endpoints: int, grace_seconds: float) -> None:
        if isinstance(idle_seconds, bool) or not isinstance(idle_seconds, (int, float)) or not idle_seconds > 0:
            raise ConfigError(f"endpoint_idle_seconds must be a positive number, got {idle_seconds!r}")
        if isinstance(max_endpoints, bool) or not isinstance(max_endpoints, int) or max_endpoints < 1:
            raise ConfigError(f"max_endpoints must be a positive int, got {max_endpoints!r}")
        self.idle_seconds, self.max_endpoints = float(idle_seconds), max_endpoints
        self._grace = min(float(grace_seconds), self.idle_seconds)
        self._records: OrderedDict[str, EndpointRecord] = OrderedDict()
        self._unsettled: OrderedDict[str, None] = OrderedDict()  # forgotten while replies may come
        self.forgotten = 0  # endpoints forgotten over the book's life

    def __len__(self) -> int:
        return len(self._records)

    def get(self, address: str) -> EndpointRecord | None:
        return self._records.get(address)

    def __getitem__(self, address: str) -> EndpointRecord:
        return self._records[address]

    def items(self) -> ItemsView[str, EndpointRecord]:
        return self._records.items()

    def values(self) -> ValuesView[EndpointRecord]:
        return self._records.values()

    def named(self, address: str, now: float) -> EndpointRecord:
        """A new request names ``address``: its record (made if unknown), used by one more request."""
        record = self._records.get(address)
        if record is None:
            unsettled = address in self._unsettled
            self._unsettled.pop(address, None)
            record = self._records[address] = EndpointRecord(EndpointState.SILENT if unsettled else EndpointState.NEW)
        record.users += 1
        self.touch(address, record, now)
        return record

    def released(self, address: str) -> None:
        """A request naming ``address`` settled."""
        self._records[address].users -= 1

    def touch(self, address: str, record: EndpointRecord, now: float) -> None:
        """``address`` was used now (a readiness sent, a reply received)."""
        record.last_used = now
        self._records.move_to_end(address)

    def forget_unused(self, now: float) -> list[str]:
        """Forget what the bounds say; the addresses forgotten (their connections to close)."""
        excess = len(self._records) - self.max_endpoints
        chosen: list[str] = []
        for address, record in self._records.items():  # least recently used first
            idle = now - record.last_used
            if idle < self._grace or (excess <= 0 and idle < self.idle_seconds):
                break  # every later record was used more recently
            if record.users or record.in_flight:
                continue  # in use: never forgotten
            chosen.append(address)
            excess -= 1
        for address in chosen:
            record = self._records.pop(address)
            if record.state in _UNSETTLED:
                self._unsettled[address] = None
                if len(self._unsettled) > self.max_endpoints:
                    self._unsettled.popitem(last=False)
        self.forgotten += len(chosen)
        return chosen
