"""Conformance suite and fixtures for rd2h backend authors.

A transfer engine is checked by subclassing ``EngineConformance`` in the backend's tests::

    from rd2h.testing import EngineConformance

    class TestMyEngine(EngineConformance):
        engine_name = "myengine"        # its name in the rd2h.transfer_engines group
        engine_options = {}             # constructor options for both roles

Every test then runs against the engine, reading across two real processes (the source
side in ``python -m rd2h.cli.peer``). See ``rd2h.testing.engine_suite`` for the hooks
(per-role options, peer environment, optional features, time bounds). Control channels
have the same in ``ChannelConformance`` (``rd2h.testing.channel_suite``).

This package is also a pytest plugin (``rd2h.testing.plugin``) that pytest loads in every
run; so importing it is cheap: the suite and its dependencies load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rd2h.testing.channel_suite import ChannelConformance
    from rd2h.testing.engine_suite import EngineConformance
    from rd2h.testing.peer import PeerProcess

__all__ = ["EngineConformance", "ChannelConformance", "PeerProcess"]

_LAZY = {
    "EngineConformance": "rd2h.testing.engine_suite",
    "ChannelConformance": "rd2h.testing.channel_suite",
    "PeerProcess": "rd2h.testing.peer",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rd2h.testing' has no attribute {name!r}")
