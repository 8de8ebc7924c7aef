"""``statemachine.step``: table lookups on every layer, so the description of a move is
formatted only when the move is illegal, and a table is looked up by its members' ids."""

from __future__ import annotations

from enum import Enum

import pytest

from rd2h.errors import StateError
from rd2h.statemachine import step


class _S(Enum):
    A = "a"
    B = "b"


class _E(Enum):
    GO = "go"
    STOP = "stop"


_TABLE = {(_S.A, _E.GO): _S.B, (_S.B, _E.STOP): _S.A}


class _Loud:
    shown = 0

    def __repr__(self) -> str:
        _Loud.shown += 1
        return "loud"


def test_a_legal_move_formats_nothing() -> None:
    _Loud.shown = 0
    assert step(_TABLE, _S.A, _E.GO, "thing %r", _Loud()) is _S.B
    assert step(_TABLE, _S.B, _E.STOP, "thing %r", _Loud()) is _S.A
    assert _Loud.shown == 0


def test_an_illegal_move_names_what_moved() -> None:
    with pytest.raises(StateError, match=r"thing loud: STOP is illegal in state A"):
        step(_TABLE, _S.A, _E.STOP, "thing %r", _Loud())
    with pytest.raises(StateError, match=r"plain 50%: GO is illegal in state B"):
        step(_TABLE, _S.B, _E.GO, "plain 50%")  # no arguments: the text as given


def test_a_new_table_of_the_same_members_is_its_own() -> None:
    other = {(_S.A, _E.GO): _S.A}
    assert step(other, _S.A, _E.GO, "x") is _S.A
    assert step(_TABLE, _S.A, _E.GO, "x") is _S.B
    with pytest.raises(StateError):
        step(other, _S.B, _E.STOP, "x")
