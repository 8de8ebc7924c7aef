"""Tensor-parallel mapping, control ports and the work split (pure, no I/O).

Two arrangements of Prefill TP size ``p_tp`` and Decode TP size ``d_tp`` are supported:

* **fan-in** (``p_tp % d_tp == 0``, the specification's case): ``ratio = p_tp // d_tp``
  Prefill ranks form the contributor group of one Decode rank; ``d_rank = p_rank // ratio``
  and ``member = p_rank % ratio``. Equal sizes are fan-in with ``ratio == 1``.
* **fan-out** (``d_tp % p_tp == 0``, ``d_tp > p_tp``): each Prefill rank serves
  ``fan_out = d_tp // p_tp`` Decode ranks, and each Decode rank has exactly one contributor
  (member 0 of a group of 1), from which it pulls its main share and a complete indexer.

Who reads which blocks is decided on Decode from the readiness message alone (see
:func:`share`): main K/V is split over the Decode ranks and pulled only by member 0;
the indexer (and the LIC8 scale, which follows it) is split over the ``ratio`` members.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

from rd2h.errors import PortError, TopologyError

__all__ = [
    "MAX_PORT",
    "Topology",
    "base_port",
    "rank_port",
    "decode_ports",
    "remote_port",
    "share",
    "main_share",
    "indexer_share",
]

MAX_PORT = 65535


def _int(name: str, value: object) -> int:
    if isinstance(value, bool):
        raise TopologyError(f"{name} must be an integer, got {value!r}")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TopologyError(f"{name} must be an integer, got {value!r}") from None


def _rank(name: str, value: object, size: int, size_name: str) -> int:
    rank = _int(name, value)
    if not 0 <= rank < size:
        raise TopologyError(
            f"{name} {rank} is out of range: {size_name} is {size}, so 0..{size - 1}"
        )
    return rank


@dataclass(frozen=True, slots=True)
class Topology:
    """A Prefill/Decode TP arrangement, validated on construction.

    Raises :class:`~rd2h.errors.TopologyError` when neither size divides the other.
    """

    prefill_tp: int
    decode_tp: int

    def __post_init__(self) -> None:
        p_tp = _int("prefill_tp", self.prefill_tp)
        d_tp = _int("decode_tp", self.decode_tp)
        if p_tp < 1 or d_tp < 1:
            raise TopologyError(f"TP sizes must be >= 1, got prefill_tp={p_tp}, decode_tp={d_tp}")
        if p_tp % d_tp and d_tp % p_tp:
            raise TopologyError(
                f"prefill_tp={p_tp} and decode_tp={d_tp} are not supported: one must divide the "
                f"other (fan-in needs prefill_tp % decode_tp == 0, here {p_tp % d_tp}; "
                f"fan-out needs decode_tp % prefill_tp == 0, here {d_tp % p_tp})"
            )
        object.__setattr__(self, "prefill_tp", p_tp)
        object.__setattr__(self, "decode_tp", d_tp)

    @property
    def ratio(self) -> int:
        """Prefill contributors per Decode rank (``tp_ratio`` on the wire); 1 in fan-out."""
        return max(self.prefill_tp // self.decode_tp, 1)

    @property
    def fan_out(self) -> int:
        """Decode ranks served by one Prefill rank; 1 in fan-in."""
        return max(self.decode_tp // self.prefill_tp, 1)

    def decode_ranks_of(self, p_rank: int) -> tuple[int, ...]:
        """The Decode ranks Prefill rank ``p_rank`` sends readiness to."""
        p_rank = _rank("p_rank", p_rank, self.prefill_tp, "prefill_tp")
        if self.fan_out > 1:
            first = p_rank * self.fan_out
            return tuple(range(first, first + self.fan_out))
        return (p_rank // self.ratio,)

    def member_of(self, p_rank: int) -> int:
        """The contributor index of ``p_rank`` in its group (``group_member_idx`` on the wire)."""
        p_rank = _rank("p_rank", p_rank, self.prefill_tp, "prefill_tp")
        return p_rank % self.ratio

    def contributors_of(self, d_rank: int) -> tuple[int, ...]:
        """The Prefill ranks that send to Decode rank ``d_rank``, in member order."""
        d_rank = _rank("d_rank", d_rank, self.decode_tp, "decode_tp")
        if self.fan_out > 1:
            return (d_rank // self.fan_out,)
        first = d_rank * self.ratio
        return tuple(range(first, first + self.ratio))


# -- ports -------------------------------------------------------------------------------


def _port_int(name: str, value: object) -> int:
    if isinstance(value, bool):
        raise PortError(f"{name} must be an integer, got {value!r}")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise PortError(f"{name} must be an integer, got {value!r}") from None


def _check_port(name: str, value: object) -> int:
    port = _port_int(name, value)
    if not 1 <= port <= MAX_PORT:
        raise PortError(f"{name} {port} is outside 1..{MAX_PORT}")
    return port


def base_port(kv_port: int, global_dp_rank: int, tp_size: int) -> int:
    """``kv_port + global_dp_rank * tp_size``: the first control port of one DP engine.

    Raises PortError if ``kv_port`` or the result is outside 1..65535.
    """
    kv_port = _check_port("kv_port", kv_port)
    dp = _port_int("global_dp_rank", global_dp_rank)
    tp = _port_int("tp_size", tp_size)
    if dp < 0 or tp < 1:
        raise PortError(f"need global_dp_rank >= 0 and tp_size >= 1, got {dp} and {tp}")
    port = kv_port + dp * tp
    if port > MAX_PORT:
        raise PortError(
            f"base port {port} = kv_port {kv_port} + global_dp_rank {dp} * tp_size {tp} "
            f"is above {MAX_PORT}"
        )
    return port


def rank_port(base_port: int, tp_rank: int) -> int:
    """``base_port + tp_rank``: the port a Decode TP rank binds. Raises PortError above 65535."""
    base = _check_port("base_port", base_port)
    rank = _port_int("tp_rank", tp_rank)
    if rank < 0:
        raise PortError(f"tp_rank must be >= 0, got {rank}")
    port = base + rank
    if port > MAX_PORT:
        raise PortError(f"rank port {port} = base_port {base} + tp_rank {rank} is above {MAX_PORT}")
    return port


def decode_ports(kv_port: int, global_dp_rank: int, d_tp: int) -> list[int]:
    """Every Decode rank's port for one DP engine; the highest is checked against 65535."""
    base = base_port(kv_port, global_dp_rank, d_tp)
    highest = base + d_tp - 1
    if highest > MAX_PORT:
        raise PortError(
            f"highest Decode port {highest} = kv_port {kv_port} + global_dp_rank {global_dp_rank} "
            f"* tp_size {d_tp} + tp_rank {d_tp - 1} is above {MAX_PORT}"
        )
    return list(range(base, highest + 1))


def remote_port(decode_base_port: int, d_rank: int, d_tp: int) -> int:
    """The port Prefill connects to for Decode rank ``d_rank`` behind an advertised base port.

    Raises TopologyError if ``d_rank`` is not in ``0..d_tp-1`` and PortError if the
    advertised base or the mapped port is outside 1..65535.
    """
    d_tp = _int("d_tp", d_tp)
    if d_tp < 1:
        raise TopologyError(f"d_tp must be >= 1, got {d_tp}")
    d_rank = _rank("d_rank", d_rank, d_tp, "decode_tp")
    base = _check_port("Decode base port", decode_base_port)
    port = base + d_rank
    if port > MAX_PORT:
        raise PortError(
            f"remote port {port} = advertised Decode base port {base} + d_rank {d_rank} "
            f"is above {MAX_PORT}"
        )
    return port


# -- work split ---------------------------------------------------------------------------


def share(n: int, sharers: int, rank: int, start: int) -> tuple[int, int]:
    """The slice ``[lo, hi)`` of an ``n``-block chunk that sharer ``rank`` of ``sharers`` reads.

    The chunk's destinations start at ``start``; sharer ``rank`` takes logical position
    ``(rank - start % sharers) % sharers``, so the first (longer) part rotates with the
    start and small chunks do not all land on rank 0. ``n`` is cut into ``sharers``
    contiguous parts, the first ``n % sharers`` one block longer. Raises TopologyError
    for negative counts or a rank out of range.
    """
    n = _int("n", n)
    start = _int("start", start)
    sharers = _int("sharers", sharers)
    if sharers < 1:
        raise TopologyError(f"sharers must be >= 1, got {sharers}")
    rank = _rank("rank", rank, sharers, "sharers")
    if n < 0 or start < 0:
        raise TopologyError(f"block count and start must be >= 0, got n={n}, start={start}")
    pos = (rank - start % sharers) % sharers
    base, extra = divmod(n, sharers)
    lo = pos * base + min(pos, extra)
    return lo, lo + base + (pos < extra)


def main_share(
    n: int, start: int, decode_tp: int, decode_rank: int, member: int
) -> tuple[int, int]:
    """Main K/V slice a Decode rank reads from a contributor: only member 0 pulls main."""
    member = _int("member", member)
    if member < 0:
        raise TopologyError(f"member must be >= 0, got {member}")
    if member != 0:
        share(n, decode_tp, decode_rank, start)  # validate the rest all the same
        return 0, 0
    return share(n, decode_tp, decode_rank, start)


def indexer_share(n: int, start: int, ratio: int, member: int) -> tuple[int, int]:
    """Indexer (and LIC8 scale) slice a Decode rank reads from contributor ``member``."""
    return share(n, ratio, member, start)
