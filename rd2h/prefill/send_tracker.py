"""The Prefill send tracker: per request and per Decode endpoint, what was announced, what is still
unanswered, and how each request ends (pure: no threads, no I/O, no clock reads).

:class:`~rd2h.prefill.source.Source` feeds it local calls (requests, steps, layers) and remote input
(reply frames, silence) and carries out what it returns (frames to send, slots to release,
connections to drop). Every call that can end a request takes ``now``.

Its states and transition tables are drawn in :mod:`rd2h.prefill.send_states` (each request is
reported exactly once, then no state of it is left); what a step announces is built in
:mod:`rd2h.prefill.send_steps`; which Decode ranks get which layers, in :mod:`rd2h.prefill.stage_routes`.

Remote input never raises: malformed frames, replies for layers not in flight or from unknown
endpoints, READ_FAILED naming requests that are not there are counted in :attr:`SendTracker.counters`
and otherwise ignored; a failure becomes the outcome of the requests it names (never of a slot or of
the next request). Each settled request is told to its Decode endpoints (``take_notices``, see
:mod:`rd2h.prefill.settled_notices`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from rd2h.errors import (
    ConfigError,
    DuplicateRequestError,
    LayerFailedError,
    RD2HError,
    ReplyTimeout,
    StateError,
    UnknownRequestError,
)
from rd2h.layout.chunking import GroupChunks
from rd2h.layout.topology import Topology
from rd2h.outcome import Outcome, OutcomeBook, TerminalState
from rd2h.prefill.endpoint_book import EndpointBook
from rd2h.prefill.send_states import (
    ANNOUNCED,
    DRAINING,
    ENDPOINT_TRANSITIONS,
    NEEDS_META,
    REQUEST_TRANSITIONS,
    STALE,
    TERMINAL,
    EndpointEvent,
    EndpointState,
    RequestEvent,
    RequestState,
)
from rd2h.prefill.send_steps import (
    Effects,
    EndpointRecord,
    RequestRecord,
    RequestSlots,
    SentReadiness,
    Step,
    block_ids,
    build_step,
    next_chunks,
)
from rd2h.prefill.settled_notices import SettledNotices
from rd2h.prefill.stage_routes import stage_routes
from rd2h.statemachine import step as _step
from rd2h.wire import protocol
from rd2h.wire.endpoint import DecodeEndpoint

__all__ = ["RequestState", "EndpointState", "Step", "Effects", "SendTracker"]

_RE, _EE = RequestEvent, EndpointEvent


class SendTracker:
    """Every request and Decode endpoint of one Prefill TP rank.

    ``layer_block_bytes[i]`` is ``(main, indexer)`` bytes per block of layer ``i`` (for :attr:`Outcome.nbytes
    <rd2h.outcome.Outcome.nbytes>`); ``last_layer`` is the layer whose readiness carries ``done_ext_ids``;
    ``endpoint_idle_seconds`` and ``max_endpoints`` bound the endpoints kept (:mod:`~rd2h.prefill.endpoint_book`);
    ``model_layers``: each layer's index in the model, for a Decode run with pipeline parallel. Raises
    ConfigError on bad arguments.
    """

    def __init__(
        self, *, rank: int, tp_size: int, meta_frame: bytes, layer_block_bytes: Sequence[tuple[int, int]],
        last_layer: int, block_size: int, indexer_block_size: int | None = None, reply_timeout: float = 30.0,
        endpoint_idle_seconds: float = 300.0, max_endpoints: int = 256, model_layers: Sequence[int] | None = None,
    ) -> None:  # fmt: skip
        if not 0 <= rank < tp_size:
            raise ConfigError(f"rank {rank} outside 0..{tp_size - 1}")
        if not 0 <= last_layer < len(layer_block_bytes):
            raise ConfigError(f"last_layer {last_layer} outside 0..{len(layer_block_bytes) - 1}")
        indexer_block_size = block_size if indexer_block_size is None else indexer_block_size
        if block_size <= 0 or indexer_block_size <= 0:
            raise ConfigError(f"block sizes must be positive, got {block_size} and {indexer_block_size}")
        if not reply_timeout > 0:
            raise ConfigError(f"reply_timeout must be positive, got {reply_timeout!r}")
        self._rank, self._tp_size = rank, tp_size
        self._meta = meta_frame
        self._layer_bytes = np.asarray(layer_block_bytes, np.int64).reshape(-1, 2)
        self._last, self._model_layers = last_layer, model_layers
        self._block_size, self._indexer_block_size = block_size, indexer_block_size
        self._reply_timeout = reply_timeout
        self._requests: dict[str, RequestRecord] = {}
        self._endpoints = EndpointBook(idle_seconds=endpoint_idle_seconds, max_endpoints=max_endpoints,
                                       grace_seconds=reply_timeout)
        self._book = OutcomeBook()
        self._epoch = 0  # bumped whenever a request drops out of the announced ones
        self._slots = RequestSlots()  # per-request counters: a layer moves them without a loop
        self._notices = SettledNotices()
        self.counters = {"stray": 0, "stale": 0, "malformed": 0, "unknown_failed_ids": 0, "acks": 0}

    # -- local calls -----------------------------------------------------------------------

    def add_request(
        self,
        ext_id: str,
        decode: DecodeEndpoint,
        *,
        main_block_ids: Iterable[int] = (),
        indexer_block_ids: Iterable[int] | None = None,
        num_tokens: int,
        first_block: int = 0,
        now: float,
    ) -> None:
        """Track a request to be pulled by ``decode``. Block ids are the request's block
        table from position 0 (they may come later, by ``extend``); ``first_block`` main
        blocks (and the indexer blocks wholly inside them) Decode holds already.

        Raises DuplicateRequestError while the id is tracked or its outcome not collected
        (the live request is untouched), ConfigError/TopologyError on bad arguments.
        """
        if not isinstance(ext_id, str):
            raise ConfigError(f"request ids are str, got {type(ext_id).__name__}")
        if ext_id in self._requests or ext_id in self._book:
            raise DuplicateRequestError(f"request {ext_id!r} is already tracked (or its outcome not collected)")
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int):
            raise ConfigError(f"request {ext_id!r}: num_tokens must be an int, got {num_tokens!r}")
        if isinstance(first_block, bool) or not isinstance(first_block, int):
            raise ConfigError(f"request {ext_id!r}: first_block must be an int, got {first_block!r}")
        if indexer_block_ids is None and self._indexer_block_size != self._block_size:
            raise ConfigError(f"request {ext_id!r}: indexer blocks hold other tokens than main ones; give their ids")
        topology = Topology(self._tp_size, decode.tp_size)
        routes = stage_routes(decode, self._rank, self._tp_size, self._model_layers)
        addresses = tuple(route.address for route in routes)
        main = GroupChunks(self._block_size, num_tokens, first_block)
        indexer = GroupChunks(
            self._indexer_block_size, num_tokens, first_block * self._block_size // self._indexer_block_size
        )
        main_ids = block_ids(main_block_ids, "main_block_ids")
        indexer_ids = None if indexer_block_ids is None else block_ids(indexer_block_ids, "indexer_block_ids")
        for route in routes:
            endpoint = self._endpoints.named(route.address, now)
            endpoint.layers, endpoint.last = route.layers, route.last  # a Decode stage: its layers only
            if endpoint.state is EndpointState.SILENT:
                endpoint.unacked = 0  # an mf_meta the silent Decode never acknowledged is not waited for
            endpoint.state = _step(ENDPOINT_TRANSITIONS, endpoint.state, _EE.REVIVE, route.address)
        request = RequestRecord(
            ext_id, self._slots.take(), addresses, topology.member_of(self._rank), topology.ratio,
            main, indexer, main_ids, indexer_ids, now,
        )
        self._requests[ext_id] = self._slots.owner[request.slot] = request

    def extend(self, ext_id: str, *, main_block_ids: Iterable[int] = (), indexer_block_ids: Iterable[int] = ()) -> None:
        """Append source block ids (chunked prefill learns them step by step); ignored for a request that
        failed or ended. UnknownRequestError for an id never added (or already collected), ConfigError
        for bad ids or indexer ids for a request whose indexer uses the main ids."""
        request = self._requests.get(ext_id)
        if request is None:
            if ext_id in self._book:
                return
            raise UnknownRequestError(f"request {ext_id!r} is not tracked")
        main = block_ids(main_block_ids, "main_block_ids")
        indexer = block_ids(indexer_block_ids, "indexer_block_ids")
        if request.indexer_ids is None and indexer.size:
            raise ConfigError(f"request {ext_id!r} was added without indexer ids: its indexer uses the main ids")
        if request.state is not RequestState.ACTIVE:
            return
        request.main_ids = np.concatenate((request.main_ids, main))
        if request.indexer_ids is not None:
            request.indexer_ids = np.concatenate((request.indexer_ids, indexer))

    def schedule(self, computed_tokens: Mapping[str, int], now: float) -> tuple[Step, dict[str, RD2HError]]:
        """Cut a prefill step: after it each request has this many prompt tokens cached.

        Never fails the step. Returns it with the per-request problems: an id not tracked
        (UnknownRequestError; nothing else happens), a request no longer announced or whose
        final chunk was scheduled already (StateError; nothing else happens), or one whose
        tokens are bad or whose block ids do not reach what is to be announced (ConfigError;
        that request is failed, the others go on).
        """
        problems: dict[str, RD2HError] = {}
        entries: list[tuple[RequestRecord, protocol.ReadRequest, bool]] = []
        placed: dict[str, tuple[int, int]] = {}  # address -> (member, ratio) of this step
        for ext_id, tokens in computed_tokens.items():
            request = self._requests.get(ext_id)
            if request is None:
                problems[ext_id] = UnknownRequestError(f"request {ext_id!r} is not tracked (never added, or ended)")
                continue
            if request.state is not RequestState.ACTIVE:
                problems[ext_id] = StateError(f"request {ext_id!r} is {request.state.name}: not announced any more")
                continue
            if request.main.final_sent:  # a repeated final step announces nothing; not the request's fault
                problems[ext_id] = StateError(f"request {ext_id!r}: its final chunk was scheduled already")
                continue
            try:
                main, indexer = next_chunks(request, tokens, placed)
            except ConfigError as exc:
                problems[ext_id] = exc
                self._decide(request, _RE.FAIL, exc, now)
                continue
            request.main.commit(main)
            request.indexer.commit(indexer)
            request.computed = tokens
            main_ids = request.main_ids[main.lo : main.hi]
            indexer_ids = main_ids if request.indexer_ids is None else request.indexer_ids[indexer.lo : indexer.hi]
            read = protocol.ReadRequest(ext_id, main_ids, indexer_ids, main.lo, indexer.lo)
            entries.append((request, read, main.final))
            for address in request.addresses:
                placed[address] = (request.member, request.ratio)
        step = Step(entries)
        build_step(step, self._epoch)
        return step, problems

    def announce(self, step: Step, layer_idx: int, layer_name: str, now: float) -> tuple[tuple[str, ...], Effects]:
        """Layer ``layer_idx`` of ``step`` is written: the endpoints told and the frames to send.

        Raises ConfigError for a layer outside the layers. An endpoint may still owe replies
        to earlier readiness of this layer (vLLM's paged cache reuses no slot): each reply
        answers that endpoint's oldest readiness of the layer, as Decode answers in order.
        """
        if not 0 <= layer_idx < len(self._layer_bytes):
            raise ConfigError(f"layer {layer_idx} outside 0..{len(self._layer_bytes) - 1}")
        if step.epoch != self._epoch:
            build_step(step, self._epoch)
        book, last = self._endpoints, layer_idx == self._last
        targets = [(a, ann) for a, ann in step.by_address.items() if ann.requests and book[a].sends(layer_idx)]
        main_bytes, indexer_bytes = self._layer_bytes[layer_idx]
        effects = Effects()
        for address, ann in targets:
            endpoint = book[address]
            self._endpoints.touch(address, endpoint, now)
            # a SILENT endpoint is named by no announced request (they failed when it fell silent)
            if endpoint.state in NEEDS_META:
                effects.sends.append((address, layer_idx, self._meta))
                endpoint.unacked += 1
            endpoint.state = _step(ENDPOINT_TRANSITIONS, endpoint.state, _EE.SEND, address)
            final = ann.done if endpoint.final(layer_idx, last) else ()  # a Decode stage's own last layer
            frame = protocol.encode_readiness(layer_idx, layer_name, ann.packed, final, ann.member, ann.ratio)
            effects.sends.append((address, layer_idx, frame))
            sent = SentReadiness(layer_idx, frame, ann.slots, ann.requests, now)
            endpoint.in_flight.setdefault(layer_idx, deque()).append(sent)
            self._slots.announced(ann, main_bytes, indexer_bytes)
        if last:
            for request in step.finals:
                if request.state is RequestState.ACTIVE:
                    self._decide(request, _RE.FINAL_SENT, None, now)
        return tuple(a for a, _ in targets), effects

    def layer_unsent(self, step: Step, layer_name: str, error: BaseException, now: float) -> None:
        """The layer could not be announced (its event failed): fail the step's requests."""
        failure = LayerFailedError(f"layer {layer_name!r} could not be announced: {error}")
        for request, _, _ in step.entries:
            if request.state in ANNOUNCED:
                self._decide(request, _RE.FAIL, failure, now)

    def abort(self, ext_id: str, now: float) -> bool:
        """The caller gives up on ``ext_id``: it is announced no more and ends ABORTED once no
        readiness naming it is unanswered (or keeps the failure it already had).

        False, and nothing recorded, for an id that is not live (never added, or already
        ended: its outcome stands), as the Decode side's ``abort`` does.
        """
        request = self._requests.get(ext_id)
        if request is None:
            return False
        self._decide(request, _RE.ABORT, None, now)
        return True

    def take(self) -> dict[str, Outcome]:
        """Every outcome settled since the last ``take``/``collect``, consumed."""
        return self._book.take()

    def collect(self, ext_ids: Sequence[str]) -> dict[str, Outcome] | None:
        """The outcomes of ``ext_ids``, consumed, once all are settled; else None (nothing
        consumed). Raises UnknownRequestError for an id neither tracked nor settled."""
        unknown = [e for e in ext_ids if e not in self._requests and e not in self._book]
        if unknown:
            raise UnknownRequestError(f"requests not tracked (never added, or already collected): {unknown[:5]}")
        if not self._book.has_all(ext_ids):
            return None
        return self._book.pop(ext_ids)

    def settled(self) -> int:
        """Outcomes settled and not yet collected."""
        return len(self._book)

    def unsettled(self, ext_ids: Iterable[str]) -> list[str]:
        return [e for e in ext_ids if e in self._requests]

    def take_notices(self) -> list[tuple[str, bytes]]:
        """``(address, frame)`` to send, no reply expected: how the requests settled since the
        last call ended, for each endpoint that heard of them (consumed). A frame that cannot
        be sent is lost: Decode then fails the request at its deadline."""
        notices = self._notices.take()  # mf_meta first to a SILENT Decode that acknowledged none: it ignores strangers
        first = {a for a, _ in notices if (e := self._endpoints.get(a)) and e.unacked}
        return [(a, self._meta) for a in first if self._endpoints[a].state is EndpointState.SILENT] + notices

    # -- remote input and time -------------------------------------------------------------

    def on_reply(self, address: str, frame: bytes, now: float) -> Effects:
        """A frame from ``address``. Never raises."""
        effects = Effects()
        try:
            reply = protocol.decode_reply(frame)
        except Exception:  # any bytes a peer sends: counted, never raised
            return self._ignore(effects, "malformed")
        endpoint = self._endpoints.get(address)
        if endpoint is not None:
            self._endpoints.touch(address, endpoint, now)
        if isinstance(reply, protocol.Ack):
            self.counters["acks"] += 1
            if endpoint is not None and endpoint.unacked:
                endpoint.unacked -= 1
                if endpoint.unacked == 0 and endpoint.state is EndpointState.REINTRODUCED:
                    endpoint.state = _step(ENDPOINT_TRANSITIONS, endpoint.state, _EE.ACKED, address)
            return effects
        if endpoint is not None and endpoint.state in STALE:
            return self._ignore(effects, "stale")
        if endpoint is None or not endpoint.in_flight:  # a SILENT endpoint's readiness was abandoned
            return self._ignore(effects, "stray")
        if isinstance(reply, protocol.ReadFailed) and reply.needs_meta:
            return self._reintroduce(address, endpoint, reply, effects, now)
        waiting = endpoint.in_flight.get(reply.layer_idx)
        if not waiting:
            return self._ignore(effects, "stray")
        sent = waiting.popleft()
        if not waiting:
            del endpoint.in_flight[reply.layer_idx]
        if isinstance(reply, protocol.ReadFailed):
            self._ignore(effects, "unknown_failed_ids", self._fail_named(sent, reply, reply.exception(address), now))
        self._answered(sent, now)
        effects.released.append((sent.layer_idx, address))
        return effects

    def _reintroduce(self, address: str, endpoint: EndpointRecord, reply: protocol.ReadFailed, effects: Effects,
                     now: float) -> Effects:  # fmt: skip
        """META_REQUIRED: no reply can be paired with what it answers (see send_states). All in flight
        goes again once, after one mf_meta, in send order; replies before its ACK are stale."""
        again, spent = endpoint.take_unread()
        endpoint.state = _step(ENDPOINT_TRANSITIONS, endpoint.state, _EE.META_REQUIRED, address)
        for sent in spent:  # sent again once already: it fails
            self._fail_named(sent, reply, reply.exception(address), now)
            self._answered(sent, now)
            effects.released.append((sent.layer_idx, address))
        if again:
            endpoint.state = _step(ENDPOINT_TRANSITIONS, endpoint.state, _EE.SEND, address)
            endpoint.unacked = 1  # an earlier mf_meta went to a Decode that is gone
            effects.sends.append((address, again[0].layer_idx, self._meta))
            effects.sends += [(address, s.layer_idx, s.frame) for s in again]
        return effects

    def send_failed(self, address: str, layer_idx: int, error: BaseException, now: float) -> Effects:
        """Sending to ``address`` for ``layer_idx`` raised: that endpoint missed its last readiness of the layer."""
        endpoint = self._endpoints.get(address)
        waiting = None if endpoint is None else endpoint.in_flight.get(layer_idx)
        if endpoint is None or not waiting:
            return Effects()
        sent = waiting.pop()  # the readiness whose send failed is the last one of the layer
        if not waiting:
            del endpoint.in_flight[layer_idx]
        endpoint.state = _step(ENDPOINT_TRANSITIONS, endpoint.state, _EE.SEND_FAILED, address)
        return self._lost(address, [sent], error if isinstance(error, RD2HError) else LayerFailedError(str(error)), now)

    def connection_lost(self, address: str, error: RD2HError, now: float) -> Effects:
        """The channel dropped ``address``'s connection with what waited for it: no readiness in flight there will
        be answered, and its requests fail with ``error``. The next readiness goes after an mf_meta, and replies
        before its ACK are stale (a Decode that read a lost readiness may still answer it). Never raises."""
        endpoint = self._endpoints.get(address)
        if endpoint is None:
            return Effects()
        endpoint.state = _step(ENDPOINT_TRANSITIONS, endpoint.state, _EE.CONNECTION_LOST, address)
        if endpoint.state is EndpointState.REVIVED:
            endpoint.unacked = 0  # an mf_meta that went with the connection is not waited for
        return self._lost(address, endpoint.take_all(), error, now)

    def expire(self, now: float) -> Effects:
        """Abandon every endpoint whose oldest readiness went unanswered past reply_timeout;
        forget the unused ones the bounds say (``forgotten``)."""
        effects = Effects(forgotten=self._endpoints.forget_unused(now))
        for address, endpoint in self._endpoints.items():
            if not endpoint.in_flight:
                continue
            oldest = min(waiting[0].at for waiting in endpoint.in_flight.values())
            if now - oldest <= self._reply_timeout:
                continue
            error = ReplyTimeout(f"Decode {address} did not reply within {self._reply_timeout:g} s")
            endpoint.state = _step(ENDPOINT_TRANSITIONS, endpoint.state, _EE.TIMEOUT, address)
            effects.disconnects.append(address)
            records = endpoint.take_all()
            for request in list(self._requests.values()):
                if address in request.addresses and request.state in ANNOUNCED:
                    self._decide(request, _RE.FAIL, error, now)
            for sent in records:
                self._answered(sent, now)
                effects.released.append((sent.layer_idx, address))
        return effects

    # -- queries -----------------------------------------------------------------------------

    def request_state(self, ext_id: str) -> RequestState | None:
        """The state of a tracked request; None when not tracked (or already settled)."""
        return None if (request := self._requests.get(ext_id)) is None else request.state

    def unanswered(self, ext_id: str) -> int:
        """Readiness naming the tracked request ``ext_id`` that no endpoint answered yet."""
        return 0 if (request := self._requests.get(ext_id)) is None else int(self._slots.unanswered[request.slot])

    def endpoint_state(self, address: str) -> EndpointState | None:
        return None if (endpoint := self._endpoints.get(address)) is None else endpoint.state

    def in_flight(self, address: str) -> frozenset[int]:
        """Layers whose readiness ``address`` has not answered."""
        return frozenset() if (endpoint := self._endpoints.get(address)) is None else frozenset(endpoint.in_flight)

    def live_ids(self) -> frozenset[str]:
        return frozenset(self._requests)

    def endpoints(self) -> int:
        return len(self._endpoints)  # Decode endpoints known; unused ones are forgotten (bounds)

    def has_in_flight(self) -> bool:
        return any(e.in_flight for e in self._endpoints.values())

    # -- internals ---------------------------------------------------------------------------

    def _fail_named(self, sent: SentReadiness, reply: protocol.ReadFailed, error: RD2HError, now: float) -> int:
        """Fail what the reply names; how many ids it named that the readiness did not."""
        requests, unknown = sent.named(reply.failed_ext_ids)
        for request in requests:
            self._decide(request, _RE.FAIL, error, now)
        return unknown

    def _ignore(self, effects: Effects, why: str, count: int = 1) -> Effects:
        if count:
            self.counters[why] += count
            effects.ignored = why
        return effects

    def _lost(self, address: str, lost: list[SentReadiness], error: RD2HError, now: float) -> Effects:
        """Readiness to ``address`` that will never be answered: its requests fail, and it counts as answered."""
        for request in (request for sent in lost for request in sent.requests):
            self._decide(request, _RE.FAIL, error, now)
        effects = Effects(released=[(sent.layer_idx, address) for sent in lost])
        for sent in lost:
            self._answered(sent, now)
        return effects

    def _answered(self, sent: SentReadiness, now: float) -> None:
        for slot in self._slots.answered(sent.slots):  # usually none: only requests that await their last replies
            self._settle(self._slots.owner[slot], now)

    def _decide(self, request: RequestRecord, event: RequestEvent, error: RD2HError | None, now: float) -> None:
        self._move(request, event)
        if error is not None and request.error is None:
            request.error = error
        if request.state in DRAINING:
            self._slots.draining[request.slot] = True
            if self._slots.unanswered[request.slot] == 0:
                self._settle(request, now)

    def _move(self, request: RequestRecord, event: RequestEvent) -> None:
        before = request.state
        request.state = _step(REQUEST_TRANSITIONS, before, event, "request %r", request.ext_id)
        if before in ANNOUNCED and request.state not in ANNOUNCED:
            self._epoch += 1  # steps holding it rebuild their announcements without it

    def _settle(self, request: RequestRecord, now: float) -> None:
        self._move(request, _RE.QUIET)
        terminal = TERMINAL[request.state]
        self._book.settle(
            Outcome(
                request.ext_id,
                terminal,
                request.error if terminal is TerminalState.FAILED else None,
                int(self._slots.nbytes[request.slot]),
                request.started,
                now,
            )
        )
        listening = [a for a in request.addresses
                     if (e := self._endpoints.get(a)) is not None and e.state is not EndpointState.NEW
                     ]  # a NEW endpoint never heard of this Prefill; a SILENT one is told too (see SettledNotices)
        self._notices.settled(request.ext_id, terminal, request.error, listening)
        for address in request.addresses:
            self._endpoints.released(address)
        del self._requests[request.ext_id]
        self._slots.free(request.slot)
