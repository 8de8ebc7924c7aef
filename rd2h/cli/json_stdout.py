"""Keep stdout for the one JSON document of a ``--json`` command.

Native engine libraries print to file descriptor 1 (memfabric logs its port-bind retries
there, from the process and from the rank processes it starts), so a caller parsing
``rd2h demo --json`` got log lines glued to the JSON. For the whole command, descriptor 1
points at stderr, inherited by every child; the JSON goes to a private duplicate of the
original stdout. Descriptor 1 is not restored afterwards: exit handlers of native code may
still print, and only the JSON may ever reach the caller's stdout.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import sys
from typing import Any, TextIO

__all__ = ["reserve_stdout_for_json", "write_json"]


def reserve_stdout_for_json() -> TextIO:
    """Point descriptor 1 (and ``sys.stdout``) at stderr; return a stream on the original stdout.

    A caller that runs the command in its own process with ``sys.stdout`` replaced by a stream
    that is not descriptor 1 (a test capturing it, a program collecting the JSON) gets that
    stream back, and no descriptor is touched: descriptor 1 is then not where the JSON goes."""
    try:
        on_descriptor_1 = sys.stdout.fileno() == 1
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both
        on_descriptor_1 = False
    if not on_descriptor_1:
        return sys.stdout
    sys.stdout.flush()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).fflush(None)  # C stdio buffers written so far belong to the old target
    kept = os.dup(1)
    os.dup2(2, 1)
    return os.fdopen(kept, "w", encoding="utf-8")


def write_json(stream: TextIO, document: Any, *, indent: int | None = None) -> None:
    """Write ``document`` as one JSON text and a newline, flushed at once (``os._exit`` may follow)."""
    json.dump(document, stream, indent=indent)
    stream.write("\n")
    stream.flush()
