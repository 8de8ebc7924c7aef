"""What a Prefill step announces: request records, per-endpoint announcements and the
readiness awaiting replies (pure).

A step is cut once by the send tracker's ``schedule``; its announcement to each Decode
endpoint (read requests packed once for every layer, final ids, and the per-request
counters a layer's readiness moves) is built by :func:`build_step`, and built again when a
request drops out of it (failed or aborted) before its remaining layers go out.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from rd2h.errors import ConfigError, RD2HError
from rd2h.layout.chunking import Chunk, GroupChunks
from rd2h.prefill.send_states import ANNOUNCED, EndpointState, RequestState
from rd2h.wire import protocol

__all__ = [
    "Ids", "Effects", "RequestRecord", "SentReadiness", "EndpointRecord", "Announcement", "Step", "build_step",
    "block_ids", "next_chunks", "RequestSlots",
]

Ids = npt.NDArray[np.int64]


@dataclass(slots=True)
class Effects:
    """What the caller must do: send ``sends`` in order, before the tracker records anything
    else (``(address, layer_idx, frame)``: an mf_meta is listed with the layer of the readiness
    it precedes; if a send raises, skip that address's remaining frames and report ``send_failed``
    for each readiness to it not written, last first), drop
    ``disconnects`` (a silent Decode) and ``forgotten`` (an unused one), and release the slot
    gate for each ``(layer_idx, address)`` in ``released`` (readiness answered, or no longer
    awaited). ``ignored``: the counter that absorbed a reply frame (malformed, stray, stale,
    unknown_failed_ids), for the caller's rate-limited log."""

    sends: list[tuple[str, int, bytes]] = field(default_factory=list)
    released: list[tuple[int, str]] = field(default_factory=list)
    disconnects: list[str] = field(default_factory=list)
    forgotten: list[str] = field(default_factory=list)
    ignored: str = ""


@dataclass(eq=False, slots=True)
class RequestRecord:
    """One request instance: its endpoints, groups, block ids and state."""

    ext_id: str
    slot: int  # index into the tracker's per-request counters
    addresses: tuple[str, ...]
    member: int
    ratio: int
    main: GroupChunks
    indexer: GroupChunks
    main_ids: Ids
    indexer_ids: Ids | None  # None: the indexer uses the main block ids
    started: float
    computed: int = 0
    state: RequestState = RequestState.ACTIVE
    error: RD2HError | None = None


_SENT = itertools.count()


@dataclass(eq=False, slots=True)
class SentReadiness:
    """A readiness awaiting its reply from one endpoint."""

    layer_idx: int
    frame: bytes
    slots: Ids
    requests: list[RequestRecord]
    at: float
    seq: int = field(default_factory=_SENT.__next__)  # send order: what is sent again after META_REQUIRED keeps it
    resent: bool = False  # sent again once after META_REQUIRED

    def named(self, failed_ext_ids: tuple[str, ...]) -> tuple[list[RequestRecord], int]:
        """The requests a READ_FAILED for it names (none named: all of them), and how many ids it
        named that this readiness did not carry (a peer's mistake, counted by the caller)."""
        if not failed_ext_ids:
            return list(self.requests), 0
        carried = {r.ext_id: r for r in self.requests}
        found = [carried[ext_id] for ext_id in failed_ext_ids if ext_id in carried]
        return found, len(failed_ext_ids) - len(found)


@dataclass(eq=False, slots=True)
class EndpointRecord:
    """One Decode endpoint as this Prefill rank knows it."""

    state: EndpointState = EndpointState.NEW
    # per layer, its readiness awaiting replies, oldest first: Decode answers one peer in order
    in_flight: dict[int, deque[SentReadiness]] = field(default_factory=dict)
    unacked: int = 0  # mf_meta frames sent (since it was last revived) and not yet acknowledged
    users: int = 0  # live requests that name it: while any does, it is never forgotten
    last_used: float = 0.0  # when a request named it, a readiness went out or a reply came
    layers: frozenset[int] | None = None  # a Decode pipeline stage: the layers it holds (None: all)
    last: int | None = None  # ... and the one that carries its final signal

    def sends(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` goes to this endpoint."""
        return self.layers is None or layer_idx in self.layers

    def final(self, layer_idx: int, source_last: bool) -> bool:
        """Whether this layer's readiness carries the final signal to this endpoint."""
        return source_last if self.last is None else layer_idx == self.last

    def take_unread(self) -> tuple[list[SentReadiness], list[SentReadiness]]:
        """Decode answered META_REQUIRED: nothing in flight to it was read, or will be before a
        new mf_meta. The readiness to send again, in send order (now marked resent), and those
        already sent again once (no longer in flight: they fail)."""
        pending = sorted((s for waiting in self.in_flight.values() for s in waiting), key=lambda s: s.seq)
        spent = [s for s in pending if s.resent]
        if spent:
            kept = {i: deque(s for s in waiting if not s.resent) for i, waiting in self.in_flight.items()}
            self.in_flight = {i: waiting for i, waiting in kept.items() if waiting}
        again = [s for s in pending if not s.resent]
        for sent in again:
            sent.resent = True
        return again, spent

    def take_all(self) -> list[SentReadiness]:
        """Every readiness in flight (no longer awaited: the connection it went over is gone)."""
        lost = [sent for waiting in self.in_flight.values() for sent in waiting]
        self.in_flight = {}
        return lost


class RequestSlots:
    """Per-request counters, indexed by each live request's slot, in numpy arrays: a layer's
    readiness and its reply move the counters of every request it names in one operation.
    ``unanswered``: readiness naming the request not yet answered; ``nbytes``: source bytes
    announced for it; ``draining``: it awaits only its last replies. Grows by doubling."""

    def __init__(self, size: int = 16) -> None:
        self.unanswered = np.zeros(size, np.int64)
        self.nbytes = np.zeros(size, np.int64)
        self.draining = np.zeros(size, bool)
        self.owner: dict[int, RequestRecord] = {}
        self._free = list(range(size - 1, -1, -1))

    def take(self) -> int:
        if not self._free:
            size = len(self.unanswered)
            self.unanswered = np.concatenate((self.unanswered, np.zeros(size, np.int64)))
            self.nbytes = np.concatenate((self.nbytes, np.zeros(size, np.int64)))
            self.draining = np.concatenate((self.draining, np.zeros(size, bool)))
            self._free = list(range(2 * size - 1, size - 1, -1))
        return self._free.pop()

    def free(self, slot: int) -> None:
        del self.owner[slot]
        self.nbytes[slot] = 0
        self.draining[slot] = False
        self._free.append(slot)

    # Up to this many requests a readiness moves the counters one by one: numpy's fancy
    # indexing costs 1-2 us a call, more than a few Python steps (a tiny layer's whole path is ~150 us).
    FEW = 4

    def announced(self, ann: Announcement, main_bytes: int, indexer_bytes: int) -> None:
        """A readiness names ``ann``'s requests: one more reply owed each, their bytes counted."""
        if ann.few is not None:
            unanswered, nbytes = self.unanswered, self.nbytes
            for slot, main, indexer in ann.few:
                unanswered[slot] += 1
                nbytes[slot] += main * main_bytes + indexer * indexer_bytes
            return
        self.unanswered[ann.slots] += 1
        self.nbytes[ann.slots] += ann.main_blocks * main_bytes + ann.indexer_blocks * indexer_bytes

    def answered(self, slots: Ids) -> list[int]:
        """A reply came for a readiness naming ``slots`` (each once): one reply fewer owed each;
        returns the slots whose requests that left quiet (draining, no reply owed)."""
        if len(slots) <= self.FEW:
            quiet = []
            for slot in slots.tolist():
                left = int(self.unanswered[slot]) - 1
                self.unanswered[slot] = left
                if not left and self.draining[slot]:
                    quiet.append(slot)
            return quiet
        self.unanswered[slots] -= 1
        return slots[self.draining[slots] & (self.unanswered[slots] == 0)].tolist()

@dataclass(eq=False, slots=True)
class Announcement:
    """What one endpoint is told, for every layer of one step."""

    member: int
    ratio: int
    requests: list[RequestRecord] = field(default_factory=list)
    reads: list[protocol.ReadRequest] = field(default_factory=list)
    done: list[str] = field(default_factory=list)
    packed: bytes = b""
    slots: Ids = field(default_factory=lambda: np.zeros(0, np.int64))
    main_blocks: Ids = field(default_factory=lambda: np.zeros(0, np.int64))  # 0 where counted already
    indexer_blocks: Ids = field(default_factory=lambda: np.zeros(0, np.int64))
    few: list[tuple[int, int, int]] | None = None  # (slot, main, indexer blocks) for up to RequestSlots.FEW


@dataclass(eq=False, slots=True)
class Step:
    """One prefill step as ``schedule`` cut it; ``announce`` sends it layer by layer.

    Opaque to callers. Requests that fail or are aborted meanwhile drop out of it."""

    entries: list[tuple[RequestRecord, protocol.ReadRequest, bool]]
    epoch: int = -1
    by_address: dict[str, Announcement] = field(default_factory=dict)
    finals: list[RequestRecord] = field(default_factory=list)


def block_ids(values: object, what: str) -> Ids:
    ids = np.asarray(values).reshape(-1)
    if ids.size == 0:
        return np.zeros(0, np.int64)
    if ids.dtype.kind not in "iu" or (ids < 0).any():
        raise ConfigError(f"{what} must be non-negative integers")
    return ids.astype(np.int64, copy=False)


def build_step(step: Step, epoch: int) -> None:
    """(Re)build ``step``'s announcements from its requests still announced."""
    step.epoch = epoch
    step.by_address, step.finals = {}, []
    counted: set[int] = set()  # bytes are counted at one endpoint per request
    for request, read, final in step.entries:
        if request.state not in ANNOUNCED:
            continue
        if final:
            step.finals.append(request)
        for address in request.addresses:
            ann = step.by_address.setdefault(address, Announcement(request.member, request.ratio))
            ann.requests.append(request)
            ann.reads.append(read)
            if final:
                ann.done.append(request.ext_id)
    for ann in step.by_address.values():
        n = len(ann.requests)
        ann.packed = protocol.pack_read_reqs(ann.reads)
        ann.slots = np.fromiter((r.slot for r in ann.requests), np.int64, n)
        fresh = np.fromiter((r.slot not in counted for r in ann.requests), bool, n)
        counted.update(r.slot for r in ann.requests)
        ann.main_blocks = np.fromiter((len(r.main_block_ids) for r in ann.reads), np.int64, n) * fresh
        ann.indexer_blocks = np.fromiter((len(r.indexer_block_ids) for r in ann.reads), np.int64, n) * fresh
        if n <= RequestSlots.FEW:
            ann.few = list(zip(ann.slots.tolist(), ann.main_blocks.tolist(), ann.indexer_blocks.tolist()))


def next_chunks(request: RequestRecord, tokens: object, placed: dict[str, tuple[int, int]]) -> tuple[Chunk, Chunk]:
    """The request's next chunk per group once ``tokens`` prompt tokens are computed;
    ConfigError for whatever makes it unsendable. ``placed`` holds, per Decode address, the
    (member, ratio) of the requests cut before it in this step: one step reads one TP split."""
    if isinstance(tokens, bool) or not isinstance(tokens, int):
        raise ConfigError(f"request {request.ext_id!r}: computed tokens must be an int, got {tokens!r}")
    if tokens < request.computed:
        raise ConfigError(f"request {request.ext_id!r}: computed tokens went back ({tokens} after {request.computed})")
    try:
        main, indexer = request.main.peek(tokens), request.indexer.peek(tokens)
    except ConfigError as exc:
        raise ConfigError(f"request {request.ext_id!r}: {exc}") from None
    indexer_count = len(request.main_ids if request.indexer_ids is None else request.indexer_ids)
    if len(request.main_ids) < main.hi or indexer_count < indexer.hi:
        raise ConfigError(
            f"request {request.ext_id!r}: {tokens} tokens need {main.hi} main and {indexer.hi} indexer "
            f"block ids, it has {len(request.main_ids)} and {indexer_count}"
        )
    for address in request.addresses:
        if placed.get(address, (request.member, request.ratio)) != (request.member, request.ratio):
            raise ConfigError(f"request {request.ext_id!r}: {address} is another Decode TP size in this step")
    return main, indexer
