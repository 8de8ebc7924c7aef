"""Which device blocks a Prefill step stages, and where they land in the host mirror (pure).

A staged Prefill announces host mirror rows, not device blocks: Decode reads the mirror.
Each step's ready blocks (the chunks :mod:`rd2h.layout.chunking` cuts, as the send tracker
cuts them) get consecutive mirror rows ``0, 1, ...`` in request order, one run for main
blocks and one for indexer blocks; every layer of the step copies the same device blocks
into the same rows of its mirror slot. The send tracker is told the rows as the request's
block ids for those positions (positions it never announces get a placeholder), so it needs
no change: it announces rows as it would announce blocks.

No I/O, threads or clock: :class:`~rd2h.staging.prefill_mirror.StagedSource` feeds it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from rd2h.errors import ConfigError, RD2HError
from rd2h.layout.chunking import GroupChunks

__all__ = ["MirrorTables", "StagedStep"]

Ids = npt.NDArray[np.int64]
_EMPTY = np.zeros(0, np.int64)


def _ids(values: Iterable[int], limit: int, what: str) -> Ids:
    ids = np.asarray(values if isinstance(values, np.ndarray) else list(values)).reshape(-1)
    if ids.size == 0:
        return _EMPTY
    if ids.dtype.kind not in "iu" or (ids < 0).any() or (ids >= limit).any():
        raise ConfigError(f"{what} must be integers in 0..{limit - 1} (the device blocks of every layer)")
    return ids.astype(np.int64, copy=False)


@dataclass(slots=True)
class _Request:
    main: GroupChunks
    indexer: GroupChunks
    main_ids: Ids  # device block ids, by position
    indexer_ids: Ids | None  # None: the main ids
    given_main: int = 0  # positions the send tracker has ids for
    given_indexer: int = 0


@dataclass(slots=True)
class StagedStep:
    """One step: what to tell the send tracker, and which device blocks fill mirror rows.

    ``extend[ext_id]`` is ``(main rows, indexer rows)`` to append to the request's ids;
    ``main_blocks[r]`` is the device block staged in mirror row ``r`` (likewise
    ``indexer_blocks``; blocks of a request the tracker then refuses are staged all the
    same: their ids were checked, and nothing reads them); ``refused`` holds requests whose
    blocks do not fit the mirror.
    """

    extend: dict[str, tuple[Ids, Ids]] = field(default_factory=dict)
    main_blocks: Ids = field(default_factory=lambda: _EMPTY)
    indexer_blocks: Ids = field(default_factory=lambda: _EMPTY)
    refused: dict[str, RD2HError] = field(default_factory=dict)
    _chunks: dict[str, tuple[object, object, int, int]] = field(default_factory=dict)


class MirrorTables:
    """Per request, its device block ids and chunk progress; per step, its mirror rows.

    ``main_rows``/``indexer_rows`` are the rows one mirror slot holds; ``main_limit`` /
    ``indexer_limit`` the device blocks of the smallest layer (an id at or past it is
    refused). ``block_size`` / ``indexer_block_size`` as the send tracker's.
    """

    def __init__(
        self, *, block_size: int, indexer_block_size: int | None, main_rows: int, indexer_rows: int,
        main_limit: int, indexer_limit: int,
    ) -> None:  # fmt: skip
        if main_rows <= 0 or indexer_rows < 0:
            raise ConfigError(f"a mirror slot needs rows, got {main_rows} main and {indexer_rows} indexer")
        self.block_size = block_size
        self.indexer_block_size = block_size if indexer_block_size is None else indexer_block_size
        self.main_rows, self.indexer_rows = main_rows, indexer_rows
        self._main_limit, self._indexer_limit = main_limit, indexer_limit
        self._requests: dict[str, _Request] = {}

    def check(
        self, ext_id: str, main_ids: Iterable[int], indexer_ids: Iterable[int] | None, num_tokens: int, first_block: int
    ) -> _Request:
        """The record ``add`` would keep; raises ConfigError for ids past the device blocks
        or bad token counts (nothing recorded)."""
        for what, value in (("num_tokens", num_tokens), ("first_block", first_block)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"request {ext_id!r}: {what} must be an int, got {value!r}")
        if indexer_ids is None and self.indexer_block_size != self.block_size:
            raise ConfigError(f"request {ext_id!r}: indexer blocks hold other tokens than main ones; give their ids")
        main = GroupChunks(self.block_size, num_tokens, first_block)
        indexer = GroupChunks(self.indexer_block_size, num_tokens, first_block * self.block_size // self.indexer_block_size)
        return _Request(
            main, indexer, _ids(main_ids, self._main_limit, f"request {ext_id!r}: main_block_ids"),
            None if indexer_ids is None else _ids(indexer_ids, self._indexer_limit, f"request {ext_id!r}: indexer_block_ids"),
        )  # fmt: skip

    def add(self, ext_id: str, record: _Request) -> None:
        self._requests[ext_id] = record

    def extend(self, ext_id: str, main_ids: Iterable[int], indexer_ids: Iterable[int]) -> None:
        """Append device ids; ignored for a request not here (ended). Raises ConfigError."""
        request = self._requests.get(ext_id)
        if request is None:
            return
        main = _ids(main_ids, self._main_limit, f"request {ext_id!r}: main_block_ids")
        indexer = _ids(indexer_ids, self._indexer_limit, f"request {ext_id!r}: indexer_block_ids")
        if request.indexer_ids is None and indexer.size:
            raise ConfigError(f"request {ext_id!r} was added without indexer ids: its indexer uses the main ids")
        request.main_ids = np.concatenate((request.main_ids, main))
        if request.indexer_ids is not None:
            request.indexer_ids = np.concatenate((request.indexer_ids, indexer))

    def forget(self, ext_ids: Iterable[str]) -> None:
        for ext_id in ext_ids:
            self._requests.pop(ext_id, None)

    def __contains__(self, ext_id: object) -> bool:
        return ext_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def plan(self, computed: Mapping[str, int]) -> StagedStep:
        """Mirror rows for the chunks ``computed`` makes ready, in order; a request that
        does not fit the rows left, or whose chunk the tracker would refuse, is not given
        rows (the tracker then fails or refuses it, as it would unstaged)."""
        step = StagedStep()
        main_parts: list[Ids] = []
        indexer_parts: list[Ids] = []
        used_main = used_indexer = 0
        for ext_id, tokens in computed.items():
            request = self._requests.get(ext_id)
            if request is None or request.main.final_sent:
                continue
            try:
                main, indexer = request.main.peek(tokens), request.indexer.peek(tokens)
            except ConfigError:
                continue  # the tracker says why
            indexer_table = request.main_ids if request.indexer_ids is None else request.indexer_ids
            if len(request.main_ids) < main.hi or len(indexer_table) < indexer.hi:
                continue  # missing ids: the tracker says so
            if used_main + main.count > self.main_rows or used_indexer + indexer.count > self.indexer_rows:
                step.refused[ext_id] = ConfigError(
                    f"request {ext_id!r}: this step stages {used_main + main.count} main and "
                    f"{used_indexer + indexer.count} indexer blocks; a mirror slot holds {self.main_rows} and "
                    f"{self.indexer_rows} (raise blocks_per_slot)"
                )
                continue
            main_rows = np.arange(used_main, used_main + main.count, dtype=np.int64)
            indexer_rows = np.arange(used_indexer, used_indexer + indexer.count, dtype=np.int64)
            step.extend[ext_id] = (
                np.concatenate((np.zeros(max(main.lo - request.given_main, 0), np.int64), main_rows)),
                np.concatenate((np.zeros(max(indexer.lo - request.given_indexer, 0), np.int64), indexer_rows)),
            )
            step._chunks[ext_id] = (main, indexer, main.hi, indexer.hi)
            main_parts.append(request.main_ids[main.lo : main.hi])
            indexer_parts.append(indexer_table[indexer.lo : indexer.hi])
            used_main += main.count
            used_indexer += indexer.count
        if main_parts:
            step.main_blocks = np.concatenate(main_parts)
            step.indexer_blocks = np.concatenate(indexer_parts)
        return step

    def commit(self, step: StagedStep, scheduled: Iterable[str]) -> None:
        """The tracker accepted ``scheduled`` of the step: their chunks count as announced."""
        for ext_id in scheduled:
            request = self._requests.get(ext_id)
            chunks = step._chunks.get(ext_id)
            if request is None or chunks is None:
                continue
            main, indexer, _, _ = chunks
            request.main.commit(main)  # type: ignore[arg-type]
            request.indexer.commit(indexer)  # type: ignore[arg-type]

    def handed(self, step: StagedStep) -> None:
        """The tracker was given ``step.extend``: those positions have ids now."""
        for ext_id, (main, indexer) in step.extend.items():
            request = self._requests.get(ext_id)
            if request is not None:
                request.given_main += len(main)
                request.given_indexer += len(indexer)
