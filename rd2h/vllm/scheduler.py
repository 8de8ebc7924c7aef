"""The connector's scheduler side: which requests move, where, and when to say so.

Decode (``kv_consumer``): a request whose ``kv_transfer_params`` say ``do_remote_prefill``
reports its uncomputed prompt tokens as matched asynchronously (a local prefix-cache hit
is honoured: only the rest is pulled). Its destination blocks, per KV cache group, go to
the workers in the next step's metadata and never leave Decode. Only once that step came
back from every worker (their summed :class:`~rd2h.vllm.metadata.WorkerReport`) is the
rendezvous posted to the metaserver: Prefill must not announce what Decode does not expect.

Prefill (``kv_producer``): a ``do_remote_decode`` request's source blocks are sent to the
workers as vLLM allocates them, with the prompt tokens cached after each step;
``request_finished`` keeps the blocks until the workers report the request finished-sending,
which they do once every Decode rank replied (also for aborted requests).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rd2h.layout.topology import base_port
from rd2h.vllm.config import ConnectorConfig
from rd2h.vllm.metadata import (
    WORKER_REPORTS,
    Groups,
    RecvSpec,
    SendBlocks,
    SendFinish,
    SendSpec,
    StepMetadata,
    WorkerReport,
)
from rd2h.vllm.rendezvous import RendezvousPoster, child_index, ext_id_of
from rd2h.wire.endpoint import DecodeEndpoint

__all__ = ["PARAMS_KEY", "RD2HScheduler"]

log = logging.getLogger("rd2h.vllm.scheduler")

PARAMS_KEY = "rd2h"  # our part of kv_transfer_params: {"id", "children", "metaserver" | "targets"}


def _groups(blocks: Any) -> Groups:
    """Block ids per KV cache group from vLLM's KVCacheBlocks or a tuple of lists."""
    ids = blocks.get_block_ids() if hasattr(blocks, "get_block_ids") else blocks
    return tuple(tuple(int(b) for b in group) for group in ids)


def _blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


@dataclass
class _Recv:
    ext_id: str
    url: str | None
    body: dict[str, Any]
    posted: bool = False
    # a vLLM without worker reports: the step that carried it came back (on every worker:
    # vLLM gathers all workers' outputs before this update)
    sent_to_workers: bool = False
    # workers that said they expect it, summed over steps: a worker's report may come back
    # with a later step than another's, and a per-step count would then never reach the world
    reported: int = 0


@dataclass
class _Send:
    ext_id: str
    endpoint: str
    first_block: int
    num_tokens: int
    started: bool = False  # its first blocks went to the workers
    done: bool = False  # every prompt token was scheduled
    pending: list[Groups] = field(default_factory=list)


class RD2HScheduler:
    """Scheduler-side state of one engine. ``block_sizes``: tokens per block of each KV
    cache group; ``world_size``: workers that must know a destination before it is posted."""

    def __init__(
        self,
        config: ConnectorConfig,
        *,
        consumer: bool,
        producer: bool,
        block_sizes: Sequence[int],
        tp_size: int,
        dp_rank: int = 0,
        world_size: int = 1,
        poster: RendezvousPoster | None = None,
    ) -> None:
        self.config = config
        self.consumer, self.producer = consumer, producer
        self.block_sizes = tuple(block_sizes)
        self.world_size = world_size
        self.endpoint = DecodeEndpoint(config.advertised, base_port(config.kv_port, dp_rank, tp_size), tp_size)
        self._poster = poster if poster is not None or not consumer else RendezvousPoster(
            retries=config.metaserver_retries
        )
        self._recv: dict[str, _Recv] = {}  # req id -> waiting for KV
        self._recv_new: list[RecvSpec] = []
        self._recv_abort: list[str] = []
        self._send: dict[str, _Send] = {}  # req id -> being sent
        self._send_finish: list[SendFinish] = []
        self.stats = {"pulled_tokens": 0, "prefix_hit_tokens": 0, "rendezvous": 0}

    # -- Decode --------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        params = _params(request)
        if not (self.consumer and params.get("do_remote_prefill")):
            return 0, False
        ours = _ours(params, request.request_id, "metaserver")
        if ours is None:
            return 0, False
        if not (ours.get("metaserver") or self.config.metaserver):
            log.error("request %s: no metaserver to post its rendezvous to; computed here", request.request_id)
            return 0, False
        count = len(request.prompt_token_ids or ()) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = _params(request)
        if self.producer and params.get("do_remote_decode") and PARAMS_KEY in params:
            self._track_send(request, params)
        if not (self.consumer and params.get("do_remote_prefill") and num_external_tokens > 0):
            return
        ours = params[PARAMS_KEY]
        ext_id = ext_id_of(ours, request.request_id)
        num_tokens = len(request.prompt_token_ids)
        local = num_tokens - num_external_tokens  # a block-aligned local prefix-cache hit
        first_block = local // self.block_sizes[0]
        groups = tuple(
            g[: _blocks_for(num_tokens, size)] for g, size in zip(_groups(blocks), self.block_sizes)
        )
        self._recv_new.append(RecvSpec(ext_id, request.request_id, groups, first_block, num_tokens))
        body = {
            "id": ours["id"], "child": child_index(ours, request.request_id), "ext_id": ext_id,
            "endpoint": str(self.endpoint), "first_block": first_block, "num_tokens": num_tokens,
            "decode_tp": self.endpoint.tp_size, "block_size": self.block_sizes[0], "mode": self.config.mode.value,
        }
        self._recv[request.request_id] = _Recv(ext_id, ours.get("metaserver") or self.config.metaserver, body)
        self.stats["pulled_tokens"] += num_external_tokens
        self.stats["prefix_hit_tokens"] += local
        # consumed: a second allocation for this request (after the load) must not pull again
        request.kv_transfer_params = {**params, "do_remote_prefill": False}

    def update_connector_output(self, output: Any) -> None:
        report = getattr(output, "kv_connector_worker_meta", None)
        expected = report.expected if isinstance(report, WorkerReport) else {}
        for req_id in list(output.finished_recving or ()):
            self._recv.pop(req_id, None)
        for recv in self._recv.values():
            if recv.posted:
                continue
            recv.reported += expected.get(recv.ext_id, 0)
            if recv.reported >= self.world_size or (not WORKER_REPORTS and recv.sent_to_workers):
                recv.posted = True
                self._post(recv)

    def _post(self, recv: _Recv) -> None:
        if recv.url is None:
            log.error("request %s: no metaserver to post its rendezvous to", recv.ext_id)
            return
        assert self._poster is not None
        self.stats["rendezvous"] += 1
        self._poster.submit(recv.ext_id, recv.url, recv.body)

    # -- Prefill -------------------------------------------------------------------------

    def _track_send(self, request: Any, params: Mapping[str, Any]) -> None:
        if request.request_id in self._send:
            return
        ours = _ours(params, request.request_id, "targets")
        if ours is None:  # computed as asked, nothing sent: Decode fails it on its deadline
            return
        target = ours["targets"][str(child_index(ours, request.request_id))]
        self._send[request.request_id] = _Send(
            ext_id_of(ours, request.request_id), target["endpoint"], int(target.get("first_block", 0)),
            len(request.prompt_token_ids),
        )

    def build_connector_meta(self, scheduler_output: Any) -> StepMetadata:
        send_new: list[SendSpec] = []
        send_blocks: list[SendBlocks] = []
        computed: list[tuple[str, int]] = []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            send = self._send.get(new.req_id)
            if send is None or send.started:
                continue
            send.started = True
            send_new.append(
                SendSpec(send.ext_id, new.req_id, send.endpoint, _groups(new.block_ids), send.num_tokens, send.first_block)
            )
            computed.append(self._computed(send, new.num_computed_tokens + scheduled.get(new.req_id, 0)))
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", None) or set()
        send_abort: list[str] = []
        for i, req_id in enumerate(cached.req_ids):
            send = self._send.get(req_id)
            if send is None or send.done or not send.started:
                continue
            if req_id in resumed:
                # preempted: vLLM freed its blocks and gives it new ones; what was announced
                # is gone. Stop it (Decode fails it); its blocks are vLLM's to free again.
                log.error("request %s was preempted while its KV was being sent; it fails", send.ext_id)
                del self._send[req_id]
                send_abort.append(send.ext_id)
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None and any(new_ids):
                send_blocks.append(SendBlocks(send.ext_id, _groups(new_ids)))
            computed.append(self._computed(send, cached.num_computed_tokens[i] + scheduled.get(req_id, 0)))
        for spec in self._recv_new:
            recv = self._recv.get(spec.req_id)
            if recv is not None:
                recv.sent_to_workers = True
        meta = StepMetadata(
            recv=tuple(self._recv_new), recv_abort=tuple(self._recv_abort), send_new=tuple(send_new),
            send_blocks=tuple(send_blocks), computed=tuple(computed), send_finish=tuple(self._send_finish),
            send_abort=tuple(send_abort), idle=not scheduler_output.total_num_scheduled_tokens,
        )
        self._recv_new, self._recv_abort, self._send_finish = [], [], []
        return meta

    @staticmethod
    def _computed(send: _Send, tokens: int) -> tuple[str, int]:
        tokens = min(tokens, send.num_tokens)
        send.done = tokens >= send.num_tokens
        return send.ext_id, tokens

    # -- both ----------------------------------------------------------------------------

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        recv = self._recv.pop(req_id, None)
        if recv is not None:  # finished while its KV was awaited: stop the pull
            if not recv.posted and self._poster is not None:
                self._poster.cancel(recv.ext_id)
            self._recv_abort.append(recv.ext_id)
            # vLLM itself holds the blocks of a WAITING_FOR_REMOTE_KVS request until the
            # workers report it finished-receiving, which they do once the pull stopped.
            return False, None
        send = self._send.pop(req_id, None)
        if send is None:
            return False, None
        if not send.started:  # never reached a worker: nothing reads its blocks
            return False, None
        aborted = not send.done or "ABORTED" in str(getattr(request, "status", ""))
        self._send_finish.append(SendFinish(send.ext_id, req_id, aborted))
        return True, None

    def shutdown(self) -> None:
        if self._poster is not None:
            self._poster.close()


def _params(request: Any) -> Mapping[str, Any]:
    return getattr(request, "kv_transfer_params", None) or {}


def _ours(params: Mapping[str, Any], req_id: str, needs: str) -> Mapping[str, Any] | None:
    """Our part of a request's ``kv_transfer_params`` when it is well formed, else None
    (logged): a client's malformed parameters must never raise inside vLLM's scheduler."""
    ours = params.get(PARAMS_KEY)
    try:
        if not isinstance(ours, Mapping) or not isinstance(ours.get("id"), str):
            raise TypeError(f"{PARAMS_KEY!r} must be an object with a string 'id'")
        child = child_index(ours, req_id)
        if needs == "targets":
            target = ours["targets"][str(child)]
            DecodeEndpoint.parse(target["endpoint"])
            int(target.get("first_block", 0))
        elif needs == "metaserver" and not isinstance(ours.get("metaserver", ""), str):
            raise ValueError("'metaserver' must be a URL")
    except (KeyError, TypeError, ValueError) as exc:
        log.error("request %s: ignoring malformed kv_transfer_params %r: %s", req_id, params.get(PARAMS_KEY), exc)
        return None
    return ours

