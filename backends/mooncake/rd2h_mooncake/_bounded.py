"""Native calls with a time bound: the call runs in a thread of its own and is waited for.

A native call cannot be cancelled. One that overruns keeps its thread; the caller gets
``TransferTimeout`` and must treat whatever the call touches as still in use.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from rd2h.errors import TransferError, TransferTimeout

__all__ = ["call"]

T = TypeVar("T")


def call(what: str, fn: Callable[[], T], timeout: float) -> T:
    """``fn()``'s result; ``TransferTimeout`` after ``timeout`` seconds, ``TransferError`` if it raised."""
    box: list[object] = []

    def run() -> None:
        try:
            box.append(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box.append(exc)

    t = threading.Thread(target=run, name=f"rd2h-mooncake-{what}", daemon=True)
    t.start()
    t.join(max(timeout, 0.0))
    if t.is_alive():
        raise TransferTimeout(f"mooncake {what} did not return within {timeout:.3g} s")
    result = box[0]
    if isinstance(result, BaseException):
        raise TransferError(f"mooncake {what} raised {type(result).__name__}: {result}") from result
    return result  # type: ignore[return-value]
