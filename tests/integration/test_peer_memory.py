"""The conformance suite's peer with its regions in torch tensors (``--memory``), as its
device cases start it on a GPU: on this CPU machine the same path runs with ``cpu`` tensors,
whose memory kind is host, and the local engine reads every pattern byte from them."""

from __future__ import annotations

import numpy as np

from rd2h import plugins
from rd2h.interfaces import Region
from rd2h.testing.peer import PeerProcess


def test_a_peer_whose_regions_are_torch_tensors_serves_its_patterns() -> None:
    sizes = (1 << 20, 64 << 10)
    with plugins.load_engine("local", "decode") as engine, PeerProcess("local", sizes=sizes, seed=4, memory="cpu") as peer:
        dest = np.zeros(sum(sizes), np.uint8)
        engine.register([Region(dest.ctypes.data, dest.nbytes)])
        session = engine.connect(peer.metadata)
        local = np.array([dest.ctypes.data, dest.ctypes.data + sizes[0]], np.int64)
        remote = np.array([a for a, _ in peer.regions], np.int64)
        engine.read_batch(session, local, remote, np.array(sizes, np.int64))
        assert np.array_equal(dest[: sizes[0]], peer.expected(0))
        assert np.array_equal(dest[sizes[0] :], peer.expected(1))
