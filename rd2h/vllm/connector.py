"""``RD2HConnector``: vLLM's KV Connector V1 over rd2h.

A thin facade: the scheduler role delegates to :class:`~rd2h.vllm.scheduler.RD2HScheduler`,
the worker role to :class:`~rd2h.vllm.worker.RD2HWorker`. Roles: ``kv_producer`` (Prefill),
``kv_consumer`` (Decode), ``kv_both``. Settings come from ``kv_connector_extra_config``
(:class:`~rd2h.vllm.config.ConnectorConfig`).

Under vLLM's ``MultiConnector`` rd2h must be listed first (docs/vllm.md, "Composition"): the
first child that reports matched tokens loads a request, and rd2h's Prefill announces a layer
before any later child sees it. A Decode request rd2h matched but vLLM gave to another loader
is logged and counted (``load_not_taken``), never left waiting. Speculative decoding whose
drafter has a KV cache of its own (draft model, EAGLE, MTP...) is refused at startup: rd2h
does not transfer a drafter's KV (n-gram and the other drafters without KV are served).

Hooks that exist only in some vLLM versions (vllm-ascend's ``wait_for_layer_send``,
``on_kv_cache_written``, ``requires_full_blocks_on_update_after_alloc``; upstream's
``get_transfer_results`` with ``failed_recving``, and the transfer statistics of
:mod:`rd2h.vllm.stats`) are defined here and harmless where nobody calls them.
"""

from __future__ import annotations

import logging
from functools import cached_property
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from rd2h.errors import ConfigError
from rd2h.vllm.config import ConnectorConfig, Mode
from rd2h.vllm.finished import FailedLoads
from rd2h.vllm.kv_groups import check_groups
from rd2h.vllm.metadata import StepMetadata
from rd2h.vllm.parallel import check_parallel, decode_stages, pipeline_stage, port_rank
from rd2h.vllm.params import PARAMS_KEY, accept_prefill_leg
from rd2h.vllm.scheduler import RD2HScheduler
from rd2h.vllm.state_groups import PromptTruncation, check_state_engine, check_state_pages
from rd2h.vllm.stats import RD2HStats, SchedulerTally, build_prom_metrics
from rd2h.vllm.vouch import load_secret
from rd2h.vllm.worker import RD2HWorker

try:  # vLLM >= 0.11: connectors that take every KV cache group at once
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
except ImportError:  # pragma: no cover - older vLLM
    SupportsHMA = object  # type: ignore[assignment,misc]

try:  # vLLM 0.32: failures per request, not as a flat block set
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorTransferResults,
    )
except ImportError:  # pragma: no cover - older vLLM
    KVConnectorTransferResults = None  # type: ignore[assignment,misc]

if TYPE_CHECKING:
    import torch

__all__ = ["RD2HConnector"]

log = logging.getLogger("rd2h.vllm")


def _block_sizes(vllm_config: Any, kv_cache_config: Any) -> list[int]:
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    sizes = [int(g.kv_cache_spec.block_size) for g in groups]
    return sizes or [int(vllm_config.cache_config.block_size)]


def _log_like_vllm() -> None:
    """rd2h's log lines go where vLLM's go (vLLM configures only its own logger)."""
    ours, theirs = logging.getLogger("rd2h"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.getEffectiveLevel())
    ours.propagate = False


def _kv_heads(model_config: Any) -> int | None:
    """The model's KV heads where the paged cache is split by them (dense GQA/MHA); None for
    MLA (one latent, the same on every rank), a model without attention layers (pure Mamba) or
    a model config that does not say."""
    if bool(getattr(model_config, "use_mla", False)):
        return None
    total = getattr(model_config, "get_total_num_kv_heads", None)
    heads = int(total()) if callable(total) else 0
    return heads or None  # 0: no attention layer (a pure Mamba model), nothing split by KV heads


def _check_topology(config: ConnectorConfig, tp: int, kv_heads: int | None) -> None:
    """What can be refused before any peer is seen (``peer_tp`` is the other side's TP, where
    configured): the two TP sizes must divide one another, and with a GQA/MHA model
    (``kv_heads``) the other side must split the KV heads as vLLM does (a multiple of its TP, or
    its TP a multiple of them). Decode reads each block's head range from the Prefill ranks
    that hold it (``rd2h.layout.heads``); MLA's latent is the same on every rank."""
    peer = config.peer_tp
    if config.mode is not Mode.DENSE or peer is None or peer == tp:
        return
    from rd2h.layout.heads import check_heads
    from rd2h.layout.topology import Topology

    try:
        Topology(peer, tp)  # the same check either way round
        if kv_heads is not None:
            check_heads(kv_heads, peer, "peer_tp's")
    except ConfigError as exc:
        raise ConfigError(f"this engine has TP {tp}, peer_tp is {peer}: {exc}") from None


def _check_speculative(vllm_config: Any) -> None:
    """Refuse a drafter with KV cache layers of its own: vLLM registers them beside the model's
    and Decode's drafter would need their prompt KV, which rd2h does not transfer (a Decode
    waits for layers no Prefill announces; a Prefill's drafter writes its KV after the step's
    announcements). Drafters without KV (n-gram, suffix, Medusa, MLP speculator) change nothing
    the connector moves."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return
    method = getattr(spec, "method", None)
    uses_kv = getattr(spec, "uses_draft_kv_cache", None)
    if (callable(uses_kv) and uses_kv()) or method not in _DRAFTERS_WITHOUT_KV:
        raise ConfigError(
            f"rd2h does not transfer a drafter's KV cache: speculative decoding method {method!r} is not one whose "
            f"drafter has no KV cache ({', '.join(_DRAFTERS_WITHOUT_KV)}). A drafter's KV cache layers (draft "
            "model, EAGLE, MTP...) are registered beside the model's, but no Prefill announces them for Decode's "
            "drafter. Use method 'ngram' on Decode (tested), or run this engine without --speculative-config"
        )


_DRAFTERS_WITHOUT_KV = ("ngram", "ngram_gpu", "suffix", "medusa", "mlp_speculator")


def _known_by_name(cls: type) -> None:
    """Put ``cls`` in vLLM's connector registry under its class name. ``MultiConnector`` files
    its children's statistics under their class names and, where they crossed processes
    (always: vLLM sends a dict), rebuilds them by looking that name up in the registry: a
    subclass loaded by ``kv_connector_module_path`` (the tests' own) was not there, and the
    engine's stats logger raised on every step."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    registry = getattr(KVConnectorFactory, "_registry", {})
    if cls.__name__ in registry or "<locals>" in cls.__qualname__:
        return
    try:
        KVConnectorFactory.register_connector(cls.__name__, cls.__module__, cls.__qualname__)
    except ValueError:  # registered meanwhile (vLLM's plugin loader, another thread)
        pass


class RD2HConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """Disaggregated Prefill/Decode by layer-wise pull. See ``docs/vllm.md``."""

    worker_class: type[RD2HWorker] = RD2HWorker  # the worker role's state (a subclass may extend it)
    _failed_loads = cached_property(lambda self: FailedLoads())  # loads a hook's error left waiting (finished.py)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _known_by_name(cls)

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _log_like_vllm()
        transfer = vllm_config.kv_transfer_config
        self.rd2h_config = ConnectorConfig.from_extra(transfer.kv_connector_extra_config)
        consumer, producer = bool(transfer.is_kv_consumer), bool(transfer.is_kv_producer)
        secret = load_secret(self.rd2h_config.secret_file)  # refused at startup, never per request
        if consumer and not self.rd2h_config.metaserver:  # it can still serve vLLM's convention
            log.warning(
                "rd2h Decode without kv_connector_extra_config 'metaserver': requests from rd2h proxy (which needs "
                "the proxy's rendezvous URL, http://PROXY/v1/rd2h/rendezvous) are computed here; only vLLM's P/D "
                "convention (a Prefill with 'handoff_port') is pulled"
            )
        parallel = vllm_config.parallel_config
        tp = int(parallel.tensor_parallel_size)
        handoff = self.rd2h_config.handoff_port is not None
        speculative = getattr(vllm_config, "speculative_config", None) is not None
        # pipeline parallel: served for one attention group in dense mode, alone (see check_parallel)
        check_parallel(
            parallel, consumer=consumer, handoff=handoff, speculative=speculative,
            groups=len(getattr(kv_cache_config, "kv_cache_groups", None) or ()), mode=self.rd2h_config.mode.value,
        )  # fmt: skip
        _check_speculative(vllm_config)  # a drafter with KV layers of its own: refused at startup
        # ports: the global DP rank (vLLM resets data_parallel_rank for dense DP) x pipeline stages
        dp_rank = port_rank(parallel)
        # every KV cache group is pulled or the engine does not start (hybrid allocator, mamba...)
        check_groups(kv_cache_config, self.rd2h_config.mode)
        state = check_state_engine(
            kv_cache_config, pp=int(getattr(parallel, "pipeline_parallel_size", 1) or 1), tp=tp,
            peer_tp=self.rd2h_config.peer_tp, handoff=handoff, speculative=speculative,
            replay=bool(getattr(vllm_config.cache_config, "use_replayssm", False)),
            layout=getattr(vllm_config.cache_config, "kv_cache_layout", None),
        )  # fmt: skip
        # a Mamba state: Prefill computes a request's prompt short of its last token (on_new_request)
        self._truncation = PromptTruncation() if state and producer else None
        self._secret = secret  # the proxy's signature on a Prefill leg, checked before its prompt is cut
        sizes = _block_sizes(vllm_config, kv_cache_config)
        kv_heads = _kv_heads(vllm_config.model_config)
        _check_topology(self.rd2h_config, tp, kv_heads)
        self._scheduler: RD2HScheduler | None = None
        self._worker: RD2HWorker | None = None
        self._local = SchedulerTally()
        self._matched: dict[str, int] = {}  # Decode: req id -> tokens rd2h said it would pull
        self._not_taken = 0  # ... that vLLM then allocated without them (another loader took it)
        self._hook_errors = 0  # guarded scheduler hooks that raised (each also in self._local by hook)
        self._match_failed = 0  # ... of them get_num_new_matched_tokens: the request served locally
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = RD2HScheduler(
                self.rd2h_config, consumer=consumer, producer=producer, block_sizes=sizes, tp_size=tp,
                dp_rank=dp_rank, world_size=int(parallel.world_size), secret=secret, stages=decode_stages(vllm_config),
                prefix_caching=bool(getattr(vllm_config.cache_config, "enable_prefix_caching", False)),
                # a vLLM without the setting fails a failed load
                load_failure_policy=str(getattr(transfer, "kv_load_failure_policy", "fail")),
                engine_id=str(getattr(transfer, "engine_id", "") or ""), state=state,
            )
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self._worker = self.worker_class(
                self.rd2h_config, consumer=consumer, producer=producer, rank=get_tensor_model_parallel_rank(),
                tp_size=tp, dp_rank=dp_rank + pipeline_stage().get("pp_rank", 0), block_sizes=sizes,
                kv_cache_config=kv_cache_config,
                kv_heads=kv_heads,
            )

    @property
    def scheduler(self) -> RD2HScheduler:
        assert self._scheduler is not None, "a scheduler-side call on a worker connector"
        return self._scheduler

    @property
    def worker(self) -> RD2HWorker:
        assert self._worker is not None, "a worker-side call on a scheduler connector"
        return self._worker

    # -- worker side ---------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        cache_config = getattr(self._vllm_config, "cache_config", None)
        check_state_pages(self._kv_cache_config, kv_caches, getattr(cache_config, "kv_cache_layout", None))
        num_blocks = getattr(self._kv_cache_config, "num_blocks", None)
        self.worker.register(kv_caches, {n: num_blocks or int(t.shape[0]) for n, t in kv_caches.items()})

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if isinstance(connector_metadata, StepMetadata):
            self._failed_loads.bind(connector_metadata)
            try:  # each request's problem is settled inside; this only keeps a bug from the engine
                self.worker.bind(connector_metadata)
            except Exception:  # noqa: BLE001
                self.worker.tally.hook_error("bind_connector_metadata")
                log.exception("rd2h: applying a step's metadata failed; the engine goes on (counted in "
                              "vllm:rd2h_hook_errors_total)")  # fmt: skip

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        if self._worker is not None:
            self._worker.step_done()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Nothing to start: pulls run on the sink's thread from the moment the step's
        metadata was bound, and a request is scheduled only once all of it arrived."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for (see :meth:`start_load_kv`)."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        self.worker.save_layer(layer_name, kv_layer)

    def wait_for_save(self) -> None:
        """Sends are asynchronous: the blocks stay held until finished-sending. The forward
        ended: a Mamba layer's slot is announced now (vLLM calls no save hook for it)."""
        if self._worker is not None:
            self._worker.forward_done()

    def wait_for_layer_send(self, layer_name: str) -> None:
        """vllm-ascend: before the layer's buffers are overwritten (layerwise Prefill)."""
        source = self.worker.source
        if source is not None:
            source.wait_for_layer_send(layer_name)

    def on_kv_cache_written(self, layer_name: str, kv_layer: Any = None, *args: Any, **kwargs: Any) -> None:
        """vllm-ascend: the layer's KV was written; announced as ``save_kv_layer`` does."""
        self.worker.save_layer(layer_name, kv_layer)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving, _ = self.worker.transfer_results()
        recving |= self._failed_loads.take()  # older vLLM: their blocks are load errors
        return sending or None, recving or None

    if KVConnectorTransferResults is not None:

        def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
            sending, recving, failed = self.worker.transfer_results()
            lost = self._failed_loads.take()  # failed on a scheduler hook's error: no worker knew of them
            return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving | lost,
                                              failed_recving=failed | lost)  # fmt: skip

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks a failed pull left unwritten, so that vLLM recomputes or fails the request
        (its ``kv_load_failure_policy``) instead of decoding on them. A vLLM with
        ``KVConnectorTransferResults`` takes the failed requests themselves (per request, every
        KV cache group); only an older one needs the blocks (main group)."""
        if self._worker is None:
            return set()
        errors = self._worker.load_errors() | self._failed_loads.take_blocks()
        return set() if KVConnectorTransferResults is not None else errors

    def build_connector_worker_meta(self) -> Any:
        return self.worker.worker_report()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    # -- scheduler side ------------------------------------------------------------------

    # The per-request scheduler hooks settle what a request brings inside (rd2h.vllm.scheduler);
    # the guards here only keep an unforeseen bug from killing the engine: the request gets the
    # safe answer (rd2h.vllm.finished), and the error is logged and counted (_hook_failed).

    def _hook_failed(self, hook: str, request: Any, what: str) -> None:
        """A guarded scheduler hook raised: logged with its traceback and counted by hook
        (``vllm:rd2h_hook_errors_total{hook}``), never silent."""
        self._local.hook_error(hook)
        self._hook_errors += 1
        log.exception("rd2h: request %s: %s raised; %s (%d hook errors so far, counted in "
                      "vllm:rd2h_hook_errors_total)", getattr(request, "request_id", "?"), hook, what,
                      self._hook_errors)  # fmt: skip

    def on_new_request(self, request: Any) -> None:
        """A Prefill request for rd2h proxy's Decode, with a Mamba state group: computed short
        of its last prompt token, whose state Decode computes on the one it pulls. Only params
        the proxy signed for this leg cut it: anything else is left as the client sent it (the
        scheduler refuses it at allocation, and the request is computed whole)."""
        if self._truncation is None:
            return
        try:
            signed = self._signed_prefill(request)
            if signed == "first_token":  # its sampled token goes to the client: a cut prompt would change it
                self._truncation.refuse(request.request_id, "its first token is the client's (rd2h proxy "
                                        "--first-token-from-prefill), so its prompt is computed whole")  # fmt: skip
            elif signed:
                self._truncation.truncate(request)
        except Exception:  # noqa: BLE001
            self._hook_failed("on_new_request", request, "its prompt is not cut")

    def _signed_prefill(self, request: Any) -> bool | str:
        """``request`` carries Prefill params the scheduler accepts (signed by the proxy, for
        this leg and this request, in date), with their targets or targets to come: True, or
        ``"first_token"`` where its sampled token is the client's first token; False for none."""
        params = getattr(request, "kv_transfer_params", None) or {}
        if not (isinstance(params, dict) and params.get("do_remote_decode") and PARAMS_KEY in params):
            return False
        try:
            targets, later = accept_prefill_leg(self._secret, params[PARAMS_KEY], request.request_id,
                                                self.scheduler._clock())  # fmt: skip
        except ValueError:
            return False
        if later is None:
            return bool(targets)  # none: Decode loads nothing of it, no state to continue from
        return "first_token" if later.first else True

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        if request.request_id in self._failed_loads.gave_up:  # its load failed on a hook's error: computed here
            return 0, False
        try:
            count, load_async = self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)
        except Exception:  # noqa: BLE001
            self._match_failed += 1  # also a local recompute: scheduler_error
            self._hook_failed("get_num_new_matched_tokens", request, "it is served locally")
            return 0, False
        if count:
            self._matched[request.request_id] = count
        else:  # asked again (its allocation failed) and nothing now: an earlier match is not a load not taken
            self._matched.pop(request.request_id, None)
        return count, load_async

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        matched = self._matched.pop(getattr(request, "request_id", None), 0)
        try:
            if matched and not num_external_tokens:
                self._load_not_taken(request, matched)
                return
            if self._uncut(request):
                return
            self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)
        except Exception:  # noqa: BLE001
            waits = bool(matched and num_external_tokens)  # vLLM waits for KV that no worker knows of
            self._hook_failed("update_state_after_alloc", request, "its load fails" if waits else "nothing more")
            if waits:  # each worker reports it finished-receiving and failed in the next step
                self._failed_loads.fail(request, blocks)
            self._guarded("update_state_after_alloc", request, self.scheduler.undo_alloc, request, waits)

    def _uncut(self, request: Any) -> bool:
        """A Mamba model's Prefill leg, signed, whose prompt was not cut short of its last token
        (a vLLM that never called ``on_new_request``, a prompt that cannot be cut): the state it
        holds is one token past the one Decode continues from, so it is not sent (computed as a
        plain request, refused once: logged, counted in ``state_uncut``). Params that are not
        signed are the scheduler's to refuse."""
        if self._truncation is None or request.request_id in self._truncation:
            return False
        if not self._signed_prefill(request):
            return False
        self._truncation.refuse(request.request_id, "on_new_request did not cut it")
        return True

    def _load_not_taken(self, request: Any, matched: int) -> None:
        """rd2h said it would pull ``matched`` tokens, and vLLM allocated the request without
        them: under MultiConnector a child listed before rd2h reported a hit and loads it, or
        vLLM's scheduler dropped the load. Nothing is pulled or posted; rd2h's claim on the
        request's id is released (the finish hook does exactly that for a request that pulls
        nothing) so that it cannot block a later request."""
        self._not_taken += 1
        log.warning(
            "request %s: rd2h matched %d prompt tokens to pull but vLLM allocated it without them (under "
            "MultiConnector a connector listed before rd2h loads it: list rd2h first; else vLLM's scheduler dropped "
            "the load, e.g. for prompt_logprobs); no rendezvous is posted and the request is served without rd2h "
            "(%d such requests so far)",
            request.request_id, matched, self._not_taken,
        )  # fmt: skip
        self.scheduler.request_finished(request, ((),))

    def requires_full_blocks_on_update_after_alloc(self) -> bool:
        """vllm-ascend: rd2h wants every block of the request (the whole table from 0)."""
        return True

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        try:
            meta = self.scheduler.build_connector_meta(scheduler_output)
        except Exception:  # noqa: BLE001
            self._hook_failed("build_connector_meta", None, "sends it would have started are not sent")
            meta = self.scheduler.meta_after_error()
        return self._failed_loads.attach(meta)

    def update_connector_output(self, connector_output: Any) -> None:
        self._guarded("update_connector_output", None, self.scheduler.update_connector_output, connector_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._failed_loads.gave_up.discard(request.request_id)
        self._matched.pop(request.request_id, None)
        try:
            if self._truncation is not None:
                self._truncation.finished(request.request_id)
            return self.scheduler.request_finished(request, block_ids)
        except Exception:  # noqa: BLE001
            self._hook_failed("request_finished", request, "its blocks are held only while a send may read them")
            return self.scheduler.finish_after_error(request)

    def _guarded(self, hook: str, request: Any, call: Any, *args: Any) -> None:
        try:
            call(*args)
        except Exception:  # noqa: BLE001
            self._hook_failed(hook, request, "the engine goes on")

    # -- statistics (vLLM's KVConnectorStats: its log line and its /metrics) ----------------

    def get_kv_connector_stats(self) -> RD2HStats | None:
        """What happened since the last call: vLLM asks each worker after every step, and the
        scheduler's connector after it took the workers' output; it sums what it gets."""
        if self._worker is not None:
            return self._worker.stats()
        if self._scheduler is not None:
            uncut = self._truncation.refused if self._truncation is not None else 0
            return self._local.take({**self._scheduler.stats, "load_not_taken": self._not_taken, "state_uncut": uncut,
                                     "scheduler_error": self._match_failed})  # fmt: skip
        return None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> RD2HStats:
        """The stats object for a payload that crossed processes (the API process's logger)."""
        return RD2HStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> Any:
        """The ``vllm:rd2h_*`` series on vLLM's ``/metrics`` (rd2h.vllm.stats, docs/vllm.md)."""
        return build_prom_metrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        return None  # any layout whose blocks are dense pages on dimension 0 (or [2, blocks, ...])


_known_by_name(RD2HConnector)  # kv_connector_module_path without the entry point: MultiConnector's stats
