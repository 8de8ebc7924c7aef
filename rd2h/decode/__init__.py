"""The Decode side: validate each readiness, read this rank's share in one batch, reply once.

The receive tracker (``receive_tracker``, its states and records in ``receive_states``)
follows every request and Prefill peer of one Decode rank and settles each request exactly
once; ``held_blocks`` guards the destination blocks live requests hold; ``rank_reads`` says
which blocks of a readiness this rank reads, from where to where; ``completeness`` checks a
contributor's final signal against what it announced; ``peer_limits`` bounds what one Prefill
peer may cost. These are pure. The threads live in ``admission`` (handshakes off the loop),
``sink`` (the :class:`~rd2h.decode.sink.Sink` runtime: listener, loop, engine) and
``layer_read`` (one readiness turned into one batched read and its reply, on the sink's loop). This package may
import ``rd2h.wire``, ``rd2h.layout`` and the top-level face; never ``rd2h.prefill``.
"""
