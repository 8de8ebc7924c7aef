"""This Decode rank's share of a readiness (pure): which blocks it reads, from where to where.

All of it is decided on Decode (Prefill only announces): main K/V is split over the Decode TP
ranks (``SHARED``: one pool, disjoint shares) or read whole by every rank (``REPLICATED``;
with a dense GQA/MHA cache each contributor gives its KV heads of every block, see
``rd2h.layout.heads``); indexer and LIC8 scale are split over the ``tp_ratio`` Prefill contributors, so every rank
gets a complete copy. See ``rd2h.layout.topology`` for the split rule itself.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

import numpy as np
import numpy.typing as npt

from rd2h.errors import BlockRangeError, RD2HError
from rd2h.layout.heads import reads_heads
from rd2h.layout.planning import RequestRead
from rd2h.layout.topology import indexer_share, main_share
from rd2h.wire import protocol

__all__ = ["MainSplit", "Destinations", "StepReads", "plan_reads"]

Int64Array = npt.NDArray[np.int64]


class MainSplit(Enum):
    """How the Decode TP ranks share a request's main K/V blocks."""

    SHARED = "shared"  # one host pool mapped by every rank: ranks read disjoint shares
    REPLICATED = "replicated"  # every rank owns a full copy (vLLM's paged cache per rank)


@dataclass(frozen=True, slots=True)
class Destinations:
    """Where one request lands on this Decode rank: its main and indexer block ids."""

    main: Int64Array
    indexer: Int64Array

    @classmethod
    def of(cls, main: Sequence[int] | npt.ArrayLike, indexer: Sequence[int] | npt.ArrayLike | None = None) -> Destinations:
        main_ids = np.asarray(main, dtype=np.int64).reshape(-1)
        index_ids = main_ids if indexer is None else np.asarray(indexer, dtype=np.int64).reshape(-1)
        return cls(main_ids, index_ids)


def _slice(ids: Int64Array, lo: int, hi: int, what: str) -> Int64Array:
    if hi > len(ids):
        raise BlockRangeError(f"{what} destinations {lo}..{hi} beyond the {len(ids)} blocks expected for it")
    return ids[lo:hi]


def plan_reads(
    batch: protocol.ReadReadyBatch,
    destinations: Mapping[str, Destinations],
    *,
    decode_rank: int,
    decode_tp: int,
    main_split: MainSplit = MainSplit.SHARED,
    kv_heads: int | None = None,
) -> tuple[list[RequestRead], dict[str, RD2HError]]:
    """This rank's share of every request in ``batch`` that has destinations (pure).

    Indexer and scale are split over the ``tp_ratio`` contributors. Main: in ``SHARED``
    mode only contributor 0 pulls, split over the Decode TP ranks; in ``REPLICATED`` mode
    every rank reads all of it, split over the contributors like the indexer, unless the
    blocks are split by KV heads (``kv_heads``: the model's KV heads, a dense GQA/MHA cache):
    then each contributor holds other heads of every block, so each gives every block (its
    heads of it, ``rd2h.layout.heads``), and a replica of the contributor before it none.
    Returns the reads and, per request whose destinations are too short, the error.
    """
    member, ratio = batch.group_member_idx, batch.tp_ratio
    by_heads = main_split is MainSplit.REPLICATED and kv_heads is not None
    gives_heads = by_heads and reads_heads(kv_heads, decode_tp, decode_rank, ratio, member)  # type: ignore[arg-type]
    reads: list[RequestRead] = []
    refused: dict[str, RD2HError] = {}
    for req in batch.read_reqs:
        dest = destinations.get(req.ext_req_id)
        if dest is None:
            continue
        n_main = len(req.main_block_ids)
        if main_split is MainSplit.SHARED:
            m_lo, m_hi = main_share(n_main, req.main_start_block, decode_tp, decode_rank, member)
        elif by_heads:
            m_lo, m_hi = 0, n_main if gives_heads else 0
        else:
            m_lo, m_hi = indexer_share(n_main, req.main_start_block, ratio, member)
        i_lo, i_hi = indexer_share(len(req.indexer_block_ids), req.indexer_start_block, ratio, member)
        m_start, i_start = req.main_start_block, req.indexer_start_block
        try:
            dst_main = _slice(dest.main, m_start + m_lo, m_start + m_hi, f"{req.ext_req_id!r} main")
            dst_index = _slice(dest.indexer, i_start + i_lo, i_start + i_hi, f"{req.ext_req_id!r} indexer")
        except BlockRangeError as exc:
            refused[req.ext_req_id] = exc
            continue
        src_main, src_index = req.main_ids()[m_lo:m_hi], req.indexer_ids()[i_lo:i_hi]
        reads.append(RequestRead(req.ext_req_id, src_main, dst_main, src_index, dst_index))
    return reads, refused


class StepReads:
    """``plan_reads`` with a memory of the step. Every layer of a Prefill step repeats the
    same ``read_reqs`` (Prefill sends the packed bytes unchanged), so this rank's reads, the
    requests it cannot read and the bytes each request moves are derived once per step and
    peer, not per layer. Not thread-safe: one per loop.
    """

    def __init__(
        self, *, decode_rank: int, decode_tp: int, main_split: MainSplit, kv_heads: int | None = None,
        remembered: int = 8,
    ) -> None:
        self._rank, self._tp, self._split, self._heads = decode_rank, decode_tp, main_split, kv_heads
        self._remembered = remembered
        self._reads: dict[Hashable, tuple[list[RequestRead], dict[str, RD2HError]]] = {}
        # (id of a step's reads, bytes per block) -> those reads (kept: the id stays theirs), bytes per request
        self._bytes: dict[tuple[int, tuple[int, int]], tuple[list[RequestRead], dict[str, int]]] = {}

    def reads(
        self,
        peer: Hashable,
        batch: protocol.ReadReadyBatch,
        readable: Mapping[str, Destinations],
        requests: Hashable,
    ) -> tuple[Hashable | None, list[RequestRead], dict[str, RD2HError]]:
        """The step's key (None: the batch cannot be told from another), this rank's reads of
        the ``readable`` requests and those it refuses. ``requests`` names the request
        instances admitted (a later request of the same id is another step)."""
        key = None
        if batch.reqs_bytes:
            key = (peer, batch.reqs_bytes, batch.group_member_idx, batch.tp_ratio, requests)
        found = None if key is None else self._reads.get(key)
        if found is None:
            found = plan_reads(
                batch, readable, decode_rank=self._rank, decode_tp=self._tp, main_split=self._split,
                kv_heads=self._heads,
            )  # fmt: skip
            if key is not None:
                self._reads[key] = found
                while len(self._reads) > self._remembered:  # the latest steps of the latest peers
                    del self._reads[next(iter(self._reads))]
        return key, *found

    def request_bytes(
        self, reads: list[RequestRead], per_block: tuple[int, int], failed: Mapping[str, RD2HError]
    ) -> dict[str, int]:
        """Bytes each request of ``reads`` moves on a layer of ``per_block`` (main, indexer)
        bytes per block id, the ``failed`` left out. Read only: the dict may be shared."""
        key = (id(reads), per_block)
        entry = self._bytes.get(key)
        if entry is None or entry[0] is not reads:
            main_bytes, extra_bytes = per_block
            every = {r.ext_req_id: len(r.dst_main) * main_bytes + len(r.dst_indexer) * extra_bytes for r in reads}
            entry = self._bytes[key] = (reads, every)
            while len(self._bytes) > 2 * self._remembered:
                del self._bytes[next(iter(self._bytes))]
        every = entry[1]
        return {e: n for e, n in every.items() if e not in failed} if failed else every
