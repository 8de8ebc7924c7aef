"""Host staging: device KV moved by engines that read and write host memory only.

Prefill copies the ready blocks of each layer device-to-host into a registered host mirror
(:mod:`~rd2h.staging.prefill_mirror`) and announces the mirror; Decode reads device-bound
blocks into a host landing buffer and copies them host-to-device
(:mod:`~rd2h.staging.decode_landing`). The copies go through one stream/event adapter
(:mod:`rd2h.device`): CUDA, Ascend, or a host stand-in that CI runs.
"""
