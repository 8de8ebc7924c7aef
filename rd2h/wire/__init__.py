"""What crosses the wire between Prefill and Decode, and how it is encoded (pure).

The messages of the protocol and their codec (``protocol``), the ``mf_meta`` handshake
(``mf_meta``) with the per-layer source description it carries (``layer_metadata``), the
decoder that reads a step's readiness once for all its layers (``readiness_decoder``), the
endpoint a Decode instance advertises through its rendezvous (``endpoint``) and the field
checks every codec shares (``fields``). Bytes in, typed values out: nothing here opens a
socket, starts a thread or reads a clock. It may import ``rd2h.errors`` and ``rd2h.layout``
(a layer's description is a layout); never ``rd2h.prefill``, ``rd2h.decode`` or anything
that does I/O. docs/protocol.md is the reference a compatible peer is written from.
"""
