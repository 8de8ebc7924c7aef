"""A self-pipe that wakes a thread blocked in ``poll``/``epoll``/``select``.

A channel's ``recv`` waits on its sockets' fds and on :attr:`WakePipe.fd`. Another thread
makes it look again with :meth:`~WakePipe.kick` (a socket came or went, or a message may be
waiting that the poll set cannot show), or asks it to return with :meth:`~WakePipe.wake`
(``Dialer.wakeup``); the waiting thread calls :meth:`~WakePipe.drain` when the fd is
readable, which says whether a ``wake`` came. Both ends are non-blocking: a kick into a full
pipe is dropped (one is pending already), so a kick never blocks.

Threads: ``kick`` and ``wake`` from any thread; ``drain`` from the waiting thread; ``close``
once no other thread uses the pipe (the fd numbers may then belong to another file, so a
kick after ``close`` does nothing).
"""

from __future__ import annotations

import os

__all__ = ["WakePipe"]


class WakePipe:
    """The read end (``fd``) to poll for reading, and the calls that make it readable."""

    __slots__ = ("fd", "_write_fd", "_woken", "_closed")

    def __init__(self) -> None:
        self.fd, self._write_fd = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._write_fd, False)
        self._woken = False
        self._closed = False

    def kick(self) -> None:
        """Make the waiting poll return (its thread looks again). Never blocks or raises."""
        if self._closed:
            return
        try:
            os.write(self._write_fd, b"\0")
        except OSError:  # full (a kick is pending) or closed
            pass

    def wake(self) -> None:
        """Kick, and have the next ``drain`` say so: the waiting ``recv`` is to return."""
        self._woken = True
        self.kick()

    def drain(self) -> bool:
        """Empty the pipe; True if ``wake`` was called since the last drain that said so."""
        try:
            while os.read(self.fd, 4096):
                pass
        except OSError:  # empty (BlockingIOError) or closed
            pass
        woken, self._woken = self._woken, False
        return woken

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Close both ends (once; later calls do nothing)."""
        if self._closed:
            return
        self._closed = True
        os.close(self.fd)
        os.close(self._write_fd)
