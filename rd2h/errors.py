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
    │   ├── LayoutTagMismatch        same bytes per block, different dtype/shape/tokens/layout
    │   ├── MainTensorCountMismatch
    │   ├── MainBlockLengthMismatch
    │   ├── IndexerPresenceMismatch
    │   ├── IndexerBlockLengthMismatch
    │   ├── ScalePresenceMismatch
    │   ├── ScaleLayoutMismatch
    │   ├── BlockRangeError          a block id outside the tensor's block count
    │   ├── RegionError              an address range outside the registered regions
    │   └── DestinationError         expected destinations that overlap, repeat or fall outside
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
    ├── LayerFailedError             a layer failed as a whole: the outcome of each request it held
    ├── WaitTimeout                  wait()/wait_finished() ran out before the requests ended
    ├── DeadlineExceeded             a request's own deadline passed before it completed
    ├── ReplyTimeout                 a peer did not reply within its bound (silent Decode)
    ├── RemoteError                  the peer failed a request for a reason this build has no class for
    └── StateError                   an event that is illegal in the tracked state (a usage error)
        ├── UnknownRequestError      a request id the tracker does not know
        └── DuplicateRequestError    a request id that is already tracked

Errors that are also built-in kinds (a timeout, a value error) inherit from the built-in
too, so ``except TimeoutError`` keeps working for callers who do not know rd2h.

A failure that crosses the wire travels as its class name and message (``wire_kind`` /
``from_wire``): the peer rebuilds the same class from this tree, or :class:`RemoteError`
for a name it does not know, so reasons stay exceptions with a class on both sides.
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
    "DuplicateRequestError",
    "LayoutTagMismatch",
    "DestinationError",
    "WaitTimeout",
    "DeadlineExceeded",
    "ReplyTimeout",
    "RemoteError",
    "wire_kind",
    "from_wire",
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


class LayoutTagMismatch(LayoutError):
    """The two sides move the same bytes per block but describe them differently (dtype,
    per-block shape, tokens per block or layout name): mixing them would corrupt silently."""


class DestinationError(LayoutError):
    """Destinations given to ``expect`` that repeat a block, overlap another live request's
    blocks, or lie outside the destination tensors."""


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
    """A layer failed as a whole: a legacy Decode answered a READ_FAILED that names no request
    and no error class, or the layer could not be announced (its event failed). Prefill fails
    every request of that readiness with it (in their outcomes) and frees the storage slot like
    any reply does; it is never raised on the compute path, which goes on with the other
    requests. A READ_FAILED naming requests fails only those, with the class Decode sent."""


class WaitTimeout(RD2HError, TimeoutError):
    """A wait for requests ran out; the message names the requests still pending."""


class DeadlineExceeded(RD2HError, TimeoutError):
    """A request's own deadline passed before all its bytes arrived; it is failed."""


class ReplyTimeout(RD2HError, TimeoutError):
    """A peer did not reply within its bound; the requests it held are failed."""


class RemoteError(RD2HError):
    """The peer failed a request with an error class this build does not know.

    ``kind`` is the class name the peer sent."""

    def __init__(self, message: str, kind: str = "") -> None:
        super().__init__(message)
        self.kind = kind


class StateError(RD2HError):
    """An event that is illegal in the current state of a tracked slot, layer or request:
    a usage error (or a peer's inconsistent signals). The message names the state and event."""


class UnknownRequestError(StateError, KeyError):
    """A request id the tracker does not know (never expected, or already forgotten)."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0]) if self.args else ""


class DuplicateRequestError(StateError):
    """A request id that is already tracked was added or expected again."""


def wire_kind(error: BaseException) -> str:
    """The name a failure travels under: its class name when it is in this tree, else
    ``RD2HError``. A :class:`RemoteError` keeps the name it arrived with."""
    if isinstance(error, RemoteError) and error.kind:
        return error.kind
    if isinstance(error, RD2HError) and _TREE.get(type(error).__name__) is type(error):
        return type(error).__name__
    return "RD2HError"


def from_wire(kind: str, message: str) -> RD2HError:
    """Rebuild a peer's failure: the class of this tree named ``kind``, or RemoteError."""
    cls = _TREE.get(kind)
    if cls is None or cls is RemoteError:
        return RemoteError(message, kind)
    try:
        return cls(message)
    except TypeError:  # a class whose constructor wants more than a message
        return RemoteError(message, kind)


_TREE: dict[str, type[RD2HError]] = {
    name: obj
    for name, obj in list(globals().items())
    if isinstance(obj, type) and issubclass(obj, RD2HError)
}
