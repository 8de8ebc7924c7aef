"""Proof that metadata comes from the process it names, and ptrace for that reader only.

The registration blob names a pid and regions; a blob is just bytes any peer can write. So the
Prefill engine listens on a Unix socket in the abstract namespace, named in its blob, and:

- a reader (Decode) that connects learns from the kernel (``SO_PEERCRED``) which pid listens
  there, refuses the blob unless it is the pid the blob names, and takes the regions that
  process registered from the socket, not from the blob;
- the Prefill learns the reader's pid the same way and, where Yama's ``ptrace_scope`` is 1,
  lets that pid alone read it (``PR_SET_PTRACER``). Yama keeps one such pid per process, so a
  second reading process is refused while the first is connected, with the reason.

The reader keeps its connection for the session's life: its end tells the Prefill to revoke.
Every call here is bounded: the reader by its deadline, the witness by a short send timeout
and a poll that wakes at least once a second.
"""

from __future__ import annotations

import os
import secrets
import select
import socket
import struct
import threading
import time
from collections.abc import Callable

import msgpack

from rd2h.errors import ConfigError, TransferError
from rd2h_local import _sys

__all__ = ["PTRACER_MODES", "Witness", "Proof", "verify"]

PTRACER_MODES = ("peer", "any", "none")
_MAGIC = b"rd2h-local-proof"
_VERSION = 1
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_LENGTH = struct.Struct(">I")
_MAX_REPLY = 16 << 20  # the regions of one process; far above any real registration
_SEND_TIMEOUT = 1.0  # a reader that does not take a few KiB in this long is dropped
MAX_READERS = 256  # connections one Prefill keeps; more are refused (each holds an fd)

Regions = list[tuple[int, int]]


def _peer_pid(sock: socket.socket) -> int:
    pid, _uid, _gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return pid


class _Ptrace:
    """Who may read this process where Yama restricts ptrace (scope 1)."""

    def __init__(self, mode: str) -> None:
        if mode not in PTRACER_MODES:
            raise ConfigError(f"ptracer must be one of {PTRACER_MODES}, got {mode!r}")
        self.mode = mode
        self.yama = _sys.ptrace_scope() == 1 and mode != "none"
        self.holder: socket.socket | None = None  # the connection whose pid holds the grant
        self.holder_pid = 0
        if self.yama and mode == "any":  # the explicit opt-in: every same-user process
            _sys.set_ptracer(_sys.PTRACER_ANY)

    def grant(self, conn: socket.socket, pid: int) -> str | None:
        """Allow ``pid`` to read us; the reason it cannot be, or None."""
        if not self.yama or self.mode == "any":
            return None
        if self.holder is not None and self.holder_pid != pid:
            return (
                f"Yama (kernel.yama.ptrace_scope=1) lets one process read this Prefill and process "
                f"{self.holder_pid} does; start the local engine with ptracer='any' to let every "
                "same-user process read it, or give the Decode process CAP_SYS_PTRACE and ptracer='none'"
            )
        if not _sys.set_ptracer(pid):
            return f"prctl(PR_SET_PTRACER, {pid}) failed"
        if self.holder is None:
            self.holder, self.holder_pid = conn, pid
        return None

    def release(self, conn: socket.socket) -> None:
        if conn is self.holder:
            self.holder, self.holder_pid = None, 0
            _sys.set_ptracer(0)  # 0 clears the exception


class Witness:
    """The Prefill end: answers every reader with its pid's registered regions.

    ``regions`` is called on the witness thread for the current registration. The thread
    starts here and is stopped and joined by ``close``.
    """

    def __init__(self, regions: Callable[[], Regions], ptracer: str = "peer", max_readers: int = MAX_READERS) -> None:
        self._ptrace = _Ptrace(ptracer)
        self._regions = regions
        self._max_readers = max_readers
        self.name = "rd2h-local." + secrets.token_hex(12)  # random: names are visible in /proc/net/unix
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            self._listener.bind(b"\0" + self.name.encode())
            self._listener.listen(64)
            self._listener.setblocking(False)
        except OSError as exc:
            self._listener.close()
            raise TransferError(f"the local engine cannot listen on its proof socket: {exc}") from exc
        self._wake_r, self._wake_w = os.pipe()
        self._readers: dict[int, socket.socket] = {}  # fd -> connection, witness thread only
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="rd2h-witness", daemon=True)
        self._thread.start()

    @property
    def readers(self) -> int:
        return len(self._readers)

    def close(self) -> None:
        """Stop the thread, close every connection (revoking ptrace). Idempotent."""
        if self._stop:
            return
        self._stop = True
        os.write(self._wake_w, b"\0")
        self._thread.join(5.0)
        for conn in list(self._readers.values()):
            self._drop(conn)
        self._listener.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self._listener, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        while not self._stop:
            for fd, _events in poller.poll(1000):
                if fd == self._listener.fileno():
                    conn = self._accept()
                    if conn is not None:
                        poller.register(conn, select.POLLIN)
                elif fd in self._readers:  # a reader never writes: this is its end (or junk)
                    poller.unregister(fd)
                    self._drop(self._readers[fd])

    def _accept(self) -> socket.socket | None:
        try:
            conn, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return None
        except OSError:  # out of fds: the reader sees its connection refused or closed
            return None
        try:
            pid = _peer_pid(conn)
            refusal = None
            if len(self._readers) >= self._max_readers:
                refusal = f"this Prefill already serves {self._max_readers} reader connections"
            else:
                refusal = self._ptrace.grant(conn, pid)
            regions = [] if refusal else self._regions()
            body = msgpack.packb((_MAGIC, _VERSION, refusal, regions), use_bin_type=True)
            conn.settimeout(_SEND_TIMEOUT)
            conn.sendall(_LENGTH.pack(len(body)) + body)
        except OSError:
            self._ptrace.release(conn)
            conn.close()
            return None
        if refusal is not None:
            conn.close()
            return None
        conn.setblocking(False)
        self._readers[conn.fileno()] = conn
        return conn

    def _drop(self, conn: socket.socket) -> None:
        self._readers.pop(conn.fileno(), None)
        self._ptrace.release(conn)
        conn.close()


class Proof:
    """The reader's end: the proven regions, and the connection held for the session."""

    def __init__(self, sock: socket.socket, regions: Regions) -> None:
        self.sock = sock
        self.regions = regions

    def close(self) -> None:
        self.sock.close()


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    chunks, left = [], n
    while left:
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise TransferError("the Prefill closed its proof socket before answering")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def verify(name: str, pid: int, deadline: float) -> Proof:
    """Connect to the proof socket ``name`` and check that process ``pid`` listens there.

    Raises ``TransferError`` when nothing listens there, another process does, the Prefill
    refuses (with its reason) or does not answer by ``deadline``.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        try:
            sock.connect(b"\0" + name.encode())
        except OSError as exc:
            raise TransferError(
                f"nothing answers on the proof socket {name!r} the metadata names ({exc.strerror}): "
                f"it does not come from a running rd2h-local Prefill (process {pid})"
            ) from None
        owner = _peer_pid(sock)
        if owner != pid:
            raise TransferError(
                f"the metadata names process {pid}, but process {owner} answers its proof socket: "
                "refused (a peer may name only its own memory)"
            )
        (size,) = _LENGTH.unpack(_recv_exact(sock, _LENGTH.size, deadline))
        if size > _MAX_REPLY:
            raise TransferError(f"the Prefill's proof reply of {size} bytes is too big")
        try:
            reply = msgpack.unpackb(_recv_exact(sock, size, deadline), raw=False, use_list=True)
        except (ValueError, msgpack.UnpackException):  # garbage raises several types
            raise TransferError("the Prefill's proof reply is not msgpack") from None
        if not (isinstance(reply, list) and len(reply) >= 4 and reply[0] == _MAGIC and reply[1] == _VERSION):
            raise TransferError("the Prefill's proof reply is malformed")
        refusal, regions = reply[2], reply[3]
        if refusal is not None:
            raise TransferError(f"the Prefill (process {pid}) refused this reader: {str(refusal)[:300]}")
        if not isinstance(regions, list) or not all(
            isinstance(r, list) and len(r) == 2 and all(type(v) is int and v >= 0 for v in r) for r in regions
        ):
            raise TransferError("the Prefill's proof reply carries malformed regions")
        return Proof(sock, [(a, n) for a, n in regions])
    except TimeoutError:
        sock.close()
        raise TransferError(f"the Prefill (process {pid}) did not answer its proof socket in time") from None
    except OSError as exc:
        sock.close()
        raise TransferError(f"proof of process {pid} failed: {exc}") from None
    except BaseException:
        sock.close()
        raise
