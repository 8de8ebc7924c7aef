"""``RD2HTraceConnector``: RD2HConnector recording when each request passes each hook (a measuring tool).

``bench/vllm_pd.py`` loads it into both engines (``"kv_connector": "RD2HTraceConnector",
"kv_connector_module_path": "pd_trace"``, ``bench/`` on PYTHONPATH) with ``RD2H_PD_TRACE_DIR``
set: every engine process appends one JSON line per event to ``<dir>/<pid>.jsonl``,
``{"t": time.monotonic(), "ev": name, "id": vLLM's request id, ...}``. CLOCK_MONOTONIC is one
clock for every process on the host, so these line up with the proxy's marks
(``GET /v1/rd2h/requests``, ``"t"``) and the client's. Without ``RD2H_PD_TRACE_DIR`` it is
RD2HConnector. It wraps public hooks and a few private names of the runtimes (as
``bench/trace_layer.py`` does); it follows them, it is not an API.

Events, in the order a P/D request meets them:

- Decode scheduler: ``matched`` (the engine core first looks at the request), ``alloc``
  (blocks allocated, RecvSpec made), ``posted`` (its rendezvous goes to the poster thread),
  ``delivered`` (the proxy answered the post), ``recv_done`` (a step reported it
  finished-receiving), ``compute`` (the step that computes its last prompt token begins),
  ``step_end`` (that step's output, the first token, is back in the scheduler).
- Decode worker: ``expect`` (the sink expects it), ``layer>``/``layer<`` (the sink's loop
  handles a layer's readiness: validate, read, reply; ``layer`` is its index), ``taken``
  (its outcome collected: finished-receiving goes out with this step).
- Prefill scheduler (also the one-engine arm's requests): ``matched``, ``compute`` (each step
  that schedules it: ``tokens``), ``step_end`` (the end of such a step, where vLLM hands the
  connector the step's output), ``finished``.
- Prefill worker: ``announce`` (``save_kv_layer``: a layer announced, ``layer``), ``sent``
  (every Decode replied: finished-sending).
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

from rd2h.vllm.connector import RD2HConnector
from rd2h.vllm.worker import RD2HWorker

__all__ = ["RD2HTraceConnector", "TracedWorker"]

_DIR = os.environ.get("RD2H_PD_TRACE_DIR")


class _Trace:
    """One process's event file, line-buffered; every call under one lock (the sink's loop,
    the poster's thread and vLLM's thread all record)."""

    def __init__(self, directory: str | None) -> None:
        self._lock = threading.Lock()
        self._file = None
        if directory:
            os.makedirs(directory, exist_ok=True)
            self._file = open(os.path.join(directory, f"{os.getpid()}.jsonl"), "a", buffering=1)  # noqa: SIM115

    def __call__(self, ev: str, rid: str | None = None, **extra: Any) -> None:
        if self._file is None:
            return
        line = json.dumps({"t": time.monotonic(), "ev": ev, "id": rid, **extra})
        with self._lock:
            self._file.write(line + "\n")


TRACE = _Trace(_DIR)


def _patch_runtimes() -> None:
    """The poster's delivery and the sink's per-layer handling, recorded (private names)."""
    from rd2h.decode.layer_read import LayerReader
    from rd2h.vllm.rendezvous import RendezvousPoster

    deliver = RendezvousPoster._deliver

    def traced_deliver(self: Any, item: Any) -> str:
        outcome = deliver(self, item)
        TRACE("delivered", None, ext=item.ext_id, outcome=outcome)
        return outcome

    RendezvousPoster._deliver = traced_deliver  # type: ignore[method-assign]

    on_ready = LayerReader.on_ready

    def traced_on_ready(self: Any, identity: bytes, message: Any) -> Any:
        exts = [str(getattr(r, "ext_req_id", "")) for r in getattr(message, "read_reqs", ())]
        TRACE("layer>", None, layer=getattr(message, "layer_idx", None), exts=exts)
        try:
            return on_ready(self, identity, message)
        finally:
            TRACE("layer<", None, layer=getattr(message, "layer_idx", None), exts=exts)

    LayerReader.on_ready = traced_on_ready  # type: ignore[method-assign]


if _DIR:
    _patch_runtimes()


class TracedWorker(RD2HWorker):
    def bind(self, meta: Any) -> None:
        fresh = meta is not self._bound
        super().bind(meta)
        if fresh:
            for spec in getattr(meta, "recv", ()):
                TRACE("expect", spec.req_id, ext=spec.ext_id)

    def transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        sending, recving, failed = super().transfer_results()
        for req_id in recving:
            TRACE("taken", req_id, failed=req_id in failed)
        for req_id in sending:
            TRACE("sent", req_id)
        return sending, recving, failed

    def save_layer(self, layer_name: str, kv_layer: Any) -> None:
        if self._sends and layer_name in self._tensors:
            TRACE("announce", None, layer=layer_name)
        super().save_layer(layer_name, kv_layer)


class RD2HTraceConnector(RD2HConnector):
    """RD2HConnector with every request's passage through the scheduler hooks recorded."""

    worker_class = TracedWorker

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._seen: set[str] = set()
        self._awaited: set[str] = set()  # Decode: finished receiving, its compute step not begun
        self._ending: set[str] = set()  # requests whose step ends at the next output
        if self._scheduler is not None and _DIR:
            post = self._scheduler._post

            def traced_post(recv: Any) -> None:
                TRACE("posted", None, ext=recv.ext_id)
                post(recv)

            self._scheduler._post = traced_post  # type: ignore[method-assign]

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        result = super().get_num_new_matched_tokens(request, num_computed_tokens)
        rid = request.request_id
        if rid not in self._seen:
            self._seen.add(rid)
            TRACE("matched", rid, tokens=len(request.prompt_token_ids or ()), external=result[0],
                  ext=self.scheduler._claimed.get(rid))
        return result

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        if num_external_tokens:
            TRACE("alloc", request.request_id, external=num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        for rid, tokens in scheduler_output.num_scheduled_tokens.items():
            if rid in self._awaited or self.scheduler.producer:
                self._awaited.discard(rid)
                self._ending.add(rid)
                TRACE("compute", rid, tokens=tokens)
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        for rid in self._ending:
            TRACE("step_end", rid)
        self._ending.clear()
        for rid in connector_output.finished_recving or ():
            self._awaited.add(rid)
            TRACE("recv_done", rid)
        super().update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        TRACE("finished", request.request_id)
        self._seen.discard(request.request_id)
        return super().request_finished(request, block_ids)

    def request_finished_all_groups(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        TRACE("finished", request.request_id)
        self._seen.discard(request.request_id)
        return super().request_finished_all_groups(request, block_ids)
