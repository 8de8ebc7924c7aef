"""Prefill's sends on the connector's scheduler side, and those whose targets come later.

The proxy may send a request to Prefill and Decode at once (``rd2h.vllm.params.Later``): Prefill
then computes it before any Decode posted its rendezvous, gathering its blocks and the prompt
tokens whose KV is written (``Send.written``), and asks the proxy for its targets
(:class:`~rd2h.vllm.later.TargetAsker`). Once they come, signed by the proxy for that request,
it starts as any other: its blocks go to the workers with ``written``, and the workers announce
every layer written so far at once, the rest as it is computed. A request vLLM finishes before
its targets came keeps its blocks (``request_finished`` answers True) until they come, or until
the ask failed or ran out of the request's ``wait``: then it is sent nowhere and the workers are
told to free its blocks (``StepMetadata.release``; Decode fails it on its own deadline, the proxy
fails the client's request). Decode never sees an announcement before it posted its rendezvous:
Prefill learns where to send only from what that rendezvous said.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rd2h.vllm.metadata import SendFinish, SendSpec
from rd2h.vllm.params import PARAMS_KEY, Later, Target, accept_late, accept_prefill_leg, targets_ask

__all__ = ["LATE_IDLE_WAIT", "LateSends", "Send"]

log = logging.getLogger("rd2h.vllm.scheduler")

LATE_IDLE_WAIT = 0.01  # the longest an idle step waits for the targets of a finished request (woken by them)


@dataclass
class Send:
    targets: list[Target]  # one per Decode request (sample) this request's blocks serve
    num_tokens: int
    started: int = 0  # the step (1, 2, ...) its first blocks went to the workers in; 0: not yet
    done: bool = False  # every prompt token was scheduled
    pending: list[list[int]] | None = None  # several groups, or targets not known yet: its blocks so far
    later: Later | None = None  # Prefill asked before the rendezvous: its targets come from the proxy
    written: int = 0  # ... prompt tokens whose KV was written before they came
    finished: bool = False  # ... vLLM finished it meanwhile: its blocks are held for them


class LateSends:
    """Prefill's half of :class:`~rd2h.vllm.scheduler.RD2HScheduler` that accepts a request's
    fields and learns late targets (its state is the scheduler's: ``_send``, ``_sending``...)."""

    _secret: bytes
    _send: dict[str, Send]
    _sending: dict[str, str]
    _send_finish: list[SendFinish]
    _targets: Any
    _release: list[str]
    _whole: bool
    _clock: Any
    _steps: int  # build_connector_meta calls (Finishing): a send's ``started`` is the step it started in
    stats: dict[str, int]

    def _track_send(self, request: Any, params: Mapping[str, Any]) -> None:
        req_id = request.request_id
        if req_id in self._send:
            return
        try:
            targets, later = accept_prefill_leg(self._secret, params.get(PARAMS_KEY), req_id, self._clock())
        except ValueError as exc:  # computed as asked, nothing sent
            self._refuse(req_id, str(exc))
            return
        if not targets and later is None:  # Decode loads nothing of this prompt: computed, nothing to track
            return
        taken = [t.ext_id for t in targets if t.ext_id in self._sending]
        if taken:
            self._refuse(req_id, f"id {taken[0]} is already sent by live request {self._sending[taken[0]]}")
            return
        self._send[req_id] = Send(targets, len(request.prompt_token_ids), later=later)
        self._sending.update((t.ext_id, req_id) for t in targets)
        if later is not None:  # computed now; the targets come once every Decode posted its rendezvous
            self._ask_targets(req_id, later)

    def _ask_targets(self, req_id: str, later: Later) -> None:
        if self._targets is None:
            from rd2h.vllm.later import TargetAsker

            self._targets = TargetAsker()
        self._targets.ask(req_id, later.url, targets_ask(self._secret, later.rid, self._clock()), later.wait)

    def _finished_early(self, request: Any, send: Send) -> tuple[bool, None]:
        """vLLM finished a request whose targets did not come yet: hold its blocks for them
        (True) unless nothing was written or it was aborted."""
        req_id = request.request_id
        if send.written and "ABORTED" not in str(getattr(request, "status", "")):
            send.finished = True
            self._send[req_id] = send
            return True, None
        if self._targets is not None:
            self._targets.cancel(req_id)
        return False, None

    def _take_targets(self, send_new: list[SendSpec], idle: bool) -> None:
        """Targets the proxy answered: a request whose KV is (partly) written starts now, its
        written layers announced at once (``SendSpec.written``); one whose targets cannot come
        is sent nowhere, its held blocks freed (``release``)."""
        if self._targets is None:
            return
        if idle and any(s.finished for s in self._send.values()):
            self._targets.wait(LATE_IDLE_WAIT)
        for req_id, answer, error in self._targets.take():
            send = self._send.get(req_id)
            if send is None or send.later is None or send.targets:
                continue
            try:
                if error:
                    raise ValueError(error)
                targets = accept_late(self._secret, send.later, answer, req_id, self._clock())
                if taken := [t.ext_id for t in targets if t.ext_id in self._sending]:
                    raise ValueError(f"id {taken[0]} is already sent by live request {self._sending[taken[0]]}")
                if self._whole and send.finished and send.written < send.num_tokens:  # sent whole or not at all
                    raise ValueError(f"vLLM finished it with {send.written} of its {send.num_tokens} prompt tokens "
                                     "written: nothing whole to send")  # fmt: skip
            except ValueError as exc:
                del self._send[req_id]
                self.stats["targets_failed"] += 1
                log.warning("request %s: no targets (%s): its KV goes nowhere%s (%d such requests so far)", req_id,
                            exc, "; its blocks are freed" if send.finished else "", self.stats["targets_failed"])
                if send.finished:
                    self._release.append(req_id)
                continue
            send.targets = targets
            self._sending.update((t.ext_id, req_id) for t in targets)
            self.stats["late_targets"] += 1
            if send.pending is None or (self._whole and send.written < send.num_tokens):
                continue  # not scheduled yet, or sent whole with its last tokens: as any other
            groups, send.pending, send.started = tuple(tuple(g) for g in send.pending), None, self._steps
            send.done = send.written >= send.num_tokens
            send_new += [SendSpec(t.ext_id, req_id, str(t.endpoint), groups, send.num_tokens, t.first_block,
                                  written=send.written) for t in targets]  # fmt: skip
            if send.finished:  # vLLM finished it: reported finished-sending once Decode read it
                del self._send[req_id]
                for t in targets:
                    self._sending.pop(t.ext_id, None)
                self._send_finish += [SendFinish(t.ext_id, req_id, not send.done) for t in targets]
