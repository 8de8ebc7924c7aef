"""The connector's worker side: vLLM's paged cache as rd2h sources and destinations.

One :class:`RD2HWorker` per vLLM worker (TP rank). Decode builds a
:class:`~rd2h.api.KVSink` over the rank's KV cache tensors, Prefill a
:class:`~rd2h.api.KVSource`; each step's :class:`~rd2h.vllm.metadata.StepMetadata` is
applied when vLLM binds it, before the forward, so nothing depends on ``start_load_kv``
running first. Prefill announces a layer from ``save_kv_layer`` (after vLLM wrote it);
Decode needs no per-layer wait: vLLM schedules a request only after it was reported
finished-receiving, every layer already in place.

Modes: ``dense`` registers every attention layer's cache as main KV and reads a full copy
on every Decode rank (``main_split="replicated"``: vLLM's paged cache is rank-local); with
several KV cache groups, per storage slot (:mod:`rd2h.vllm.slots`, :mod:`rd2h.vllm.kv_groups`).
``sfa`` pairs each attention layer with its indexer cache (a layer whose name ends in
``indexer.k_cache``, in its own KV cache group) and reads main KV as disjoint shares of a
TP-shared pool (``main_split="shared"``), the specification's layout.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from rd2h.errors import ConfigError, DuplicateRequestError, RD2HError, UnknownRequestError
from rd2h.outcome import Outcome, TerminalState
from rd2h.staging.choice import WorkerStaging
from rd2h.tensors import LayerTensors, layer_layout, record_event
from rd2h.vllm.config import ConnectorConfig, Mode
from rd2h.vllm.kv_groups import check_groups, gather_blocks, has_state, layers_to_pull, pulls_groups, transfer_tokens
from rd2h.vllm.layer_caches import block_first, split_layers
from rd2h.vllm.metadata import StepMetadata, WorkerReport
from rd2h.vllm.parallel import model_layers, pipeline_stage
from rd2h.vllm.slots import SlotBook
from rd2h.vllm.state_groups import page_view
from rd2h.vllm.stats import RD2HStats, WorkerTally
from rd2h.wire.endpoint import DecodeEndpoint

__all__ = ["RD2HWorker", "split_layers"]

log = logging.getLogger("rd2h.vllm.worker")
_FREED = {"hold_expired": "was held for hold_timeout and nobody asked for it",
          "handoff_released": "was released by its Decode, which loads none of it"}

IDLE_WAIT_SECONDS = 0.01  # the longest an idle step waits for a transfer to end (see _wait_when_idle)


def _accepts(cls: type, name: str) -> bool:
    return name in inspect.signature(cls.__init__).parameters


class RD2HWorker:
    """Worker-side state of one TP rank. Call :meth:`register` once with the caches."""

    def __init__(
        self,
        config: ConnectorConfig,
        *,
        consumer: bool,
        producer: bool,
        rank: int,
        tp_size: int,
        dp_rank: int,
        block_sizes: Sequence[int],
        kv_cache_config: Any = None,
        kv_heads: int | None = None,
    ) -> None:
        self.config = config
        self.kv_heads = kv_heads  # the model's KV heads (dense GQA/MHA); None: MLA, not split by heads
        # vLLM's KV cache groups: registration refuses a layer no pulled group covers
        self.kv_groups = check_groups(kv_cache_config, config.mode)
        self._groups = pulls_groups(self.kv_groups, config.mode)  # several: each request moves whole, by slot
        self._state = has_state(self.kv_groups)  # a Mamba state: Prefill computed the prompt short of its last token
        self._slots: SlotBook | None = None
        self._state_slots: tuple[str, ...] = ()  # the slots holding a Mamba layer, announced by forward_done
        self._virtual: dict[str, tuple[int, int]] = {}  # ext id -> (prompt tokens, tokens of its flat list)
        self.consumer, self.producer = consumer, producer
        self.rank, self.tp_size, self.dp_rank = rank, tp_size, dp_rank
        self.block_sizes = tuple(block_sizes)
        self.sink: Any = None
        self.source: Any = None
        self._tensors: dict[str, LayerTensors] = {}
        self._bound: StepMetadata | None = None
        self._sends = False  # this step announces layers
        self._recv_req: dict[str, str] = {}  # ext id -> req id (Decode)
        self._recv_blocks: dict[str, tuple[int, ...]] = {}  # ext id -> main blocks it writes (Decode)
        self._load_errors: set[int] = set()  # blocks of failed pulls not yet reported (Decode)
        self._expected: dict[str, int] = {}  # expected in this step (reported back)
        self._send_req: dict[str, str] = {}  # ext id -> req id (Prefill)
        self._send_exts: dict[str, set[str]] = {}  # req id -> its ext ids not yet finished (one per sample)
        self._sent: dict[str, Outcome] = {}  # outcomes whose request vLLM has not finished yet
        self._finishing: set[tuple[str, str]] = set()  # (ext id, req id) vLLM finished, outcome not yet in
        self._duplicates: set[tuple[str, str]] = set()  # (ext id, req id) refused as another's id: never sent
        self._forget: set[str] = set()  # ext ids aborted on preemption: outcome not reported
        self._finished_sending: set[str] = set()
        self._finished_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self.tally = WorkerTally()  # what vLLM's get_kv_connector_stats reports
        self.handoff: Any = None  # Prefill with handoff_port: HandoffListener (vLLM's P/D convention)

    # -- setup ---------------------------------------------------------------------------

    def register(self, kv_caches: Mapping[str, Any], num_blocks: Mapping[str, int]) -> None:
        from rd2h.api import KVSink, KVSource

        pulled = layers_to_pull(self.kv_groups, kv_caches, self.config.mode)  # raises for a stray layer
        if self._groups:
            self._slots = SlotBook({n: kv_caches[n] for n in pulled}, num_blocks, self._groups)
            self._tensors = {
                s: LayerTensors(main=[page_view([kv_caches[n] for n in sorted(names)], num_blocks[s])]
                                if s in self._slots.state_slots else block_first(kv_caches[s], num_blocks[s]))
                for s, names in self._slots.members.items()
            }  # fmt: skip
            self._state_slots = tuple(s for s in self._tensors if s in self._slots.state_slots)
        else:
            self._tensors = split_layers({n: kv_caches[n] for n in pulled}, num_blocks, self.config.mode)
        layouts = {
            name: self._with_heads(name, t, layer_layout(t, block_tokens=self.block_sizes[0], layout_name="vllm"))
            for name, t in self._tensors.items()
        }
        cfg = self.config
        # KV the engine as configured cannot move: host staging (RD2H_STAGING=auto|always|never)
        staging = WorkerStaging(self._tensors, layouts, cfg.engine, cfg.engine_options)
        self.tally.watch_staging(staging.counters)  # staged/landed bytes in the worker's stats
        if self.consumer:
            split = "replicated" if cfg.mode is Mode.DENSE else "shared"
            self.sink = KVSink(
                layouts, rank=self.rank, tp_size=self.tp_size, host=cfg.host, kv_port=cfg.kv_port,
                dp_rank=self.dp_rank, engine=cfg.engine, engine_options=cfg.engine_options,
                channel=cfg.channel, channel_options=cfg.channel_options, advertise_host=cfg.advertise_host,
                main_split=split, request_timeout=cfg.request_timeout, **staging.sink_options(),
            )
            self.tally.watch(self.sink)
        if self.producer:
            extra: dict[str, Any] = {}
            # sfa's indexer group (dense groups of other block sizes go as one flat list: _flat)
            if cfg.mode is Mode.SFA and len(self.block_sizes) > 1 and _accepts(KVSource, "indexer_block_size"):
                extra["indexer_block_size"] = self.block_sizes[1]
            extra.update(pipeline_stage())  # a pipeline stage's mf_meta says which stage it is
            extra["model_layers"] = model_layers(layouts)  # a Decode with stages gets each layer from its stage
            self.source = staging.source(
                KVSource, block_size=self.block_sizes[0], rank=self.rank, tp_size=self.tp_size,
                engine=cfg.engine, engine_options=cfg.engine_options, channel=cfg.channel,
                channel_options=cfg.channel_options, reply_timeout=cfg.reply_timeout,
                reuse_slots=False,  # a block is the request's until finished-sending: nothing waits
                **extra,
            )  # fmt: skip
            if cfg.handoff_port is not None:
                from rd2h.layout.topology import base_port
                from rd2h.vllm.handoff import HoldTable
                from rd2h.vllm.handoff_net import HandoffListener
                from rd2h.vllm.vouch import load_secret

                port = base_port(cfg.handoff_port, self.dp_rank, self.tp_size) + self.rank
                self.handoff = HandoffListener(HoldTable(), load_secret(cfg.secret_file), cfg.host, port)
        log.info(
            "rd2h worker rank %d/%d: %d layers, mode %s, %s", self.rank, self.tp_size, len(layouts),
            cfg.mode.value, "decode" if self.consumer else "prefill",
        )

    def _flat(self, blocks: Any, num_tokens: int, first_block: int, *, decode: bool) -> tuple[list[int], int]:
        """Several groups: a request's block ids of every group end to end, and the tokens that
        many blocks hold (what the runtimes count by). ValueError: vLLM's allocation lacks some.
        Both sides move all of Decode's prompt tokens but the last: with a Mamba state group
        Prefill's prompt was cut to those already (rd2h.vllm.state_groups)."""
        size = self.block_sizes[0]
        moved = num_tokens if self._state and not decode else transfer_tokens(num_tokens)
        flat = gather_blocks(self._groups, blocks, moved, first_block * size, decode=decode)
        return flat, len(flat) * size

    def _with_heads(self, name: str, tensors: LayerTensors, layout: Any) -> Any:
        """The layout with the KV heads this rank's blocks hold, where a block holds them
        outermost (vLLM's CPU cache ``[blocks, kv_heads, block_size, 2 * head_size]``): Decode
        then reads a Prefill of another TP size head range by head range. Raises ConfigError
        where heads are not outermost and the configured ``peer_tp`` differs from this TP."""
        if self.kv_heads is None:
            return layout
        from dataclasses import replace

        from rd2h.layout.heads import kv_heads_of

        span = kv_heads_of(self.kv_heads, self.tp_size, self.rank)
        if all(len(t.shape) > 2 and int(t.shape[1]) == span.count for t in tensors.main):
            return replace(layout, heads=span)
        peer = self.config.peer_tp
        if peer is not None and peer != self.tp_size:
            shapes = [tuple(t.shape) for t in tensors.main]
            raise ConfigError(
                f"layer {name!r}: a block of {shapes} does not hold this rank's {span.count} KV head(s) outermost "
                f"(dimension 1), so head ranges of a block cannot be read between this engine's TP {self.tp_size} and "
                f"peer_tp {peer}; use equal TP"
            )
        return layout

    # -- per step ------------------------------------------------------------------------

    def bind(self, meta: StepMetadata) -> None:
        """Apply one step's metadata (once, however often vLLM binds it)."""
        if meta is self._bound:
            return
        self._bound = meta
        if self.sink is not None:
            self._apply_recv(meta)
        if self.source is not None:
            self._apply_send(meta)
        self._apply_holds(meta)
        self._finished_sending.update(meta.release)  # held for targets that never came: nothing reads them

    def _apply_holds(self, meta: StepMetadata) -> None:
        """vLLM's convention: finished requests whose blocks wait for a Decode's ask."""
        from rd2h.vllm.handoff import Held

        deadline = time.monotonic() + self.config.hold_timeout
        for spec in meta.hold:
            if self.handoff is None:  # the scheduler holds only with handoff_port: never here
                self._finished_sending.add(spec.req_id)
                continue
            self.handoff.table.hold(Held(spec.ext_id, spec.req_id, spec.blocks, spec.num_tokens, deadline))

    def _serve_handoffs(self) -> None:
        """Announce every layer of the held requests a Decode asked for (their KV is written:
        vLLM finished them); free those nobody asked for within hold_timeout, or a Decode released."""
        table = self.handoff.table
        for held, reason in table.take_freed(time.monotonic()):
            self.tally.local(reason)
            log.log(logging.WARNING if reason == "hold_expired" else logging.INFO, "Prefill rank %d: request %s (%s) "
                    "%s; its blocks are freed (%s)", self.rank, held.req_id, held.ext_id, _FREED[reason], reason)
            self._finished_sending.add(held.req_id)
        computed = {}
        for held, ask in table.take_claimed():
            self._send_exts.setdefault(held.req_id, set()).add(held.ext_id)
            self._send_req[held.ext_id] = held.req_id
            self._finishing.add((held.ext_id, held.req_id))  # vLLM finished it: report it once sent
            try:
                main, tokens, first = held.blocks[0], held.num_tokens, ask.first_block
                if self._groups:
                    main, tokens = self._flat(held.blocks, held.num_tokens, first, decode=False)
                    first = 0
                self.source.add_request(
                    held.ext_id, ask.endpoint, main_block_ids=main, indexer_block_ids=self._indexer(held.blocks),
                    num_tokens=tokens, first_block=first,
                )  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - this request's problem, never the engine's
                self._send_refused(held.ext_id, held.req_id, exc)
                continue
            computed[held.ext_id] = tokens
        if computed:  # after this step's forward: nothing else is being announced now
            for ext_id, error in self.source.send_all(computed).items():
                log.error("Prefill rank %d: held %s not announced: %s", self.rank, ext_id, error)

    def _apply_recv(self, meta: StepMetadata) -> None:
        # aborts first: vLLM freed an aborted request's blocks at once and may have given them
        # to a request this same step expects
        for ext_id in meta.recv_abort:
            try:
                # returns at once (this is the forward path); reported through take() once no
                # read writes its blocks: ABORTED, or as Prefill confirms it (DONE) when its final
                # layer was already answered. vLLM holds the blocks of a request waiting for
                # remote KV until it is reported finished-receiving, so none is reused before.
                self.sink.abort(ext_id)
            except Exception:  # noqa: BLE001
                log.exception("Decode rank %d: aborting %s failed", self.rank, ext_id)
        for spec in meta.recv:
            indexer = spec.blocks[1] if self.config.mode is Mode.SFA and len(spec.blocks) > 1 else None
            if spec.ext_id in self._recv_req:  # the scheduler claims each id once: a second is refused
                why = f"{spec.ext_id} is already expected for {self._recv_req[spec.ext_id]}"
                self._recv_failed(spec.req_id, why, DuplicateRequestError(why))
                continue
            try:
                main, first = spec.blocks[0], spec.first_block
                if self._groups:
                    main = tuple(self._flat(spec.blocks, spec.num_tokens, first, decode=True)[0])
                    first = 0
                self.sink.expect(spec.ext_id, main, indexer, first_block=first)
            except Exception as exc:  # noqa: BLE001 - this request's problem, never the engine's
                self._recv_failed(spec.req_id, f"cannot expect {spec.ext_id}: {exc}", exc)
                continue
            self._recv_req[spec.ext_id] = spec.req_id
            self._recv_blocks[spec.ext_id] = tuple(main[first:])
            self._expected[spec.ext_id] = 1

    def _recv_failed(self, req_id: str, why: str, error: BaseException) -> None:
        """A pull that cannot start: the request fails now (vLLM frees or recomputes it)."""
        log.error("Decode rank %d: request %s: %s", self.rank, req_id, why)
        self.tally.pull_failed(error)
        self._failed_recving.add(req_id)
        self._finished_recving.add(req_id)

    def _apply_send(self, meta: StepMetadata) -> None:
        for spec in meta.send_new:
            if spec.ext_id in self._send_req:  # the scheduler claims each id once: a second is refused
                log.error("Prefill rank %d: request %s: %s is already sent by request %s", self.rank,
                          spec.req_id, spec.ext_id, self._send_req[spec.ext_id])  # fmt: skip
                self._duplicates.add((spec.ext_id, spec.req_id))
                continue
            self._send_exts.setdefault(spec.req_id, set()).add(spec.ext_id)
            self._send_req[spec.ext_id] = spec.req_id
            try:
                main, tokens, first = spec.blocks[0], spec.num_tokens, spec.first_block
                if self._state and (peer := DecodeEndpoint.parse(spec.endpoint).tp_size) != self.tp_size:
                    raise ConfigError(f"a Mamba state moves only between equal TP: this Prefill has TP {self.tp_size}, "
                                      f"the Decode TP {peer}")  # fmt: skip
                if self._groups:  # the scheduler sends it whole, in the step that computes its last tokens
                    main, tokens = self._flat(spec.blocks, spec.num_tokens, first, decode=False)
                    first = 0
                    self._virtual[spec.ext_id] = (spec.num_tokens, tokens)
                self.source.add_request(
                    spec.ext_id, DecodeEndpoint.parse(spec.endpoint), main_block_ids=main,
                    indexer_block_ids=self._indexer(spec.blocks), num_tokens=tokens, first_block=first,
                )  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - this request's problem, never the engine's
                self._send_refused(spec.ext_id, spec.req_id, exc)
        # targets that came after the KV was (partly) written: the layers written so far go at once
        late = {s.ext_id: self._tokens(s.ext_id, s.written) for s in meta.send_new if s.written and s.ext_id not in self._sent}
        for ext_id, error in (self.source.send_all(late) if late else {}).items():
            log.error("Prefill rank %d: %s not announced: %s", self.rank, ext_id, error)
        for more in meta.send_blocks:
            if more.ext_id in self._sent:
                continue  # refused or already ended: nothing more to announce
            try:
                self.source.extend(more.ext_id, main_block_ids=more.blocks[0], indexer_block_ids=self._indexer(more.blocks) or ())
            except Exception as exc:  # noqa: BLE001
                log.error("Prefill rank %d: %s: more blocks refused: %s", self.rank, more.ext_id, exc)
        computed = {e: self._tokens(e, t) for e, t in meta.computed if e not in self._sent}
        self._sends = bool(computed)
        if self._slots is not None:
            self._slots.new_step()
        if self._sends:
            for ext_id, error in self.source.schedule(computed).items():
                log.error("Prefill rank %d: %s not scheduled: %s", self.rank, ext_id, error)
        for ext_id in meta.send_abort:
            self._forget.add(ext_id)
            req_id = self._send_req.pop(ext_id, None)
            self._send_exts.pop(req_id, None)
            self._sent.pop(ext_id, None)
            self._quiet_abort(ext_id)
        for finish in meta.send_finish:
            key = (finish.ext_id, finish.req_id)
            if key in self._duplicates:  # it never reached the source: vLLM may free it now
                self._duplicates.discard(key)
                self._finished_sending.add(finish.req_id)
                continue
            self._finishing.add(key)
            if finish.aborted:
                self._quiet_abort(finish.ext_id)

    def _tokens(self, ext_id: str, tokens: int) -> int:
        """Tokens as the source counts them (several groups: its flat list, sent whole)."""
        if ext_id not in self._virtual:
            return tokens
        num_tokens, virtual = self._virtual.pop(ext_id)
        return virtual if tokens >= num_tokens else 0

    def _send_refused(self, ext_id: str, req_id: str, error: BaseException) -> None:
        """add_request refused it (a bad endpoint, TP ratio or block): it ends FAILED at once,
        Decode fails it on its deadline, and vLLM gets the request back at its finish."""
        log.error("Prefill rank %d: request %s (%s) is not sent: %s", self.rank, req_id, ext_id, error)
        self._virtual.pop(ext_id, None)
        reason = error if isinstance(error, RD2HError) else RD2HError(str(error))
        self._sent[ext_id] = Outcome(ext_id, TerminalState.FAILED, reason, 0, 0.0, 0.0)
        self.tally.sent(self._sent[ext_id])

    def _quiet_abort(self, ext_id: str) -> None:
        try:
            self.source.abort(ext_id)
        except UnknownRequestError:  # already settled and collected
            pass
        except Exception:  # noqa: BLE001
            log.exception("Prefill rank %d: aborting %s failed", self.rank, ext_id)

    def _indexer(self, blocks: tuple[tuple[int, ...], ...]) -> tuple[int, ...] | None:
        return blocks[1] if self.config.mode is Mode.SFA and len(blocks) > 1 else None

    def save_layer(self, layer_name: str, kv_layer: Any) -> None:
        """Prefill: the layer is written for this step; announce it. Waits on Decode only when
        the KV is staged through a host mirror (device KV the engine cannot read,
        :mod:`rd2h.staging`): a mirror slot is refilled once Decode replied to the layer it
        held, bounded by the reply timeout; otherwise no slot is reused and nothing waits. Never
        raises into vLLM's forward: a layer that cannot be
        announced is logged, and Decode fails the requests that miss it (a final signal that
        does not cover every layer is refused)."""
        if not self._sends:
            return
        if self._slots is not None:  # several groups: a slot is written once every layer viewing it was
            if (slot := self._slots.saved(layer_name)) is None:
                return
            layer_name = slot
        elif layer_name not in self._tensors:
            return
        try:
            self.source.layer_ready(layer_name, record_event(kv_layer))
        except Exception:  # noqa: BLE001
            log.exception("Prefill rank %d: layer %r could not be announced", self.rank, layer_name)

    def forward_done(self) -> None:
        """Prefill, after the step's forward (vLLM's ``wait_for_save``): announce the slots that
        hold a Mamba layer, whose state the forward wrote without calling any save hook."""
        if not self._sends:
            return
        for slot in self._state_slots:
            try:
                self.source.layer_ready(slot, record_event(self._tensors[slot].main[0]))
            except Exception:  # noqa: BLE001
                log.exception("Prefill rank %d: layer %r could not be announced", self.rank, slot)

    def step_done(self) -> None:
        self._sends = False
        if self._slots is not None:
            self._slots.new_step()

    # -- results -------------------------------------------------------------------------

    def transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving) request ids, each once."""
        self._wait_when_idle()
        if self.sink is not None:
            for ext_id, outcome in self.sink.take().items():
                req_id = self._recv_req.pop(ext_id, None)
                blocks = self._recv_blocks.pop(ext_id, ())
                if req_id is None:
                    continue
                self.tally.pulled(outcome)
                if not outcome.ok:
                    level = logging.INFO if outcome.state is TerminalState.ABORTED else logging.WARNING
                    log.log(level, "Decode rank %d: %s %s: %s", self.rank, ext_id, outcome.state.name, outcome.error)
                    self._failed_recving.add(req_id)
                    self._load_errors.update(blocks)
                self._finished_recving.add(req_id)
        if self.source is not None:
            if self.handoff is not None:
                self._serve_handoffs()
            for ext_id, outcome in self._take_sent().items():
                self.tally.sent(outcome)
                if ext_id in self._forget:  # preempted: vLLM owns its blocks again
                    self._forget.discard(ext_id)
                else:
                    self._sent[ext_id] = outcome
            for ext_id, req_id in list(self._finishing):
                outcome = self._sent.pop(ext_id, None)
                if outcome is None:
                    continue
                if not outcome.ok:
                    log.warning("Prefill rank %d: %s %s: %s", self.rank, ext_id, outcome.state.name, outcome.error)
                self._finishing.discard((ext_id, req_id))
                self._send_req.pop(ext_id, None)
                waiting = self._send_exts.get(req_id, set())
                waiting.discard(ext_id)
                if not waiting:  # every sample's Decode is done with the blocks
                    self._send_exts.pop(req_id, None)
                    self._finished_sending.add(req_id)
        results = self._finished_sending, self._finished_recving, self._failed_recving
        self._finished_sending, self._finished_recving, self._failed_recving = set(), set(), set()
        return results

    def load_errors(self) -> set[int]:
        """Block ids (main group) that failed pulls left unwritten since the last call: for a
        vLLM that takes failures only as ``get_block_ids_with_load_errors``."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def _wait_when_idle(self) -> None:
        """A step with nothing to compute and transfers in flight comes back at once, and vLLM
        steps again: on a CPU host its engine and workers then spin through empty steps and
        take the cores the Prefill engine computes on (Decode workers at 70% CPU each and
        Prefill steps of 23 s at TP 2 on 2 cores). Such a step waits up to ``IDLE_WAIT_SECONDS``
        for a transfer to end; it returns at once when one does. A step that made this worker
        expect a request does not wait: its report goes out with the step, and the rendezvous
        (Prefill's start) waits for that report."""
        if self._bound is None or not self._bound.idle or self._bound.recv:
            return
        if self.sink is not None and self._recv_req:
            self.sink.wait_any(IDLE_WAIT_SECONDS)
        elif self.source is not None and self._finishing:
            self.source.wait_any(IDLE_WAIT_SECONDS)
        elif self.handoff is not None and len(self.handoff.table):  # held: an ask may come
            self.handoff.table.wait(IDLE_WAIT_SECONDS)

    def _take_sent(self) -> dict[str, Outcome]:
        take = getattr(self.source, "take", None) or self.source.take_finished
        return take()

    def stats(self) -> RD2HStats | None:
        """This rank's transfer statistics since the last call (vLLM asks after every step)."""
        return self.tally.take(self.sink)

    def worker_report(self) -> WorkerReport | None:
        if not self._expected:
            return None
        report, self._expected = WorkerReport(self._expected), {}
        return report

    def close(self) -> None:
        if self.handoff is not None:
            self.handoff.close()
        for runtime in (self.source, self.sink):
            if runtime is not None:
                runtime.close()
        self.source = self.sink = None
