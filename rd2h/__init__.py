"""rd2h: layer-by-layer pull of LLM KV cache from Prefill to Decode.

Nothing starts at import: the runtimes, backends and optional dependencies load on use.
"""

from rd2h import errors
from rd2h.errors import RD2HError

__all__ = ["RD2HError", "errors", "__version__"]
__version__ = "0.1.0"
