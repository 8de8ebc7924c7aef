"""Everything that touches the NIXL wheel: finding it, importing it, mapping its errors,
and bounded calls into it.

NIXL raises its own exception classes (``nixlRemoteDisconnectError``, ...) from its bindings;
they are turned into rd2h's here, once. A native call that may block runs in a thread of
its own and is waited for at most ``timeout`` seconds; it cannot be cancelled, so a caller
that gets ``TransferTimeout`` treats what the call touches as still in use.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable
from types import ModuleType
from typing import TypeVar

from rd2h.engine_support import bounded_call
from rd2h.errors import BackendUnavailableError, PeerGoneError, RD2HError, TransferError

__all__ = ["environment", "import_nixl", "to_rd2h", "call", "INSTALL_HINT"]

INSTALL_HINT = "pip install 'rd2h[nixl]' (the package nixl, which vLLM's NIXL connector imports too; install torch first)"
# ``nixl`` first: the module vLLM's own connector imports (a meta package choosing its CUDA
# build at import); ``nixl_cu12`` where only that wheel is installed
_MODULES = ("nixl", "nixl_cu12")

T = TypeVar("T")


def environment() -> tuple[bool, str]:
    """Whether NIXL can start here; imports and starts nothing."""
    if not any(importlib.util.find_spec(m) for m in _MODULES):
        return False, f"NIXL is not installed ({INSTALL_HINT})"
    return True, ""


def prepare_environment() -> None:
    """UCX settings that must be in the environment before NIXL loads UCX; the user's win.

    - ``UCX_LOG_FILE=stderr``: UCX logs to stdout by default (a request NIXL leaks on a
      disconnected peer is reported at exit), and stdout may be a protocol (``--json``).
    - ``UCX_MODULES=^ib`` on a host without RDMA devices: with UCX's InfiniBand modules
      loaded, nixl-cu12 1.5.1's bundled libnl-route crashes the process at exit (SIGSEGV in
      ``rtnl_tc_unregister`` from ``_dl_fini``), so every process that built an agent would
      exit with 139; without RDMA devices those modules serve nothing.
    """
    os.environ.setdefault("UCX_LOG_FILE", "stderr")
    if not os.path.isdir("/sys/class/infiniband"):
        os.environ.setdefault("UCX_MODULES", "^ib")


def import_nixl() -> ModuleType:
    """The module with ``nixl_agent`` and ``nixl_agent_config``."""
    for name in _MODULES:
        if importlib.util.find_spec(name) is None:
            continue
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            raise BackendUnavailableError(f"NIXL cannot be imported ({exc}); {INSTALL_HINT}") from exc
        except OSError as exc:  # its bundled libraries failed to load
            raise BackendUnavailableError(f"NIXL cannot load its libraries: {exc}") from exc
    raise BackendUnavailableError(f"NIXL is not installed; {INSTALL_HINT}")


def to_rd2h(exc: BaseException, what: str) -> RD2HError:
    """The rd2h error for an exception NIXL raised during ``what`` (rd2h's own pass through)."""
    kind = type(exc).__name__
    if isinstance(exc, RD2HError):
        return exc
    if "RemoteDisconnect" in kind:
        return PeerGoneError(f"nixl {what}: the peer agent disconnected ({kind}: {exc})")
    return TransferError(f"nixl {what} failed ({kind}: {exc})")


def call(what: str, fn: Callable[[], T], timeout: float) -> T:
    """``fn()``'s result; ``TransferTimeout`` after ``timeout`` s; NIXL's errors as rd2h's."""
    return bounded_call("nixl", what, fn, timeout, to_rd2h)
