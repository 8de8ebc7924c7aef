"""The storage-slot gate: :class:`~rd2h.prefill.slots.SlotTable` behind one Condition, so the compute
path can wait for a slot while the sender thread reports replies (runtime, not pure: threads)."""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable, Iterable

from rd2h.errors import ConfigError
from rd2h.layout.layers import LayerLayout
from rd2h.prefill.slots import LayerState, SlotState, SlotTable

__all__ = ["SlotGate", "slot_keys"]


def slot_keys(layout: LayerLayout) -> tuple[tuple[str, int], ...]:
    """The storage slots a layer writes, keyed by storage address: its main slot, and its
    indexer's if it has one (layers that share a physical buffer share its slots)."""
    main = ("main", layout.main_slot)
    return (main,) if layout.indexer_slot is None else (main, ("indexer", layout.indexer_slot))


class SlotGate:
    """:class:`SlotTable` made safe across threads: the compute path ``wait``s, the
    background sender reports ``sent``/``replied``."""

    def __init__(self) -> None:
        self._table = SlotTable()
        self._cond = threading.Condition()

    def claim(self, layer_idx: int, slots: Iterable[Hashable]) -> None:
        with self._cond:
            self._table.claim(layer_idx, slots)

    def sent(self, layer_idx: int, endpoints: Iterable[Hashable]) -> bool:
        with self._cond:
            return self._notify(self._table.sent(layer_idx, endpoints))

    def replied(self, layer_idx: int, endpoint: Hashable) -> bool:
        with self._cond:
            return self._notify(self._table.replied(layer_idx, endpoint))

    def free(self, slots: Iterable[Hashable]) -> bool:
        """Whether every slot is FREE now (never blocks)."""
        with self._cond:
            return self._table.check(tuple(slots))

    def wait(self, slots: Iterable[Hashable], timeout: float) -> None:
        """Block until every slot is FREE.

        Raises GateTimeout after ``timeout`` seconds (0 polls once). A layer whose readers
        failed frees its slots like any other: the requests it failed are reported by the
        send tracker, never raised here.
        """
        if not timeout >= 0:
            raise ConfigError(f"timeout must be >= 0 seconds, got {timeout!r}")
        keys = tuple(slots)
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._table.check(keys):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise self._table.timeout_error(keys, timeout)
                self._cond.wait(remaining)

    def state(self, slot: Hashable) -> SlotState:
        with self._cond:
            return self._table.state(slot)

    def owner(self, slot: Hashable) -> int | None:
        with self._cond:
            return self._table.owner(slot)

    def layer_state(self, layer_idx: int) -> LayerState:
        with self._cond:
            return self._table.layer_state(layer_idx)

    def pending(self, layer_idx: int) -> frozenset[Hashable]:
        with self._cond:
            return self._table.pending(layer_idx)

    @property
    def stray_replies(self) -> int:
        with self._cond:
            return self._table.stray_replies

    def _notify(self, released: bool) -> bool:
        if released:
            self._cond.notify_all()
        return released
