"""The shared transfer-engine conformance suite, run against the local engine."""

import dataclasses

import pytest

from rd2h.interfaces import Region
from rd2h.testing import EngineConformance
from rd2h_local import _metadata, _sys


@pytest.mark.filterwarnings("error::UserWarning")  # the local engine meets the suite's preferences too
class TestLocalEngineConformance(EngineConformance):
    engine_name = "local"
    engine_options = {"threads": 2, "parallel_threshold_bytes": 1 << 20}
    skip_if_unavailable = False  # every test must run here: Linux is all it needs
    failure_bound_s = 5.0

    @classmethod
    def forged_metadata(cls, genuine: bytes, other_pid: int) -> dict[str, bytes]:
        info = _metadata.decode(genuine)
        first = info.regions[0]
        forge = lambda **kw: _metadata.encode(dataclasses.replace(info, **kw))  # noqa: E731
        return {
            "another process's pid": forge(pid=other_pid, start_time=_sys.start_time(other_pid)),
            "memory the peer did not register": forge(regions=(Region(first.addr - 4096, first.length + 4096),)),
            "no proof socket": forge(proof_socket=""),
            "a proof socket nobody listens on": forge(proof_socket="rd2h-local.nobody-here"),
            "the right socket without its token": forge(proof_token=bytes(16)),
        }
