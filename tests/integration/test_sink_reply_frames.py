"""READ_DONE frames are encoded once per layer index and reused; the cache is bounded, since
the layer index is the peer's to choose."""

from __future__ import annotations

from layers import layer_tensors

from rd2h.api import KVSink
from rd2h.wire import protocol


def test_read_done_frames_are_the_codecs_and_bounded(kv_port: int) -> None:
    with KVSink({"l0": layer_tensors(False)}, kv_port=kv_port) as sink:
        reader = sink._reader
        assert reader._done(7) == protocol.encode(protocol.ReadDone(7))
        assert reader._done(7) is reader._done(7)  # encoded once
        for idx in range(40_000):
            reader._done(idx)
        assert len(reader._done_frames) <= 1 << 14
        assert protocol.decode_reply(reader._done(2**40)) == protocol.ReadDone(2**40)
