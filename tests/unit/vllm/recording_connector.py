"""A second connector for vLLM's ``MultiConnector`` in the composition tests: it records every
hook vLLM calls on it in :data:`CALLS` (shared with the spies the tests put on rd2h's side), and
reports what its ``kv_connector_extra_config`` says: ``hit`` tokens matched (loaded at once, as a
storage connector with the prompt would), ``params`` as its ``kv_transfer_params``.

Loaded with ``"kv_connector": "RecordingConnector", "kv_connector_module_path":
"recording_connector"``. :class:`SubclassedRD2H` is rd2h's connector under a name of a test's own,
as ``kv_connector_module_path`` loads one (tests/kit/vllm's connector is such a subclass).

Importing it also puts tests/unit on the path, for the kit the tests here share (vllm_kit.py)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata

from rd2h.vllm.connector import RD2HConnector

UNIT = str(Path(__file__).resolve().parents[1])
if UNIT not in sys.path:
    sys.path.append(UNIT)

CALLS: list[tuple[str, ...]] = []  # (who, hook, detail)


class RecordingConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        self.hit, self.params = int(extra.get("hit", 0)), extra.get("params")
        self.allocated: dict[str, tuple[int, list[list[int]]]] = {}  # req -> (external tokens, blocks)

    def _note(self, hook: str, detail: str = "") -> None:
        CALLS.append(("other", hook, detail))

    # worker side
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._note("register_kv_caches", str(len(kv_caches)))

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._note("start_load_kv")

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._note("wait_for_layer_load", layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        self._note("save_kv_layer", layer_name)

    def wait_for_save(self) -> None:
        self._note("wait_for_save")

    # scheduler side
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return max(0, self.hit - num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.allocated[request.request_id] = (num_external_tokens, [list(g) for g in blocks.get_block_ids()])

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return False, None if self.params is None else dict(self.params)


class SubclassedRD2H(RD2HConnector):
    """rd2h's connector under another class name."""
