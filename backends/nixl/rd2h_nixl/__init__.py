"""rd2h-nixl: the rd2h transfer engine over a NIXL agent (UCX backend).

Published under the ``rd2h.transfer_engines`` entry-point group as ``nixl``. Nothing is
imported from NIXL until an engine is built.
"""

from rd2h_nixl.engine import NixlEngine, NixlSession

__all__ = ["NixlEngine", "NixlSession"]
__version__ = "0.1.0"
