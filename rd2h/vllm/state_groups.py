"""Mamba state groups (vLLM's ``MambaSpec``) in ``dense`` mode: what is pulled, what is refused.

A Mamba layer keeps no KV per position: with prefix caching off (``mamba_cache_mode``
``'none'``) a request holds one block in the Mamba group, updated in place, that holds the
state after the tokens computed so far (conv and SSM state in one page). There is no prefix
of it to pull: Decode must get the state of exactly the tokens it loads. So Prefill computes
all prompt tokens but the last (:func:`truncate_for_prefill`, from vLLM's ``on_new_request``
hook), Decode loads those (:func:`rd2h.vllm.kv_groups.transfer_tokens`) and computes the last
one on the state it received: both count the same tokens, the Mamba block moves whole (one
block per request) beside the attention groups' blocks of those tokens.

vLLM pads every group's page to one size (``page_size_padded``) and overlays the groups in
one allocation: a Mamba layer's registered cache is a byte view of the page's used part. The
worker registers the whole page (:func:`page_view`), inside the registered allocation.

Refused at startup with the reason (:func:`state_problem`, :func:`check_state_engine`):
``mamba_cache_mode`` ``'align'``/``'all'`` (prefix caching: states per block position),
speculative decoding (trailing scratch blocks), a ``mamba_type`` not tested (its state
layout may differ), ``sfa`` mode, pipeline parallel, a TP other than the peer's, vLLM's
P/D convention (``handoff_port``: its Prefill computes the whole prompt), ReplaySSM
(``use_replayssm``) and a block-outermost KV cache layout whose state pages are not dense.

Pure apart from :func:`page_view` (torch): reads vLLM's objects by their attributes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from rd2h.errors import ConfigError

__all__ = [
    "STATE_SPEC", "TESTED_MAMBA_TYPES", "is_state_spec", "state_problem", "check_state_engine",
    "PromptTruncation", "check_state_pages", "page_view",
]  # fmt: skip

log = logging.getLogger("rd2h.vllm.scheduler")

STATE_SPEC = "MambaSpec"
# vLLM's MambaAttentionBackendEnum names whose state layout an engine test moved token-exactly
# (tests/e2e/test_vllm_mamba.py): Mamba2 mixers (Mamba2ForCausalLM, GraniteMoeHybrid...)
TESTED_MAMBA_TYPES = frozenset({"MAMBA2"})


def is_state_spec(spec: Any) -> bool:
    """``spec`` is exactly vLLM's ``MambaSpec`` (a subclass may allocate otherwise: refused)."""
    return type(spec).__name__ == STATE_SPEC


def _mamba_type(spec: Any) -> str:
    kind = getattr(spec, "mamba_type", None)
    return str(getattr(kind, "name", kind))


def state_problem(spec: Any) -> str | None:
    """Why a ``MambaSpec`` group cannot be pulled, or None where it can."""
    mode = str(getattr(spec, "mamba_cache_mode", "none"))
    if mode != "none":
        return (f"mamba_cache_mode {mode!r} (prefix caching keeps a state per block position; rd2h moves the one "
                "state of mode 'none': run with --no-enable-prefix-caching)")  # fmt: skip
    spec_blocks = int(getattr(spec, "num_speculative_blocks", 0) or 0)
    if spec_blocks:
        return f"{spec_blocks} speculative state blocks per request (speculative decoding is not supported with Mamba)"
    kind = _mamba_type(spec)
    if kind not in TESTED_MAMBA_TYPES:
        return f"mamba_type {kind} (tested: {', '.join(sorted(TESTED_MAMBA_TYPES))}; its state layout may differ)"
    return None


def _layout_problem(kv_cache_config: Any, layout: str | None) -> str | None:
    """A Mamba group whose pages are not dense in the allocation: under a block-outermost
    layout (vLLM's ``kv_cache_tensors`` with ``block_stride`` past the page, e.g. BLHNC with
    several layers per group) one block holds every layer's page, and the worker registers a
    slot's pages as ``block_stride`` apart (:func:`page_view`): it would move other layers'
    pages with each block and run past the allocation."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    pages = {n: int(g.kv_cache_spec.page_size_bytes) for g in groups if is_state_spec(g.kv_cache_spec)
             for n in g.layer_names}  # fmt: skip
    for tensor in getattr(kv_cache_config, "kv_cache_tensors", None) or ():
        page = next((pages[n] for n in tensor.layers if n in pages), None)
        stride = int(getattr(tensor, "block_stride", page or 0) or 0)
        if page is not None and stride != page:
            return (f"KV cache layout {layout or '(not named)'}: its blocks are {stride} bytes apart for Mamba state "
                    f"pages of {page} bytes (a block-outermost layout keeps every layer's page of a block together; "
                    "rd2h moves a state slot's pages only when they are dense: use a layer-outermost layout, "
                    "e.g. VLLM_KV_CACHE_LAYOUT=LBHNC)")  # fmt: skip
    return None


def check_state_engine(
    kv_cache_config: Any, *, pp: int, tp: int, peer_tp: int | None, handoff: bool, speculative: bool,
    replay: bool = False, layout: str | None = None,
) -> bool:
    """True where the engine has a Mamba state group; raises ConfigError for a layout rd2h
    does not serve with one: pipeline parallel, a ``peer_tp`` other than this TP (the state
    is split by heads, moved only rank to rank), vLLM's P/D convention (``handoff``),
    speculative decoding, ``cache_config.use_replayssm`` (``replay``: not tested with rd2h)
    and a KV cache ``layout`` whose state pages are not dense (:func:`_layout_problem`)."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    if not any(is_state_spec(g.kv_cache_spec) for g in groups):
        return False
    paged = _layout_problem(kv_cache_config, layout)
    problems = [
        why for why, present in (
            (f"pipeline parallel (pipeline_parallel_size={pp})", pp > 1),
            (f"a peer TP of {peer_tp} beside this engine's TP {tp} (a Mamba state moves only between ranks of equal "
             "TP)", peer_tp is not None and peer_tp != tp),
            ("handoff_port (vLLM's P/D convention: its Prefill computes the whole prompt, so the state it holds is "
             "one token past what Decode loads; use rd2h proxy)", handoff),
            ("speculative decoding", speculative),
            ("cache_config.use_replayssm (ReplaySSM keeps recent SSM inputs and writes the state back only on a "
             "flush: the page rd2h moves is not known to hold the state; not tested with rd2h)", replay),
            (paged or "", paged is not None),
        ) if present
    ]  # fmt: skip
    if problems:
        raise ConfigError(
            "rd2h cannot transfer this model's Mamba state group with " + "; ".join(problems)
            + ". See docs/vllm.md, 'Support matrix'."
        )
    return True


def _uncuttable(request: Any) -> str | None:
    """Why ``request``'s prompt cannot be cut by one token without leaving it inconsistent, or
    None where it can: every list and count :meth:`PromptTruncation.truncate` changes is
    checked before it changes any (vLLM's ``Request`` keeps the prompt twice and counts it)."""
    tokens = getattr(request, "prompt_token_ids", None)
    if getattr(request, "prompt_embeds", None) is not None:
        return "a prompt of embeddings"
    if not isinstance(tokens, list):
        return "no prompt token ids"
    if len(tokens) < 2:
        return f"a prompt of {len(tokens)} token: it cannot be computed short of its last token"
    every, count = getattr(request, "_all_token_ids", None), getattr(request, "num_prompt_tokens", None)
    if (not isinstance(every, list) or every is tokens or isinstance(count, bool) or not isinstance(count, int)
            or not len(every) == len(tokens) == count or not hasattr(request, "max_tokens")):  # fmt: skip
        return (f"a request whose token lists rd2h cannot cut consistently (prompt_token_ids {len(tokens)}, "
                f"_all_token_ids {len(every) if isinstance(every, list) else 'absent'}, num_prompt_tokens "
                f"{count!r}): a vLLM Request rd2h does not know")  # fmt: skip
    return None


class PromptTruncation:
    """Prefill's side of the state handoff: a request sent to Decode computes all prompt
    tokens but the last, so that the state it sends is the one Decode continues from. Each
    request is truncated once (a preempted request comes back without a second
    ``on_new_request``, but the guard does not rely on it); the guard lives here, not in the
    request's ``kv_transfer_params``, which a client writes. A request that cannot be cut is
    refused once (:meth:`refuse`: logged, counted in ``refused``) however often it is seen."""

    def __init__(self) -> None:
        self._done: set[str] = set()
        self._uncut: set[str] = set()  # not cut, refused to send (said once)
        self.refused = 0

    def truncate(self, request: Any) -> bool:
        """Drop the last prompt token of ``request`` (once); False where it cannot be (a prompt
        of one token or of embeddings only, token lists that disagree: refused, the request
        untouched). Every precondition is checked before the first change."""
        req_id = request.request_id
        if req_id in self._done or req_id in self._uncut:
            return False
        why = _uncuttable(request)
        if why is not None:
            self.refuse(req_id, why)
            return False
        del request.prompt_token_ids[-1]
        del request._all_token_ids[-1]
        request.num_prompt_tokens -= 1
        request.max_tokens = 1  # its token is discarded: Decode samples the first one
        self._done.add(req_id)
        return True

    def refuse(self, req_id: str, why: str) -> bool:
        """``req_id``'s prompt was not cut (``why``): the state it would send is one token past
        the one Decode continues from, so it is computed here and not sent. Logged and counted
        the first time (True); False, and nothing said, after."""
        if req_id in self._uncut:
            return False
        self._uncut.add(req_id)
        self.refused += 1
        log.warning(
            "request %s: its prompt is not computed short of its last token (%s), so the Mamba state it holds is "
            "not the one Decode continues from: computed here and not sent (%d such requests so far)",
            req_id, why, self.refused,
        )  # fmt: skip
        return True

    def finished(self, req_id: str) -> None:
        self._done.discard(req_id)
        self._uncut.discard(req_id)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._done


def check_state_pages(kv_cache_config: Any, caches: Mapping[str, Any], layout: str | None = None) -> None:
    """Raises ConfigError where a registered Mamba layer's cache does not step one page of its
    group (``page_size_bytes``: the padded page) from block to block: :func:`page_view` takes
    that step as the page, and a block-outermost layout's step spans every layer's page."""
    for group in getattr(kv_cache_config, "kv_cache_groups", None) or []:
        if not is_state_spec(group.kv_cache_spec):
            continue
        page = int(group.kv_cache_spec.page_size_bytes)
        for name in group.layer_names:
            cache = caches.get(name)
            step = None if cache is None else int(cache.stride(0)) * int(cache.element_size())
            if step is not None and step != page:
                raise ConfigError(
                    f"rd2h: Mamba layer {name} is registered with blocks {step} bytes apart for pages of {page} bytes: "
                    f"KV cache layout {layout or '(not named)'} does not keep a state page dense (a block-outermost "
                    "layout keeps every layer's page of a block together); use a layer-outermost layout, e.g. "
                    "VLLM_KV_CACHE_LAYOUT=LBHNC"
                )  # fmt: skip


def page_view(members: Iterable[Any], num_blocks: int) -> Any:
    """One storage slot's whole pages as a ``[num_blocks, page bytes]`` byte tensor over the
    allocation its ``members`` (the layer views of the slot) view: a Mamba layer's view covers
    only the used part of its padded page, and every byte of a page moves once. Raises
    ConfigError where the members disagree on where the slot starts or on its page, or the
    pages would run past the allocation."""
    import torch

    views = list(members)
    starts = {int(t.data_ptr()) for t in views}
    pages = {int(t.stride(0)) * t.element_size() for t in views}
    if len(starts) != 1 or len(pages) != 1:
        raise ConfigError(f"rd2h: layers viewing one KV cache slot start at {len(starts)} addresses with pages of "
                          f"{sorted(pages)} bytes: cannot register its pages (a block-outermost KV cache layout is "
                          "refused at startup: check_state_engine)")  # fmt: skip
    first, page = views[0], pages.pop()
    storage = first.untyped_storage()
    offset = first.storage_offset() * first.element_size()
    if offset + num_blocks * page > storage.nbytes():
        raise ConfigError(f"rd2h: {num_blocks} pages of {page} bytes from byte {offset} run past the KV cache "
                          f"allocation of {storage.nbytes()} bytes (pages not dense: a block-outermost KV cache "
                          "layout?)")  # fmt: skip
    raw = torch.empty(0, dtype=torch.int8, device=first.device)
    raw.set_(storage, offset, (num_blocks, page), (page, 1))
    return raw
