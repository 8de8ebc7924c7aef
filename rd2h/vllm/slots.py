"""Storage slots of vLLM's hybrid allocator on the worker: which layers view one slot, and
when a step has written it.

With several KV cache groups vLLM overlays them in one allocation: the i-th layer of each
group views the same bytes, each group using the block ids it owns. rd2h registers such a slot
once (read with every group's block ids, :func:`rd2h.vllm.kv_groups.gather_blocks`) and may
announce it only once every layer viewing it was saved in the step: announcing at the first
would let Decode read blocks another group's layer has not written yet.

A page's bytes are the stride between two blocks: vLLM pads every group's page to one size,
and a Mamba layer's view covers only the used part of it (``state_slots``: the slots that
hold a Mamba state group's layer, registered as whole pages and announced once the step's
forward ended: vLLM calls its connector's save hook for attention layers only).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rd2h.errors import ConfigError
from rd2h.vllm.kv_groups import GroupInfo, storage_slots

__all__ = ["SlotBook"]


def _page_bytes(tensor: Any, num_blocks: int) -> int:
    """Bytes from one block to the next of a block-first cache (its padding included); the
    bytes per block of any other."""
    shape = tuple(tensor.shape)
    if shape and shape[0] == num_blocks and num_blocks > 1:
        return int(tensor.stride(0)) * int(tensor.element_size())
    return int(tensor.nbytes) // max(1, num_blocks)


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
        state_layers = {n for info in groups if info.state for n in info.layers}
        self.state_slots: set[str] = set()
        for slot, names in storage_slots(storage, groups).items():
            pages = {(int(num_blocks[n]), _page_bytes(caches[n], int(num_blocks[n]))) for n in names}
            if len(pages) != 1:
                raise ConfigError(f"rd2h: layers {list(names)} share one KV cache allocation with different "
                                  f"pages (blocks, bytes per block): {sorted(pages)}")  # fmt: skip
            self.members[slot] = frozenset(names)
            if state_layers.intersection(names):
                self.state_slots.add(slot)
            self._slot_of.update(dict.fromkeys(names, slot))
        self._saved: dict[str, set[str]] = {}

    def __bool__(self) -> bool:
        return bool(self.members)

    def saved(self, layer_name: str) -> str | None:
        """Layer ``layer_name`` was written in this step: the slot it completes, if it does. A
        slot holding a Mamba layer completes only at the end of the forward (vLLM calls no save
        hook for a Mamba layer): never here."""
        slot = self._slot_of.get(layer_name)
        if slot is None or slot in self.state_slots:
            return None
        saved = self._saved.setdefault(slot, set())
        saved.add(layer_name)
        if saved != self.members[slot]:
            return None
        del self._saved[slot]
        return slot

    def new_step(self) -> None:
        self._saved = {}
