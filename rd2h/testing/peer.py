"""The source side of a conformance test (``rd2h.cli.peer``), named here for backend authors.

The peer lives with the command-line tooling because ``rd2h probe`` and ``rd2h bench`` start it
too, and the tooling must not import ``rd2h.testing``; this module re-exports it.
"""

from __future__ import annotations

from rd2h.cli.peer import GAP, GAP_BYTE, PeerProcess, load_engine, pattern

__all__ = ["PeerProcess", "pattern", "load_engine", "GAP", "GAP_BYTE"]
