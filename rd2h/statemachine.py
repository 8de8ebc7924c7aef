"""Two helpers for the transition tables of the pure state machines (slots, send and receive trackers)."""

from __future__ import annotations

import operator
from collections.abc import Mapping
from enum import Enum
from typing import Any, TypeVar

from rd2h.errors import StateError

__all__ = ["step", "count"]

_S = TypeVar("_S", bound=Enum)
_E = TypeVar("_E", bound=Enum)


def step(table: Mapping[tuple[_S, _E], _S], state: _S, event: _E, what: str, *args: object) -> _S:
    """The state ``event`` leads to from ``state``; StateError if the table has no such move,
    naming ``what % args`` (formatted only then: this runs on every layer)."""
    moves = _BY_ID.get(id(table))
    if moves is None or moves[0] is not table:
        # a table keyed by its members' ids: an Enum's __hash__ is Python code, called for
        # both members of every lookup; ids hash in C. Tables are constants: built once each.
        moves = _BY_ID[id(table)] = (table, {(id(s), id(e)): new for (s, e), new in table.items()})
    new = moves[1].get((id(state), id(event)))
    if new is None:
        raise StateError(f"{what % args if args else what}: {event.name} is illegal in state {state.name}")
    return new


_BY_ID: dict[int, tuple[Mapping[Any, Any], dict[tuple[int, int], Any]]] = {}


def count(name: str, value: object, minimum: int) -> int:
    """``value`` as an int >= ``minimum`` (bools refused); StateError otherwise."""
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        number = None
    if number is None or isinstance(value, bool) or number < minimum:
        raise StateError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return number
