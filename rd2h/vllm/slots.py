"""Storage slots of vLLM's hybrid allocator on the worker: which layers view one slot, and
when a step has written it.

With several KV cache groups vLLM overlays them in one allocation: the i-th layer of each
group views the same bytes, each group using the block ids it owns. rd2h registers such a slot
once (read with every group's block ids, :func:`rd2h.vllm.kv_groups.gather_blocks`) and may
announce it only once every layer viewing it was saved in the step: announcing at the first
would let Decode read blocks another group's layer has not written yet.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rd2h.errors import ConfigError
from rd2h.vllm.kv_groups import GroupInfo, storage_slots

__all__ = ["SlotBook"]


class SlotBook:
    """The slots of the pulled groups' layers. Raises ConfigError where a pulled group's layer
    has no registered cache (its KV would not move) or the layers viewing one slot page it
    differently (block count or bytes per block)."""

    def __init__(self, caches: Mapping[str, Any], num_blocks: Mapping[str, int], groups: Sequence[GroupInfo]) -> None:
        storage = {name: int(t.data_ptr()) for name, t in caches.items()}
        missing = sorted(n for info in groups for n in info.layers if n not in storage)
        if missing:
            raise ConfigError(f"rd2h: {len(missing)} layers of pulled KV cache groups have no registered cache "
                              f"({', '.join(missing[:4])}): their KV would not be pulled")  # fmt: skip
        self.members: dict[str, frozenset[str]] = {}
        self._slot_of: dict[str, str] = {}
        for slot, names in storage_slots(storage, groups).items():
            pages = {(int(num_blocks[n]), int(caches[n].nbytes) // max(1, int(num_blocks[n]))) for n in names}
            if len(pages) != 1:
                raise ConfigError(f"rd2h: layers {list(names)} share one KV cache allocation with different "
                                  f"pages (blocks, bytes per block): {sorted(pages)}")  # fmt: skip
            self.members[slot] = frozenset(names)
            self._slot_of.update(dict.fromkeys(names, slot))
        self._saved: dict[str, set[str]] = {}

    def __bool__(self) -> bool:
        return bool(self.members)

    def saved(self, layer_name: str) -> str | None:
        """Layer ``layer_name`` was written in this step: the slot it completes, if it does."""
        slot = self._slot_of.get(layer_name)
        if slot is None:
            return None
        saved = self._saved.setdefault(slot, set())
        saved.add(layer_name)
        if saved != self.members[slot]:
            return None
        del self._saved[slot]
        return slot

    def new_step(self) -> None:
        self._saved = {}
