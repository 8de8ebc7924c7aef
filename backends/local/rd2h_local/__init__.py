"""rd2h-local: the same-host transfer engine for rd2h (``process_vm_readv``).

Published under the ``rd2h.transfer_engines`` entry-point group as ``local``.
"""

from rd2h_local.engine import LocalEngine, LocalSession

__all__ = ["LocalEngine", "LocalSession"]
__version__ = "0.1.0"
