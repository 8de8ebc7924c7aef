"""Two helpers for the transition tables of the pure state machines (slots, send and receive trackers)."""

from __future__ import annotations

import operator
from collections.abc import Mapping
from enum import Enum
from typing import TypeVar

from rd2h.errors import StateError

__all__ = ["step", "count"]

_S = TypeVar("_S", bound=Enum)
_E = TypeVar("_E", bound=Enum)


def step(table: Mapping[tuple[_S, _E], _S], state: _S, event: _E, what: str) -> _S:
    """The state ``event`` leads to from ``state``; StateError if the table has no such move."""
    try:
        return table[(state, event)]
    except KeyError:
        raise StateError(f"{what}: {event.name} is illegal in state {state.name}") from None


def count(name: str, value: object, minimum: int) -> int:
    """``value`` as an int >= ``minimum`` (bools refused); StateError otherwise."""
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        number = None
    if number is None or isinstance(value, bool) or number < minimum:
        raise StateError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return number
