"""What one Prefill peer may cost a Decode rank: entries, handshakes, ids per message (pure).

A peer that is never forgotten keeps an entry and its engine session's fds for ever, and a
readiness is as large as its sender makes it (20M block ids cost ~560 MB to decode). So:

- :class:`PeerBook` keeps the peers a rank knows in order of last activity, caps them per
  source process (the engine's proven peer id) and in all, and names the ones idle too long;
  the runtime closes what it names. It reads no clock: every call takes ``now``. Admitted and
  refused peers have caps of their own: a flood of refused identities (1,100 in 4 s evicted
  an admitted, working Prefill) only ever pushes out other refused ones.
- :func:`oversized_readiness` counts the block ids of a readiness without building them
  (the id lists are skipped in C), so a message over the limit is refused, per request, for
  the price of reading its bytes once; its request entries and final ids are capped alike.
  :func:`oversized_settled` does the same for the request ids of a ``settled`` (5M ids in a
  10 MB frame cost Decode +108 MB to decode).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import msgpack

from rd2h.errors import ConfigError, ProtocolError
from rd2h.wire import protocol

__all__ = ["PeerLimits", "PeerBook", "Oversized", "oversized_readiness", "oversized_settled"]

_READ_READY_BATCH = b"read_ready_batch"
_SETTLED = b"settled"


@dataclass(frozen=True, slots=True)
class PeerLimits:
    """``max_peers``: admitted peers a rank keeps; ``max_per_source``: of those, from one
    Prefill process; ``max_refused``: refused peers it remembers (to answer their readiness
    with the reason), apart: never admitted, they never push out an admitted one;
    ``idle_seconds``: a peer silent this long, announcing nothing live, is forgotten (None:
    never); ``max_ids_per_message``: ids one message may name (block ids and request ids of a
    readiness, request ids of a ``settled``)."""

    max_peers: int = 1024
    max_per_source: int = 16
    idle_seconds: float | None = 600.0
    max_ids_per_message: int = 1 << 20
    max_refused: int = 1024

    def __post_init__(self) -> None:
        for name in ("max_peers", "max_per_source", "max_ids_per_message", "max_refused"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.idle_seconds is not None and not self.idle_seconds > 0:
            raise ConfigError(f"idle_seconds must be > 0 or None, got {self.idle_seconds!r}")


class PeerBook:
    """The peers of one rank, least recently active first."""

    def __init__(self, limits: PeerLimits) -> None:
        self.limits = limits
        self._seen: OrderedDict[bytes, float] = OrderedDict()  # identity -> last activity
        self._source: dict[bytes, str | None] = {}  # identity -> its Prefill process, if proven

    def __len__(self) -> int:
        return len(self._seen)

    def __contains__(self, identity: object) -> bool:
        return identity in self._seen

    def seen(self, identity: bytes, now: float) -> None:
        """A message from ``identity`` (known or not: a refused peer is a peer too)."""
        if identity in self._seen:
            self._seen[identity] = now
            self._seen.move_to_end(identity)

    def admit(self, identity: bytes, source: str | None, now: float, busy: Callable[[bytes], bool]) -> list[bytes]:
        """A handshake from ``identity`` (``source``: its Prefill process, None if refused).
        Returns the peers to forget so the caps hold: for an admitted peer, the oldest admitted
        of the same source first, then the oldest admitted in all, preferring peers that
        announce nothing live (``busy`` says which); for a refused one, the oldest refused."""
        self._seen[identity] = now
        self._seen.move_to_end(identity)
        self._source[identity] = source
        evict: list[bytes] = []
        admitted = source is not None
        if admitted:
            same = [i for i in self._seen if self._source.get(i) == source and i != identity]
            excess = len(same) + 1 - self.limits.max_per_source
            evict += self._oldest(same, excess, busy)
        # the same kind only: a refused peer is never admitted's rival, nor the other way
        others = [i for i in self._seen if i != identity and i not in evict and (self._source[i] is not None) == admitted]
        excess = len(others) + 1 - (self.limits.max_peers if admitted else self.limits.max_refused)
        evict += self._oldest(others, excess, busy)
        for i in evict:
            self.forget(i)
        return evict

    def idle(self, now: float, busy: Callable[[bytes], bool]) -> list[bytes]:
        """Peers silent for ``idle_seconds`` that announce nothing live; forgotten here."""
        if self.limits.idle_seconds is None:
            return []
        stale = []
        for identity, last in self._seen.items():  # oldest first: stop at the first recent one
            if now - last < self.limits.idle_seconds:
                break
            if not busy(identity):
                stale.append(identity)
        for i in stale:
            self.forget(i)
        return stale

    def forget(self, identity: bytes) -> None:
        self._seen.pop(identity, None)
        self._source.pop(identity, None)

    @staticmethod
    def _oldest(candidates: list[bytes], count: int, busy: Callable[[bytes], bool]) -> list[bytes]:
        if count <= 0:
            return []
        idle = [i for i in candidates if not busy(i)]  # candidates are oldest first
        chosen = idle[:count]
        if len(chosen) < count:
            chosen += [i for i in candidates if i not in chosen][: count - len(chosen)]
        return chosen


@dataclass(frozen=True, slots=True)
class Oversized:
    """A readiness naming more block ids than allowed: enough of it to refuse it per request."""

    layer_idx: int
    layer_name: str
    ext_ids: tuple[str, ...]  # empty when the request ids themselves are too many to name
    ids: int  # block ids counted (main and indexer)
    requests: int = 0  # request entries and final ids counted

    def refusal(self, limit: int) -> ProtocolError:
        if self.ids <= limit:
            return ProtocolError(
                f"readiness of layer {self.layer_idx} names {self.requests} requests and final ids, above this "
                f"Decode's max_ids_per_message={limit}: split the step, or raise the limit on Decode"
            )
        return ProtocolError(
            f"readiness of layer {self.layer_idx} names {self.ids} block ids, above this Decode's "
            f"max_ids_per_message={limit}: split the step, or raise the limit on Decode"
        )

    def as_batch(self) -> protocol.ReadReadyBatch | None:
        """The readiness with its id lists left out, to refuse it request by request; None
        if even its header is invalid."""
        try:
            reqs = tuple(protocol.ReadRequest(e, (), (), 0, 0) for e in self.ext_ids)
            return protocol.ReadReadyBatch(self.layer_idx, self.layer_name, reqs, ())
        except (TypeError, ValueError):
            return None


def _array_length(data: bytes, pos: int) -> int | None:
    """The length of the msgpack array that starts at ``data[pos]``, or None if none does."""
    if pos >= len(data):
        return None
    b = data[pos]
    if 0x90 <= b <= 0x9F:
        return b & 0x0F
    if b == 0xDC and pos + 3 <= len(data):
        return int.from_bytes(data[pos + 1 : pos + 3], "big")
    if b == 0xDD and pos + 5 <= len(data):
        return int.from_bytes(data[pos + 1 : pos + 5], "big")
    return None


def oversized_readiness(data: bytes, limit: int) -> Oversized | None:
    """The readiness in ``data`` if it names more than ``limit`` block ids, else None (also
    for anything that is not a well-formed readiness: the protocol decoder judges that).

    Free below ``limit`` bytes: a msgpack id takes at least one byte.
    """
    if len(data) <= limit:
        return None
    unpacker = msgpack.Unpacker(
        raw=False, max_buffer_size=len(data), max_str_len=len(data), max_bin_len=len(data),
        max_array_len=len(data), max_map_len=len(data) // 2, max_ext_len=0,
    )  # fmt: skip
    unpacker.feed(data)
    try:
        if unpacker.read_array_header() < 5 or unpacker.unpack() != _READ_READY_BATCH:
            return None
        layer_idx, layer_name = unpacker.unpack(), unpacker.unpack()
        ids, ext_ids = 0, []
        requests = unpacker.read_array_header()
        for _ in range(requests):
            fields = unpacker.read_array_header()
            if len(ext_ids) <= limit:  # past it they are not named (it would cost what it guards)
                ext_id = unpacker.unpack()
                if isinstance(ext_id, str):
                    ext_ids.append(ext_id)
            else:
                unpacker.skip()
            for k in range(fields - 1):
                if k < 2:  # the main and the indexer id lists: counted by their headers
                    ids += _array_length(data, unpacker.tell()) or 0
                unpacker.skip()
        requests += _array_length(data, unpacker.tell()) or 0  # done_ext_ids
    except Exception:  # noqa: BLE001 - malformed: the full decoder names what is wrong
        return None
    if (ids <= limit and requests <= limit) or type(layer_idx) is not int or not isinstance(layer_name, str):
        return None
    named = tuple(dict.fromkeys(ext_ids)) if len(ext_ids) <= limit else ()
    return Oversized(layer_idx, layer_name, named, ids, requests)


def oversized_settled(data: bytes, limit: int) -> int | None:
    """The request ids a ``settled`` in ``data`` names, if more than ``limit``, else None
    (also for anything that is not a ``settled``). Counted from the arrays' headers."""
    if len(data) <= limit:
        return None
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=len(data), max_bin_len=len(data), max_ext_len=0)
    unpacker.feed(data)
    try:
        if unpacker.read_array_header() < 3 or unpacker.unpack() != _SETTLED:
            return None
        ids = 0
        for _ in range(2):  # done_ext_ids, failed_ext_ids
            ids += _array_length(data, unpacker.tell()) or 0
            unpacker.skip()
    except Exception:  # noqa: BLE001 - malformed: the full decoder names what is wrong
        return None
    return ids if ids > limit else None
