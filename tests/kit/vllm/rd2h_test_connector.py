"""``RD2HTestConnector``: RD2HConnector with two hooks the end-to-end tests need (test-only).

The engines of a test load it with ``"kv_connector": "RD2HTestConnector",
"kv_connector_module_path": "rd2h_test_connector"`` (``tests/kit/vllm`` on PYTHONPATH);
rd2h itself carries no test hook. The hooks are switched on by the engine's environment:

- ``RD2H_TEST_CORRUPT=1`` (Decode): every block a request received is overwritten with noise
  once it is DONE, the negative control that proves the tokens depend on the transfer.
- ``RD2H_TEST_HOLD_FILE=PATH`` (Prefill): the first step that adds a request touches
  ``PATH.held`` and then holds (``RD2H_TEST_HOLD_SECONDS``, default 120) so a test can kill
  the engine with a request in hand. With ``RD2H_TEST_HOLD_LAYER=K`` it holds instead before
  announcing layer K of a step that sends, layers 0..K-1 announced: killed mid-transfer.
  Once the hold ends it touches ``PATH.released``.
- ``RD2H_TEST_FAIL_READS=1`` (Decode): every batched read of the transfer engine raises, as
  a dead link would: the sink fails the requests and vLLM's ``kv_load_failure_policy`` decides.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from typing import Any

from rd2h.errors import TransferError
from rd2h.outcome import Outcome
from rd2h.vllm.connector import RD2HConnector
from rd2h.vllm.metadata import StepMetadata
from rd2h.vllm.worker import RD2HWorker

__all__ = ["HookedWorker", "RD2HTestConnector"]


class HookedWorker(RD2HWorker):
    """RD2HWorker with the corruption and hold hooks (arguments default to the environment)."""

    def __init__(self, *args: Any, corrupt: bool | None = None, hold_file: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.corrupt = os.environ.get("RD2H_TEST_CORRUPT") == "1" if corrupt is None else corrupt
        self.hold_file = os.environ.get("RD2H_TEST_HOLD_FILE") if hold_file is None else hold_file
        self.fail_reads = os.environ.get("RD2H_TEST_FAIL_READS") == "1"
        layer = os.environ.get("RD2H_TEST_HOLD_LAYER")
        self.hold_layer = None if layer is None else int(layer)
        self._received: dict[str, tuple[int, tuple[int, ...]]] = {}  # ext id -> (first block, main blocks)
        self._held = False

    def register(self, kv_caches: Mapping[str, Any], num_blocks: Mapping[str, int]) -> None:
        super().register(kv_caches, num_blocks)
        self._hold_on_the_source()
        if self.sink is not None and self.fail_reads:
            def fail(*_: Any) -> None:
                raise TransferError("test hook: the read failed")

            self.sink._engine.read_batch = fail  # the engine object the sink's reader calls
        if self.sink is not None and self.corrupt:
            take = self.sink.take

            def take_and_corrupt() -> dict[str, Outcome]:
                outcomes = take()
                for ext_id, outcome in outcomes.items():
                    where = self._received.pop(ext_id, None)
                    if outcome.ok and where is not None:
                        self._corrupt(*where)
                return outcomes

            self.sink.take = take_and_corrupt

    def _apply_recv(self, meta: StepMetadata) -> None:
        for spec in meta.recv:
            self._received[spec.ext_id] = (spec.first_block, spec.blocks[0])
        super()._apply_recv(meta)

    def _apply_send(self, meta: StepMetadata) -> None:
        if meta.send_new and self.hold_layer is None:
            self._hold()
        super()._apply_send(meta)

    def _hold_on_the_source(self) -> None:
        if self.source is not None and self.hold_layer is not None:
            # on the source: as a step computes (save_layer) and when targets that came late
            # announce the layers written before them at once (send_all)
            ready = self.source.layer_ready

            def hold_then_ready(layer_name: str, event: Any = None) -> None:
                if layer_name in self._tensors and list(self._tensors).index(layer_name) == self.hold_layer:
                    self._hold()
                ready(layer_name, event)

            self.source.layer_ready = hold_then_ready

    def _corrupt(self, first_block: int, blocks: tuple[int, ...]) -> None:
        import torch

        ids = torch.tensor(blocks[first_block:], dtype=torch.long)
        for layer in self._tensors.values():
            for tensor in layer.main:
                tensor[ids] = torch.randn(tensor[ids].shape, dtype=torch.float32).to(tensor.dtype)

    def _hold(self) -> None:
        if self.hold_file is None or self._held:
            return
        self._held = True
        with open(f"{self.hold_file}.held", "w"):
            pass
        threading.Event().wait(float(os.environ.get("RD2H_TEST_HOLD_SECONDS", "120")))
        with open(f"{self.hold_file}.released", "w"):
            pass


class RD2HTestConnector(RD2HConnector):
    worker_class = HookedWorker
