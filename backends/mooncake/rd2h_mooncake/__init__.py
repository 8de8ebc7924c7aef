"""rd2h-mooncake: the rd2h transfer engine over Mooncake Transfer Engine (peer-to-peer handshake).

Published under the ``rd2h.transfer_engines`` entry-point group as ``mooncake``. Nothing is
imported from mooncake until an engine is built.
"""

from rd2h_mooncake.engine import MooncakeEngine, MooncakeSession

__all__ = ["MooncakeEngine", "MooncakeSession"]
__version__ = "0.1.0"
