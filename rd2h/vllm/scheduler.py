"""The connector's scheduler side: which requests move, where, and when to say so.

rd2h's part of a request's ``kv_transfer_params`` is accepted only when the proxy signed it
(:mod:`rd2h.vllm.params`); anything else is served as a plain local request, logged and
counted in ``stats["refused_params"]``. Nothing a client sends raises out of a hook.

Decode (``kv_consumer``): a request whose ``kv_transfer_params`` say ``do_remote_prefill``
reports its uncomputed prompt tokens as matched asynchronously (a local prefix-cache hit
is honoured: only the rest is pulled). Each engine request is pulled under an id of its own;
a second live request claiming one (a replay) is served locally. The samples of ``n > 1``
share their prompt's blocks in vLLM's prefix cache: sample 0 pulls them, the others wait
(``None``: not schedulable yet) until that pull ended, then find them as a local hit and
compute only the last partial block. Its destination blocks, per KV cache group, go to
the workers in the next step's metadata and never leave Decode. Only once that step came
back from every worker (their summed :class:`~rd2h.vllm.metadata.WorkerReport`) is the
rendezvous posted to the configured metaserver (never a URL a request names): Prefill must
not announce what Decode does not expect.

Prefill (``kv_producer``): a ``do_remote_decode`` request's source blocks are sent to the workers as vLLM allocates
them, once per Decode request it serves (one per sample of ``n``), with the prompt tokens cached after each step;
``request_finished`` keeps the blocks until the workers report the request finished-sending, which they do once every
Decode rank replied (also for aborted requests).

vLLM's own P/D convention (its example proxy; :mod:`rd2h.vllm.handoff`): a Prefill asked with
``do_remote_decode`` and no rd2h fields computes the request, holds its blocks when it
finishes and returns signed ``kv_transfer_params`` naming its hand-off listener; a Decode
given those claims the id, and once every worker expects it asks every Prefill rank (instead
of posting a rendezvous). A hand-off that cannot happen is logged and counted: refused params
(``refused_params``), a Prefill without ``handoff_port`` (``no_handoff``), an ask refused or
unanswered (``handoff_failed``: the pull is stopped and vLLM's ``kv_load_failure_policy``
decides, ``recompute`` computes it here). A Decode that loads none of it releases the hold (nothing.py).

Several KV cache groups (``dense``, the hybrid allocator): Decode loads all prompt tokens but the last
(:mod:`rd2h.vllm.kv_groups`); Prefill sends every group's blocks at once. Decode fields with ``tail``: the
prompt ends in Prefill's first sampled token, never computed there: loaded all but it (one group only).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rd2h.layout.topology import base_port
from rd2h.vllm.config import ConnectorConfig, Mode
from rd2h.vllm.finished import Finishing
from rd2h.vllm.handoff import HANDOFF_LEG, Handoff, accept_handoff, ask_fields, ask_urls, handoff_params
from rd2h.vllm.kv_groups import transfer_tokens
from rd2h.vllm.late_sends import LateSends, Send
from rd2h.vllm.later import TargetAsker
from rd2h.vllm.metadata import (
    WORKER_REPORTS,
    Groups,
    HoldSpec,
    RecvSpec,
    SendBlocks,
    SendFinish,
    SendSpec,
    StepMetadata,
    WorkerReport,
)
from rd2h.vllm.nothing import NothingToPull
from rd2h.vllm.params import PARAMS_KEY, accept_decode_leg, decode_tail
from rd2h.vllm.rendezvous import RendezvousPoster
from rd2h.vllm.vouch import sign
from rd2h.wire.endpoint import DecodeEndpoint

__all__ = ["PARAMS_KEY", "RD2HScheduler"]

log = logging.getLogger("rd2h.vllm.scheduler")


def _groups(blocks: Any) -> Groups:
    """Block ids per KV cache group from vLLM's KVCacheBlocks or a tuple of lists."""
    ids = blocks.get_block_ids() if hasattr(blocks, "get_block_ids") else blocks
    return tuple(tuple(int(b) for b in group) for group in ids)


def _blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


@dataclass
class _Recv:
    ext_id: str
    body: dict[str, Any]
    posted: bool = False
    # a vLLM without worker reports: the step that carried it came back (from every worker)
    sent_to_workers: bool = False
    # workers that said they expect it, summed over steps (reports of one step come back apart)
    reported: int = 0
    handoff: Handoff | None = None  # vLLM's convention: ask these Prefill ranks, post nothing


class RD2HScheduler(Finishing, LateSends, NothingToPull):
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
        secret: bytes,
        prefix_caching: bool = True,
        load_failure_policy: str = "fail",
        engine_id: str = "",
        asker: Any = None,
        clock: Callable[[], float] = time.time,
        stages: tuple[int, ...] = (),
        state: bool = False,  # a Mamba state group: every request moves whole, Prefill's prompt cut by one
    ) -> None:
        self.config = config
        self.consumer, self.producer = consumer, producer
        self.block_sizes = tuple(block_sizes)
        self._whole = config.mode is Mode.DENSE and (len(self.block_sizes) > 1 or state)
        self.world_size = world_size
        self._secret, self._clock = secret, clock
        self._prefix_caching = prefix_caching  # samples > 0 reuse sample 0's pull through it
        self._load_failure_policy = load_failure_policy  # told to the proxy: it acts on it if Prefill fails
        # stages: the layers each pipeline stage holds, named so that Prefill sends each layer to its stage
        self.endpoint = DecodeEndpoint(config.advertised, base_port(config.kv_port, dp_rank, tp_size), tp_size, stages)
        self.engine_id, self.tp_size = engine_id or secrets.token_hex(8), tp_size
        self.handoff_port = None if config.handoff_port is None else base_port(config.handoff_port, dp_rank, tp_size)
        self._asker = asker  # Decode's asks to Prefill ranks (vLLM's convention), made on first use
        self._handoffs: dict[str, Handoff] = {}  # req id -> the hand-off it claimed (Decode)
        self._asked: dict[str, str] = {}  # ext id -> the req id whose asks are out (Decode)
        self._releasing: dict[str, str] = {}  # ext id -> the req id whose release is out (Decode, nothing.py)
        self._used: OrderedDict[str, None] = OrderedDict()  # hand-off ids claimed lately (Decode)
        self._hold_new: list[HoldSpec] = []  # held at request_finished, for the next step (Prefill)
        self._poster = poster if poster is not None or not consumer else RendezvousPoster(
            retries=config.metaserver_retries)  # fmt: skip
        self._recv: dict[str, _Recv] = {}  # req id -> waiting for KV
        self._claims: dict[str, str] = {}  # ext id -> the live req id pulling it (Decode)
        self._claimed: dict[str, str] = {}  # the reverse: req id -> its ext id
        self._landed: set[str] = set()  # claimed ext ids whose pull ended (their samples may go)
        self._said_nothing: dict[str, None] = {}  # ext ids the proxy was told lately load nothing (nothing.py)
        self._recv_new: list[RecvSpec] = []
        self._recv_abort: list[str] = []
        self._send: dict[str, Send] = {}  # req id -> being sent
        self._sending: dict[str, str] = {}  # ext id -> the req id sending it (Prefill)
        self._send_finish: list[SendFinish] = []
        self._targets: TargetAsker | None = None  # asks for targets learnt after Prefill started
        self._release: list[str] = []  # req ids held for targets that never came: free their blocks
        self.stats = {
            "pulled_tokens": 0, "prefix_hit_tokens": 0, "rendezvous": 0, "refused_params": 0,
            "samples_from_prefix_cache": 0, "samples_computed_here": 0,
            "held": 0, "no_handoff": 0, "handoffs": 0, "handoff_failed": 0, "late_targets": 0, "targets_failed": 0,
            "nothing_to_pull": 0, "handoff_released": 0, "release_failed": 0,
        }  # fmt: skip

    # -- Decode --------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        params = _params(request)
        if not (self.consumer and params.get("do_remote_prefill")):
            return 0, False
        raw = params.get(PARAMS_KEY)
        if isinstance(raw, Mapping) and raw.get("leg") == HANDOFF_LEG:
            return self._match_handoff(request, raw, num_computed_tokens)
        if raw is None:
            self._refuse(request.request_id, "not signed: do_remote_prefill without rd2h's part (the params of "
                         "another connector, or a client's own)")  # fmt: skip
            return 0, False
        if self.config.metaserver is None:
            self._refuse(request.request_id, "rd2h proxy fields, but no 'metaserver' is configured to post to")
            return 0, False
        try:
            ext_id, prompt, sample, tail = accept_decode_leg(self._secret, raw, request.request_id, self._clock())
            if tail and self._whole:  # Prefill computes the whole prompt, sends all but the last: untested here
                raise ValueError("a prompt ending in Prefill's first token, with several KV cache groups or a state")
        except ValueError as exc:
            self._refuse(request.request_id, str(exc))
            return 0, False
        if sample > 0:  # the prompt's blocks come with sample 0's pull, then from the prefix cache
            leader = ext_id.rsplit("-", 1)[0] + "-0"
            if leader in self._claims and leader not in self._landed:
                return None, False  # not schedulable until that pull ended
            if self._prefix_caching:
                self.stats["samples_from_prefix_cache"] += 1
            else:
                self.stats["samples_computed_here"] += 1
                log.warning(
                    "request %s: sample %d computes its whole prompt here: Decode runs without prefix caching, "
                    "so only sample 0 gets the pulled KV (%d such samples so far)",
                    request.request_id, sample, self.stats["samples_computed_here"],
                )  # fmt: skip
            return 0, False
        if not self._claim(request.request_id, ext_id):
            return 0, False
        loadable = self._loaded(len(request.prompt_token_ids or ()) - tail)  # tail: Prefill's first token
        if loadable - num_computed_tokens <= 0 or self._told_nothing(ext_id):  # the proxy told at once (nothing.py)
            self._nothing_to_pull(request, ext_id, loadable)
            return 0, False
        return loadable - num_computed_tokens, True

    def _match_handoff(self, request: Any, raw: Mapping[str, Any], num_computed: int) -> tuple[int | None, bool]:
        """vLLM's convention: params a Prefill returned (signed by it) name a held request."""
        req_id, tokens = request.request_id, list(request.prompt_token_ids or ())
        try:
            handoff = accept_handoff(
                self._secret, raw, tokens, self._clock(), block_size=self.block_sizes[0], mode=self.config.mode.value
            )  # fmt: skip
        except ValueError as exc:
            self._refuse(req_id, f"Prefill's hand-off: {exc}")
            return 0, False
        holder = self._claims.get(handoff.ext_id)
        if holder is not None and holder != req_id:
            # another request (a sample of n, or a copy of the params) pulls this prompt: wait
            # for it, then vLLM's prefix cache has the blocks; a Prefill sends a hold once
            return (None, False) if handoff.ext_id not in self._landed else (0, False)
        if holder is None and handoff.ext_id in self._used:
            log.info("request %s: hand-off %s was pulled already; computed here (prefix cache)", req_id,
                     handoff.ext_id)  # fmt: skip
            return 0, False
        self._claim(req_id, handoff.ext_id)
        self._used[handoff.ext_id] = None
        while len(self._used) > 4096:
            self._used.popitem(last=False)
        count = self._loaded(len(tokens)) - num_computed
        if count <= 0:  # its prefix cache has it all: Prefill frees the held blocks now (nothing.py)
            return self._release_handoff(request, handoff, nothing=True)
        self._handoffs[req_id] = handoff  # until allocated with its KV (then asked) or released
        return count, True

    def _loaded(self, prompt_tokens: int) -> int:
        """The prompt tokens Decode loads: all, or all but the last with several groups."""
        return transfer_tokens(prompt_tokens) if self._whole else prompt_tokens

    def _claim(self, req_id: str, ext_id: str) -> bool:
        """Claim ``ext_id`` for ``req_id``; False (logged, counted) when a live request holds it (a replay)."""
        holder = self._claims.setdefault(ext_id, req_id)
        if holder != req_id:
            self._refuse(req_id, f"id {ext_id} is already pulled by live request {holder}")
            return False
        self._claimed[req_id] = ext_id
        return True

    def _refuse(self, req_id: str, why: str) -> None:
        self.stats["refused_params"] += 1
        log.warning(
            "request %s: rd2h kv_transfer_params refused (%s); served without a transfer (%d refused so far)",
            req_id, why, self.stats["refused_params"],
        )  # fmt: skip

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = _params(request)
        if self.producer and params.get("do_remote_decode") and PARAMS_KEY in params:
            self._track_send(request, params)
        if not (self.consumer and params.get("do_remote_prefill") and num_external_tokens > 0):
            return
        ext_id = self._claimed.get(request.request_id)  # claimed when it reported external tokens
        if ext_id is None:
            return
        num_tokens = len(request.prompt_token_ids) - decode_tail(params[PARAMS_KEY])  # the tokens Prefill computed
        local = self._loaded(num_tokens) - num_external_tokens  # a block-aligned local prefix-cache hit
        first_block = local // self.block_sizes[0]
        groups = tuple(g[: _blocks_for(num_tokens, size)] for g, size in zip(_groups(blocks), self.block_sizes))
        self._recv_new.append(RecvSpec(ext_id, request.request_id, groups, first_block, num_tokens))
        body = {
            "ext_id": ext_id, "endpoint": str(self.endpoint), "first_block": first_block, "num_tokens": num_tokens,
            "decode_tp": self.endpoint.tp_size, "block_size": self.block_sizes[0], "mode": self.config.mode.value,
            "on_load_failure": self._load_failure_policy,
        }  # fmt: skip
        handoff = self._handoffs.pop(request.request_id, None)
        if handoff is not None:  # asked from Prefill's ranks, signed when the asks go out
            body = {"endpoint": str(self.endpoint), "first_block": first_block, "num_tokens": num_tokens}
        self._recv[request.request_id] = _Recv(ext_id, body, handoff=handoff)
        self.stats["pulled_tokens"] += num_external_tokens
        self.stats["prefix_hit_tokens"] += local
        # consumed: a second allocation for this request (after the load) must not pull again
        request.kv_transfer_params = {**params, "do_remote_prefill": False}

    def update_connector_output(self, output: Any) -> None:
        self._handoff_results()
        report = getattr(output, "kv_connector_worker_meta", None)
        expected = report.expected if isinstance(report, WorkerReport) else {}
        for req_id in list(output.finished_recving or ()):
            self._recv.pop(req_id, None)
            if req_id in self._claimed:
                self._landed.add(self._claimed[req_id])
        for recv in self._recv.values():
            if recv.posted:
                continue
            recv.reported += expected.get(recv.ext_id, 0)
            if recv.reported >= self.world_size or (not WORKER_REPORTS and recv.sent_to_workers):
                recv.posted = True
                self._ask(recv) if recv.handoff is not None else self._post(recv)

    def _ask(self, recv: _Recv) -> None:
        """vLLM's convention: every Prefill rank is asked to announce the held request here."""
        assert recv.handoff is not None
        self.stats["handoffs"] += 1
        body = recv.body
        fields = ask_fields(self._secret, recv.ext_id, body["endpoint"], body["first_block"], body["num_tokens"],
                            self._clock())  # fmt: skip
        self._asked[recv.ext_id] = self._claims[recv.ext_id]
        self._handoff_asker().submit(recv.ext_id, ask_urls(recv.handoff), fields)

    def _handoff_results(self) -> None:
        """A hand-off that cannot happen stops the pull (failed: vLLM's kv_load_failure_policy applies)."""
        if self._asker is None:
            return
        for ext_id, error in self._asker.results():
            if self._release_answered(ext_id, error):  # a release's answer (nothing.py)
                continue
            req_id = self._asked.pop(ext_id, None)
            if error is None or req_id is None or req_id not in self._recv:
                continue
            self.stats["handoff_failed"] += 1
            log.warning(
                "request %s: the KV of hand-off %s cannot be pulled (%s); its pull is stopped and vLLM's "
                "kv_load_failure_policy (%s) applies (%d such hand-offs so far)",
                req_id, ext_id, error, self._load_failure_policy, self.stats["handoff_failed"],
            )  # fmt: skip
            self._recv_abort.append(ext_id)

    def _post(self, recv: _Recv) -> None:
        if self.config.metaserver is None:  # refused at startup; kept for unit-built schedulers
            log.error("request %s: no metaserver configured to post its rendezvous to", recv.ext_id)
            return
        assert self._poster is not None
        self.stats["rendezvous"] += 1
        self._poster.submit(recv.ext_id, self.config.metaserver, sign(self._secret, recv.body, self._clock()))

    # -- Prefill -------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: Any) -> StepMetadata:
        self.begin_step()  # what meta_after_error compares with, should this raise
        self._handoff_results()  # a failed hand-off's abort goes out with this step
        send_new: list[SendSpec] = []
        send_blocks: list[SendBlocks] = []
        computed: list[tuple[str, int]] = []
        self._take_targets(send_new, not scheduler_output.total_num_scheduled_tokens)
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            send = self._send.get(new.req_id)
            if send is None or send.started or send.pending is not None:
                continue
            groups = _groups(new.block_ids)
            tokens = new.num_computed_tokens + scheduled.get(new.req_id, 0)
            if self._whole or not send.targets:  # several groups, or targets to come: gathered
                send.pending = [list(g) for g in groups]
                self._gathered(new.req_id, send, tokens, send_new, computed)
                continue
            send.started = self._steps
            send_new += [
                SendSpec(t.ext_id, new.req_id, str(t.endpoint), groups, send.num_tokens, t.first_block)
                for t in send.targets
            ]
            computed += self._computed(send, tokens)
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", None) or set()
        send_abort: list[str] = []
        for i, req_id in enumerate(cached.req_ids):
            send = self._send.get(req_id)
            if send is None or send.done or not (send.started or send.pending is not None):
                continue
            if req_id in resumed:
                # preempted: vLLM freed its blocks and gives it new ones; what was announced
                # is gone. Stop it (Decode fails it); its blocks are vLLM's to free again.
                log.error("request %s was preempted while its KV was being sent; it fails", req_id)
                self._drop_send(req_id, send)
                send_abort += [t.ext_id for t in send.targets if send.started]  # a whole one: if sent
                continue
            new_ids = cached.new_block_ids[i]
            if send.pending is not None:
                for group, more in zip(send.pending, _groups(new_ids or ())):
                    group.extend(more)
                tokens = cached.num_computed_tokens[i] + scheduled.get(req_id, 0)
                self._gathered(req_id, send, tokens, send_new, computed)
                continue
            if new_ids is not None and any(new_ids):
                send_blocks += [SendBlocks(t.ext_id, _groups(new_ids)) for t in send.targets]
            computed += self._computed(send, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        for spec in self._recv_new:
            recv = self._recv.get(spec.req_id)
            if recv is not None:
                recv.sent_to_workers = True
        meta = StepMetadata(
            recv=tuple(self._recv_new), recv_abort=tuple(self._recv_abort), send_new=tuple(send_new),
            send_blocks=tuple(send_blocks), computed=tuple(computed), send_finish=tuple(self._send_finish),
            send_abort=tuple(send_abort), idle=not scheduler_output.total_num_scheduled_tokens,
            hold=tuple(self._hold_new), release=tuple(self._release),
        )
        self._recv_new, self._recv_abort, self._send_finish, self._hold_new, self._release = [], [], [], [], []
        self._sends_before = {}  # built: nothing for meta_after_error, no finished send kept alive
        return meta

    def _gathered(self, req_id: str, send: Send, tokens: int, send_new: list, computed: list) -> None:
        """Several groups: to the workers whole, in the step after which its prompt is computed.
        Targets to come: its KV is written up to ``tokens`` after this step."""
        if not send.targets:
            send.written = min(tokens, send.num_tokens)
            return
        if tokens < send.num_tokens:
            return
        groups, send.started, send.pending = tuple(tuple(g) for g in send.pending), self._steps, None
        send_new += [SendSpec(t.ext_id, req_id, str(t.endpoint), groups, send.num_tokens, t.first_block)
                     for t in send.targets]  # fmt: skip
        computed += self._computed(send, tokens)

    @staticmethod
    def _computed(send: Send, tokens: int) -> list[tuple[str, int]]:
        tokens = min(tokens, send.num_tokens)
        send.done = tokens >= send.num_tokens
        return [(t.ext_id, tokens) for t in send.targets]

    # -- both (request_finished and the hook guards' safe answers: rd2h.vllm.finished) ------

    def _hold(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's convention on Prefill: keep a finished request's blocks for a Decode to ask for,
        and return the signed params that say where (``handoff_params``)."""
        req_id, tokens = request.request_id, list(request.prompt_token_ids or ())
        status = getattr(getattr(request, "status", None), "name", str(getattr(request, "status", "")))
        if status not in ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED"):
            return False, None  # aborted or refused: nobody will ask for it
        if self.handoff_port is None:
            self.stats["no_handoff"] += 1
            log.warning(
                "request %s asks for a remote Decode (do_remote_decode) without rd2h's proxy fields: vLLM's "
                "P/D convention needs kv_connector_extra_config 'handoff_port' on this Prefill; no KV is handed "
                "off and its Decode computes the prompt again (%d such requests so far)",
                req_id, self.stats["no_handoff"],
            )  # fmt: skip
            return False, None
        groups = tuple(g[: _blocks_for(len(tokens), size)] for g, size in zip(_groups(block_ids), self.block_sizes))
        if not tokens or any(len(g) < _blocks_for(len(tokens), size) for g, size in zip(groups, self.block_sizes)):
            log.error("request %s: %d prompt tokens but blocks %s: nothing to hand off", req_id, len(tokens),
                      [len(g) for g in groups])  # fmt: skip
            return False, None
        ext_id = secrets.token_hex(16)  # unguessable: a copy of someone else's params is all that finds it
        self._hold_new.append(HoldSpec(ext_id, req_id, groups, len(tokens)))
        self.stats["held"] += 1
        return True, handoff_params(
            self._secret, ext_id=ext_id, engine_id=self.engine_id, host=self.config.advertised,
            port=self.handoff_port, tp=self.tp_size, token_ids=tokens, blocks=groups,
            block_size=self.block_sizes[0], mode=self.config.mode.value, now=self._clock(),
            ttl=self.config.hold_timeout,
        )  # fmt: skip

    def shutdown(self) -> None:
        if self._poster is not None:
            self._poster.close()
        if self._asker is not None:
            self._asker.close()
        if self._targets is not None:
            self._targets.close()


def _params(request: Any) -> Mapping[str, Any]:
    return getattr(request, "kv_transfer_params", None) or {}
