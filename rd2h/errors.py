"""The one exception tree of rd2h.

Every failure that crosses a module or process boundary is one of these; no integer
status codes or status strings are returned to callers.

    RD2HError
    ├── ConfigError                  bad configuration, found before anything starts
    │   ├── TopologyError            unsupported Prefill/Decode TP arrangement
    │   └── PortError                a port out of range
    ├── ProtocolError                a wire message that cannot be used
    │   ├── RemoteProtocolError      bytes from a peer that do not decode to a valid message
    │   └── IncompatiblePeerError    peer speaks another protocol or cache-layout version
    ├── LayoutError                  source and destination layouts disagree (nothing is read)
    │   ├── MainTensorCountMismatch
    │   ├── MainBlockLengthMismatch
    │   ├── IndexerPresenceMismatch
    │   ├── IndexerBlockLengthMismatch
    │   ├── ScalePresenceMismatch
    │   ├── ScaleLayoutMismatch
    │   ├── BlockRangeError          a block id outside the tensor's block count
    │   └── RegionError              an address range outside the registered regions
    ├── BackendError                 loading a plugin failed
    │   ├── BackendNotFoundError     no backend of that name is installed
    │   └── BackendUnavailableError  installed, but a dependency is missing or cannot run here
    ├── TransferError                a batched read failed (engine boundary)
    │   ├── PeerGoneError            the peer process or host is gone
    │   └── TransferTimeout          a synchronous transport call ran past its bound
    ├── ChannelError                 control-channel failure
    │   ├── PortInUseError           bind failed because the address is taken
    │   └── FrameTooLargeError       a frame above the configured size limit
    ├── GateTimeout                  a storage slot was not released in time (dead Decode?)
    ├── LayerFailedError             Decode answered READ_FAILED; raised on the Prefill compute path
    └── StateError                   an event that is illegal in the tracked state (a usage error)
        └── UnknownRequestError      a request id the tracker does not know

Errors that are also built-in kinds (a timeout, a value error) inherit from the built-in
too, so ``except TimeoutError`` keeps working for callers who do not know rd2h.
"""

from __future__ import annotations

__all__ = [
    "RD2HError",
    "ConfigError",
    "TopologyError",
    "PortError",
    "ProtocolError",
    "RemoteProtocolError",
    "IncompatiblePeerError",
    "LayoutError",
    "MainTensorCountMismatch",
    "MainBlockLengthMismatch",
    "IndexerPresenceMismatch",
    "IndexerBlockLengthMismatch",
    "ScalePresenceMismatch",
    "ScaleLayoutMismatch",
    "BlockRangeError",
    "RegionError",
    "BackendError",
    "BackendNotFoundError",
    "BackendUnavailableError",
    "TransferError",
    "PeerGoneError",
    "TransferTimeout",
    "ChannelError",
    "PortInUseError",
    "FrameTooLargeError",
    "GateTimeout",
    "LayerFailedError",
    "StateError",
    "UnknownRequestError",
]


class RD2HError(Exception):
    """Base of every error rd2h raises on purpose."""


class ConfigError(RD2HError, ValueError):
    """Configuration that cannot work; raised before any process or socket starts."""


class TopologyError(ConfigError):
    """A Prefill/Decode tensor-parallel arrangement rd2h does not support."""


class PortError(ConfigError):
    """A control port outside 1..65535 once ranks are added."""


class ProtocolError(RD2HError):
    """A wire message that cannot be used."""


class RemoteProtocolError(ProtocolError, ValueError):
    """Bytes from a peer that do not decode to a valid message; says which field is wrong."""


class IncompatiblePeerError(ProtocolError):
    """The peer speaks another protocol or cache-layout version; the handshake is refused."""


class LayoutError(RD2HError, ValueError):
    """Source and destination layouts disagree; the layer is failed before any byte moves."""


class MainTensorCountMismatch(LayoutError):
    """Prefill and Decode have a different number of main K/V tensors."""


class MainBlockLengthMismatch(LayoutError):
    """A main K/V tensor has a different byte length per block on the two sides."""


class IndexerPresenceMismatch(LayoutError):
    """One side has an indexer tensor for the layer and the other does not."""


class IndexerBlockLengthMismatch(LayoutError):
    """The indexer tensors have different byte lengths per block."""


class ScalePresenceMismatch(LayoutError):
    """One side has a LIC8 scale tensor for the layer and the other does not."""


class ScaleLayoutMismatch(LayoutError):
    """The LIC8 scale tensors are laid out differently."""


class BlockRangeError(LayoutError):
    """A block id outside the tensor's block count, on the source or destination side."""


class RegionError(LayoutError):
    """An address range that lies outside every registered memory region."""


class BackendError(RD2HError):
    """A transfer engine or control channel could not be loaded."""


class BackendNotFoundError(BackendError, LookupError):
    """No backend of that name is installed; the message lists those that are."""


class BackendUnavailableError(BackendError, ImportError):
    """The backend is installed but cannot run: a missing dependency (named, with what to
    ``pip install``) or a machine it cannot run on."""


class TransferError(RD2HError):
    """A batched read failed. Raised by every engine at its boundary."""


class PeerGoneError(TransferError):
    """The peer process or host is gone (dead process, closed session)."""


class TransferTimeout(TransferError, TimeoutError):
    """A synchronous transport call did not finish within its bound."""


class ChannelError(RD2HError):
    """The control channel failed."""


class PortInUseError(ChannelError, OSError):
    """Binding failed because the address is already in use."""


class FrameTooLargeError(ChannelError):
    """A frame larger than the configured limit was sent or received."""


class GateTimeout(RD2HError, TimeoutError):
    """A storage slot was not released in time: a Decode endpoint never replied."""


class LayerFailedError(RD2HError):
    """A layer failed as a whole: a Decode endpoint never replied, answered a READ_FAILED that
    names no request, or the layer could not be announced. Raised where Prefill waits on the
    layer's storage slot. (A READ_FAILED naming requests fails only those requests.)"""


class StateError(RD2HError):
    """An event that is illegal in the current state of a tracked slot, layer or request:
    a usage error (or a peer's inconsistent signals). The message names the state and event."""


class UnknownRequestError(StateError, KeyError):
    """A request id the tracker does not know (never expected, or already forgotten)."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0]) if self.args else ""
