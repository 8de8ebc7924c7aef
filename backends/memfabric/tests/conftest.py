"""memfabric needs its Ascend environment from process start (LD_PRELOAD, library path).

Where this pytest process has it (a real Ascend host, or the CPU kit's env.sh sourced before
pytest), the tests in ``inkit/`` run here directly. Everywhere else they are left out of this
process and ``test_memfabric_kit.py`` runs them in a child pytest started with the CPU test
kit's environment (tests/kit/memfabric-cpu), in a network namespace of its own (memfabric binds
127.0.0.1:11000 for every Prefill engine: no other run on the host can take it from this one),
so a plain ``pytest`` still runs every one.
"""

from __future__ import annotations

from rd2h_memfabric import MemFabricEngine

IN_KIT = MemFabricEngine.availability().ok
collect_ignore = ["test_memfabric_kit.py"] if IN_KIT else ["inkit"]
