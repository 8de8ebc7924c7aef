"""How settled requests are told to the Decode endpoints that heard of them (Prefill, pure).

A ``settled`` message needs no reply. DONE confirms what Decode read: Decode reports DONE
only then, so both sides agree. FAILED and ABORTED let Decode fail the request at once
instead of at its deadline. Notices are gathered per endpoint and per distinct error, so one
frame names every request that ended the same way since the last :meth:`take`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from rd2h.errors import RD2HError, wire_kind
from rd2h.outcome import TerminalState
from rd2h.wire import protocol

__all__ = ["SettledNotices"]


@dataclass(slots=True)
class _Pending:
    done: list[str] = field(default_factory=list)
    failed: dict[tuple[str, str], list[str]] = field(default_factory=dict)  # (error, kind) -> ids


class SettledNotices:
    """Notices not yet sent, by endpoint address."""

    def __init__(self) -> None:
        self._pending: dict[str, _Pending] = {}

    def settled(self, ext_id: str, terminal: TerminalState, error: RD2HError | None, addresses: Iterable[str]) -> None:
        """``ext_id`` ended ``terminal``: tell each of ``addresses``. The caller names every
        endpoint that knows this Prefill, a SILENT one too: a Decode that was only stopped
        still holds this Prefill's mf_meta and may read the readiness queued before it
        stopped; told, it fails the request instead of waiting for its deadline."""
        if terminal is TerminalState.FAILED and error is not None:
            key = (str(error), wire_kind(error))
        else:
            key = (f"request {ext_id!r} was aborted on Prefill", "StateError")
        for address in addresses:
            pending = self._pending.setdefault(address, _Pending())
            if terminal is TerminalState.DONE:
                pending.done.append(ext_id)  # every endpoint answered: all listening
            else:
                pending.failed.setdefault(key, []).append(ext_id)

    def take(self) -> list[tuple[str, bytes]]:
        """``(address, settled frame)`` for everything noted since the last call (consumed)."""
        frames = []
        for address, pending in self._pending.items():
            if pending.done:
                frames.append((address, protocol.encode(protocol.Settled(tuple(pending.done)))))
            for (error, kind), ids in pending.failed.items():
                frames.append((address, protocol.encode(protocol.Settled((), tuple(ids), error, kind))))
        self._pending.clear()
        return frames
