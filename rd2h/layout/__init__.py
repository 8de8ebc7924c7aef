"""Where KV bytes live and how a transfer is cut (pure).

Layer layouts and their validation (``layers``), registered memory regions and vectorized
range checks (``regions``), the tensor-parallel mapping, ports and work split (``topology``),
KV heads over TP ranks and head ranges of blocks (``heads``),
the descriptors of one layer's batched read (``planning``) and the plans of a step moved to
each layer's addresses (``step_plans``), which blocks of a request a chunked-prefill step
makes ready (``chunking``). Both sides use these; they import only ``rd2h.errors`` and each
other: no runtime, no wire codec, no framework, thread, socket or clock. Layouts of torch
tensors and numpy arrays (which may touch torch) are built in :mod:`rd2h.tensors`.
"""
