"""The Prefill side: announce each computed layer, collect Decode's replies, free slots.

The send tracker (``send_tracker``, with its states in ``send_states`` and the records of a
step in ``send_steps``) decides per request and per Decode endpoint what was announced, what
is still unanswered and how each request ends; the slot table (``slots``) says when a reused
storage buffer may be overwritten. These are pure state machines that take ``now`` as an
argument. The threads live in ``gate`` (the slot table behind a Condition) and ``source``
(the :class:`~rd2h.prefill.source.Source` runtime: its sender loop, dialer and engine). This
package may import ``rd2h.wire``, ``rd2h.layout`` and the top-level face; never
``rd2h.decode``.
"""
