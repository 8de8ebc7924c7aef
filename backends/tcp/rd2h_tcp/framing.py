"""The wire of the tcp channel: a greeting, then length-prefixed frames. Pure: bytes in, frames out.

A connection starts with a greeting each way: the dialer sends ``MAGIC`` and its 16-byte
identity (fixed for the dialer's life, so a reconnect is the same peer to Decode, as a zmq
routing id is); the listener sends ``MAGIC``. Then each frame is a 4-byte big-endian length
and that many bytes of payload, never empty and never above ``max_frame_bytes``. Anything
else (another protocol, a zmq peer, a length over the bound) ends the connection: the reader
reports it and the socket code closes it; nothing a peer sends raises.
"""

from __future__ import annotations

import struct

from rd2h.errors import FrameTooLargeError

__all__ = ["MAGIC", "IDENTITY_BYTES", "HEADER", "encode", "FrameReader"]

MAGIC = b"RD2HTCP1"  # the protocol and its version: a zmq or HTTP peer is told apart at once
IDENTITY_BYTES = 16
HEADER = struct.Struct("!I")
_HEADER_BYTES = HEADER.size
_unpack = HEADER.unpack_from
_pack = HEADER.pack


def encode(payload: bytes, limit: int) -> bytes:
    """``payload`` with its length prefix. Raises ``FrameTooLargeError`` above ``limit`` and
    ``ValueError`` for an empty one (the zmq channel refuses it too)."""
    size = len(payload)
    if size > limit:
        raise FrameTooLargeError(f"frame of {size} bytes is above max_frame_bytes={limit}")
    if size == 0:
        raise ValueError("payload must not be empty")
    return _pack(size) + payload


class FrameReader:
    """Frames out of the byte stream of one connection.

    ``greeting`` is how many bytes the peer's greeting has (``MAGIC`` plus, from a dialer, its
    identity). ``feed(data)`` returns the frames completed by ``data``; once the greeting is
    in, ``identity`` holds what followed ``MAGIC``. When the stream is not ours, ``error``
    says why, ``feed`` returns the frames before the fault and the connection must be closed.
    """

    __slots__ = ("_limit", "_greeting", "_buf", "_need", "identity", "error")

    def __init__(self, limit: int, greeting: int) -> None:
        self._limit = limit
        self._greeting = greeting
        # the tail of the stream not yet parsed; appended to (amortised O(1) a byte), parsed
        # again only once ``_need`` bytes are in, so a 16 MiB frame in 64 KiB reads is not quadratic
        self._buf = bytearray()
        self._need = greeting
        self.identity: bytes | None = None
        self.error: str | None = None

    @property
    def buffered(self) -> int:
        """Bytes held of a frame not yet complete."""
        return len(self._buf)

    def feed(self, data: bytes) -> list[bytes]:
        if self.error is not None:
            return []
        if self._buf:
            self._buf += data
            if len(self._buf) < self._need:
                return []
            buf: bytes = bytes(self._buf)
            self._buf = bytearray()
        else:
            buf = data
        start = 0
        end = len(buf)
        if self.identity is None:
            head = buf[: len(MAGIC)]
            if not MAGIC.startswith(head):
                return self._fail(head)
            if end < self._greeting:
                self._keep(buf, 0, self._greeting)
                return []
            self.identity = bytes(buf[len(MAGIC): self._greeting])
            start = self._greeting
        frames: list[bytes] = []
        while end - start >= _HEADER_BYTES:
            (size,) = _unpack(buf, start)
            if size == 0 or size > self._limit:
                self.error = (
                    "an empty frame" if size == 0 else f"a frame of {size} bytes, above max_frame_bytes={self._limit}"
                )
                return frames
            stop = start + _HEADER_BYTES + size
            if stop > end:
                self._keep(buf, start, stop)
                return frames
            frames.append(buf[start + _HEADER_BYTES: stop])
            start = stop
        if start < end:
            self._keep(buf, start, start + _HEADER_BYTES)
        return frames

    def _keep(self, buf: bytes, start: int, stop: int) -> None:
        self._buf = bytearray(buf[start:])
        self._need = stop - start

    def _fail(self, head: bytes) -> list[bytes]:
        self.error = f"not an rd2h tcp peer (it began with {bytes(head)!r}, not {MAGIC!r})"
        return []
