"""rd2h-memfabric: the rd2h transfer engine over memfabric-hybrid (Ascend; host TCP on CPUs).

Nothing is imported from memfabric-hybrid until an engine is built.
"""

from rd2h_memfabric.engine import MemFabricEngine, MemFabricSession

__all__ = ["MemFabricEngine", "MemFabricSession"]
