"""How rd2h's part of a request ends on the scheduler side: vLLM finished it (``request_finished``),
or one of the connector's hooks raised for it (a bug) and the guard answers what is safe.

The safe answer never frees blocks a transfer may still read, and never holds them forever:

- ``request_finished`` raised (:meth:`Finishing.finish_after_error`): a Decode request waiting for
  its KV gets its pull aborted on the workers (vLLM holds the blocks until they report it
  finished-receiving); a Prefill request whose blocks reached the workers (a send started) is held
  and finished on the workers as aborted, so that they report it finished-sending once no Decode
  reads it; anything else is freed at once, its send or hold forgotten before any worker hears of it.
  Its claim on an id goes, so that no sample of ``n`` waits for it.
- ``update_state_after_alloc`` raised for a request vLLM now waits for (an asynchronous load,
  ``WAITING_FOR_REMOTE_KVS``): no worker knows of its pull, so none would ever report it. What was
  made of the pull is undone (:meth:`Finishing.undo_alloc`) and :class:`FailedLoads` has every worker
  report it finished-receiving and failed in the next step: vLLM's ``kv_load_failure_policy``
  fails it or computes it here (rd2h never matches it again). A pull that had taken its hand-off
  releases it too. For any other request a send it began to track, never started, is forgotten: its
  targets may never have been asked for, and a finish would hold its blocks for them forever.
- ``build_connector_meta`` raised (:meth:`Finishing.meta_after_error`): what was queued for the
  workers before the step goes out; a send whose first blocks this step would have announced is
  dropped (its Decode fails at its deadline; vLLM frees its blocks); one preempted in this step
  is aborted; one vLLM finished before its late targets came has its held blocks released.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from typing import Any

from rd2h.vllm.metadata import SendFinish, StepMetadata
from rd2h.vllm.params import PARAMS_KEY

__all__ = ["FailedLoadStep", "FailedLoads", "Finishing"]

log = logging.getLogger("rd2h.vllm.finished")


class Finishing:
    """The finishing half of :class:`~rd2h.vllm.scheduler.RD2HScheduler` (its state is the scheduler's)."""

    producer: bool
    _claims: dict[str, str]
    _claimed: dict[str, str]
    _landed: set[str]
    _handoffs: dict[str, Any]
    _asked: dict[str, str]
    _asker: Any
    _poster: Any
    _recv: dict[str, Any]
    _recv_new: list[Any]
    _recv_abort: list[str]
    _send: dict[str, Any]
    _sending: dict[str, str]
    _send_finish: list[SendFinish]
    _hold_new: list[Any]
    _release: list[str]
    _targets: Any
    _hold: Any
    _finished_early: Any
    _release_handoff: Any
    _unclaim: Any
    _unclaim_id: Any
    # what request_finished found when it began, and the sends (started or not) a step began with
    _finishing: tuple[Any, Any, Any] = (None, None, None)
    _sends_before: dict[str, Any] = {}
    _steps = 0  # build_connector_meta calls: a send's ``started`` is the step it started in

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        self._finishing = (req_id, self._recv.get(req_id), self._send.get(req_id))  # for finish_after_error
        answer = self._finish(request, req_id, block_ids)
        self._finishing = (None, None, None)  # finished: nothing for finish_after_error, no send kept alive
        return answer

    def _finish(self, request: Any, req_id: str, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        self._unclaim_id(req_id)
        handoff = self._handoffs.pop(req_id, None)  # claimed, never allocated with its KV: released
        recv = self._recv.pop(req_id, None)
        if recv is not None:  # finished while its KV was awaited: stop the pull
            if recv.handoff is not None:
                self._asked.pop(recv.ext_id, None)
                if self._asker is not None:
                    self._asker.cancel(recv.ext_id)
            elif not recv.posted and self._poster is not None:
                self._poster.cancel(recv.ext_id)
            self._recv_abort.append(recv.ext_id)
            # vLLM itself holds the blocks of a WAITING_FOR_REMOTE_KVS request until the
            # workers report it finished-receiving, which they do once the pull stopped.
            return False, None
        if handoff is not None:
            self._release_handoff(request, handoff, nothing=False)
        params = getattr(request, "kv_transfer_params", None) or {}
        if self.producer and params.get("do_remote_decode") and PARAMS_KEY not in params:
            return self._hold(request, block_ids)
        send = self._send.pop(req_id, None)
        if send is None:
            return False, None
        if send.later is not None and not send.targets:  # vLLM finished it before its targets came
            return self._finished_early(request, send)
        for target in send.targets:
            self._sending.pop(target.ext_id, None)
        if not send.started:  # never reached a worker: nothing reads its blocks
            return False, None
        aborted = not send.done or "ABORTED" in str(getattr(request, "status", ""))
        self._send_finish += [SendFinish(t.ext_id, req_id, aborted) for t in send.targets]
        return True, None

    def finish_after_error(self, request: Any) -> tuple[bool, None]:
        """``request_finished`` raised for ``request``: the safe answer (module docstring)."""
        req_id = getattr(request, "request_id", None)
        began, recv, send = self._finishing
        if began != req_id:  # it raised before looking: what it would have found is still here
            recv, send = self._recv.get(req_id), self._send.get(req_id)  # type: ignore[arg-type]
        self._finishing = (None, None, None)
        self._unclaim_id(req_id)  # type: ignore[arg-type]
        self._handoffs.pop(req_id, None)  # type: ignore[arg-type]
        self._hold_new = [h for h in self._hold_new if h.req_id != req_id]  # no Decode was told where: none asks
        if recv is not None:  # vLLM holds a request waiting for KV until the workers say the pull stopped
            self._recv.pop(req_id, None)  # type: ignore[arg-type]
            if recv.ext_id not in self._recv_abort:
                self._recv_abort.append(recv.ext_id)
            return False, None
        if send is None:
            return False, None
        self._drop_send(req_id, send)  # type: ignore[arg-type]
        if not send.started:  # no worker was told of its blocks: nothing reads them
            return False, None
        if not any(f.req_id == req_id for f in self._send_finish):  # a Decode may read them: held until it ends
            self._send_finish += [SendFinish(t.ext_id, req_id, True) for t in send.targets]  # type: ignore[arg-type]
        return True, None

    def undo_alloc(self, request: Any, load: bool) -> None:
        """``update_state_after_alloc`` raised for ``request``. ``load``: vLLM now waits for its KV:
        its pull never goes to a worker, its claim and hand-off go (one its pull had taken too),
        and it never pulls again. Else a send it began to track and never started is forgotten:
        no finish holds its blocks for targets never asked for (a started one is the workers')."""
        req_id = request.request_id
        if not load:
            send = self._send.get(req_id)
            if send is not None and not send.started:
                self._drop_send(req_id, send)
            return
        self._recv_new = [spec for spec in self._recv_new if spec.req_id != req_id]  # not sent yet
        recv = self._recv.pop(req_id, None)
        handoff = self._handoffs.pop(req_id, None) or (recv.handoff if recv is not None else None)
        if handoff is not None:  # every Prefill rank frees the held blocks now
            self._release_handoff(request, handoff, nothing=False)
        if req_id in self._claimed:
            self._unclaim(request)

    def begin_step(self) -> None:
        """A step's metadata is being built. What ``meta_after_error`` compares with: the sends the
        step began with (a copy, no per-send work each step); their ``started`` step tells whether
        their blocks reached the workers before this step or in it (then in the lost metadata)."""
        self._steps += 1
        self._sends_before = self._send.copy()

    def meta_after_error(self) -> StepMetadata:
        """``build_connector_meta`` raised: this step's metadata, from what is safe (module docstring)."""
        send_abort: list[str] = []
        finishing = {f.req_id for f in self._send_finish}
        released = set()
        for req_id, send in self._sends_before.items():
            now, started = self._send.get(req_id), 0 < send.started < self._steps  # started before this step
            if now is None and started and req_id not in finishing:  # preempted: vLLM gives it new blocks
                send_abort += [t.ext_id for t in send.targets]
            elif now is None and not started and req_id in finishing:  # finished, held, then its targets came
                released.add(req_id)  # its first blocks were in the lost metadata: no worker reads them
            elif now is not None and now.started == self._steps:  # ... of a live request: it is not sent
                self._drop_send(req_id, now)
        self._send_finish = [f for f in self._send_finish if f.req_id not in released]
        meta = StepMetadata(
            recv=tuple(self._recv_new), recv_abort=tuple(self._recv_abort), send_finish=tuple(self._send_finish),
            send_abort=tuple(send_abort), hold=tuple(self._hold_new), release=tuple(self._release + sorted(released)),
        )  # fmt: skip
        for recv in self._recv_new:
            if recv.req_id in self._recv:
                self._recv[recv.req_id].sent_to_workers = True
        self._recv_new, self._recv_abort, self._send_finish, self._hold_new, self._release = [], [], [], [], []
        self._sends_before = {}
        return meta

    def _drop_send(self, req_id: str, send: Any) -> None:
        """Forget ``send`` (no worker sends it, or it is aborted): its targets' ids and late-targets ask go too."""
        self._send.pop(req_id, None)  # request_finished may have popped it before it raised
        for target in send.targets:
            self._sending.pop(target.ext_id, None)
        if self._targets is not None:
            self._targets.cancel(req_id)


@dataclass(frozen=True)
class FailedLoadStep(StepMetadata):
    """A step's metadata that also names loads failed on the scheduler side: each worker reports
    them finished-receiving and failed (no worker ever knew of them)."""

    failed_loads: tuple[tuple[str, tuple[int, ...]], ...] = ()  # (req id, its main-group blocks)


class FailedLoads:
    """Loads vLLM waits for that no worker will report. Scheduler role: :meth:`fail`, then
    :meth:`attach` to the next step's metadata; worker role: :meth:`bind` it, :meth:`take` once."""

    def __init__(self) -> None:
        self._pending: dict[str, tuple[int, ...]] = {}  # scheduler: for the next step
        self.gave_up: set[str] = set()  # scheduler: never matched again (a recompute is local)
        self._bound: Any = None  # worker: the metadata taken (vLLM may bind a step twice)
        self._taken: dict[str, tuple[int, ...]] = {}  # worker: not yet reported
        self.blocks: set[int] = set()  # worker: the blocks of those reported, until vLLM asks for load errors

    def fail(self, request: Any, blocks: Any) -> None:
        req_id = request.request_id
        self.gave_up.add(req_id)
        try:  # an older vLLM takes failures as blocks (main group); a newer one by request
            ids = blocks.get_block_ids() if hasattr(blocks, "get_block_ids") else blocks
            main = tuple(int(b) for b in ids[0])
        except Exception as exc:  # noqa: BLE001 - the request still fails, by id
            log.warning("rd2h: request %s: its blocks are unreadable (%r); a vLLM that takes load failures as "
                        "blocks only may take its unwritten KV as loaded", req_id, exc)  # fmt: skip
            main = ()
        self._pending[req_id] = main

    def attach(self, meta: StepMetadata) -> StepMetadata:
        if not self._pending:
            return meta
        failed, self._pending = tuple(self._pending.items()), {}
        return FailedLoadStep(**{f.name: getattr(meta, f.name) for f in fields(meta)}, failed_loads=failed)

    def bind(self, meta: Any) -> None:
        if isinstance(meta, FailedLoadStep) and meta is not self._bound:
            self._bound = meta
            self._taken.update(meta.failed_loads)

    def take(self) -> set[str]:
        """The failed loads' request ids, each once (their blocks kept in :attr:`blocks`)."""
        taken, self._taken = self._taken, {}
        self.blocks.update(b for blocks in taken.values() for b in blocks)
        return set(taken)

    def take_blocks(self) -> set[int]:
        blocks, self.blocks = self.blocks, set()
        return blocks
