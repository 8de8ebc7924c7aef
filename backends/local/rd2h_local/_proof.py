"""Proof that metadata comes from the process it names, and ptrace for that reader only.

The registration blob names a pid and regions; a blob is just bytes any peer can write. So the
Prefill engine listens on a Unix socket in the abstract namespace, named in its blob, and:

- a reader (Decode) that connects learns from the kernel (``SO_PEERCRED``) which pid listens
  there, refuses the blob unless it is the pid the blob names, presents the token the blob
  carries, and takes the regions that process registered from the socket, not from the blob;
- the Prefill answers only a reader with that token (the blob goes only to the Decode
  endpoints it dials; the socket's name is visible to anyone in /proc/net/unix), learns the
  reader's pid from the kernel too and, where Yama's ``ptrace_scope`` is 1, lets that pid
  alone read it (``PR_SET_PTRACER``). Yama keeps one such pid per process, so a second
  reading process is refused while the first is connected, with the reason.

The reader keeps its connection for the session's life: its end tells the Prefill to revoke.
Every call here is bounded: the reader by its deadline, the witness by a short send timeout
and a poll that wakes at least once a second.
"""

from __future__ import annotations

import hmac
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

__all__ = ["PTRACER_MODES", "TOKEN_BYTES", "Witness", "Proof", "verify"]

PTRACER_MODES = ("peer", "any", "none")
_MAGIC = b"rd2h-local-proof"
_VERSION = 1
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_LENGTH = struct.Struct(">I")
_MAX_REPLY = 16 << 20  # the regions of one process; far above any real registration
_SEND_TIMEOUT = 1.0  # a reader that does not take a few KiB in this long is dropped
# A connection that has not sent its token in this long is dropped. Generous: the reader
# sends it right after connecting, but a starved Decode (a loaded 2-core host, a vLLM engine
# computing beside it) was seen to stall 12 s between the two; an idle connection costs one
# fd of at most MAX_READERS until then.
_TOKEN_WAIT = 30.0
TOKEN_BYTES = 16
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


class _Conn:
    """One connection to the witness: first a reader that owes its token, then a reader."""

    __slots__ = ("sock", "got", "deadline", "answered")

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock, self.got, self.deadline, self.answered = sock, b"", deadline, False


class Witness:
    """The Prefill end: answers a reader that presents its token with this process's
    registered regions, and grants it ptrace where Yama asks.

    The token travels in the metadata, which only the Decode endpoints this Prefill dials
    receive; the socket name alone (visible in /proc/net/unix) earns nothing. ``regions``
    is called on the witness thread. The thread starts here; ``close`` stops and joins it.
    """

    def __init__(self, regions: Callable[[], Regions], ptracer: str = "peer", max_readers: int = MAX_READERS) -> None:
        self._ptrace = _Ptrace(ptracer)
        self._regions = regions
        self._max_readers = max_readers
        self.name = "rd2h-local." + secrets.token_hex(12)
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            self._listener.bind(b"\0" + self.name.encode())
            self._listener.listen(64)
            self._listener.setblocking(False)
        except OSError as exc:
            self._listener.close()
            raise TransferError(f"the local engine cannot listen on its proof socket: {exc}") from exc
        self._wake_r, self._wake_w = os.pipe()
        self._conns: dict[int, _Conn] = {}  # fd -> connection, witness thread only
        self._poller = select.poll()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="rd2h-witness", daemon=True)
        self._thread.start()

    @property
    def readers(self) -> int:
        return len(self._conns)

    def close(self) -> None:
        """Stop the thread, close every connection (revoking ptrace). Idempotent."""
        if self._stop:
            return
        self._stop = True
        os.write(self._wake_w, b"\0")
        self._thread.join(5.0)
        for conn in list(self._conns.values()):
            self._drop(conn)
        self._listener.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _run(self) -> None:
        self._poller.register(self._listener, select.POLLIN)
        self._poller.register(self._wake_r, select.POLLIN)
        while not self._stop:
            for fd, _events in self._poller.poll(1000):
                if fd == self._listener.fileno():
                    self._accept()
                elif fd in self._conns:
                    self._readable(self._conns[fd])
            now = time.monotonic()
            for conn in [c for c in self._conns.values() if not c.answered and now > c.deadline]:
                self._drop(conn)  # connected and never sent its token

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except OSError:  # nothing to accept after all, or out of fds: the reader sees it
            return
        if len(self._conns) >= self._max_readers:
            self._reply(sock, f"this Prefill already serves {self._max_readers} reader connections", [])
            sock.close()
            return
        sock.setblocking(False)
        conn = _Conn(sock, time.monotonic() + _TOKEN_WAIT)
        self._conns[sock.fileno()] = conn
        self._poller.register(sock, select.POLLIN)

    def _readable(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(TOKEN_BYTES - len(conn.got)) if not conn.answered else conn.sock.recv(1)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if conn.answered or not data:  # a reader never writes after its token: this is its end
            self._drop(conn)
            return
        conn.got += data
        if len(conn.got) < TOKEN_BYTES:
            return
        refusal = None
        if not hmac.compare_digest(conn.got, self.token):
            refusal = "wrong token: a reader must present the token of this Prefill's metadata"
        else:
            try:
                refusal = self._ptrace.grant(conn.sock, _peer_pid(conn.sock))
            except OSError as exc:
                refusal = f"cannot tell who is reading: {exc}"
        if not self._reply(conn.sock, refusal, [] if refusal else self._regions()) or refusal:
            self._drop(conn)
            return
        conn.answered = True

    @staticmethod
    def _reply(sock: socket.socket, refusal: str | None, regions: Regions) -> bool:
        body = msgpack.packb((_MAGIC, _VERSION, refusal, regions), use_bin_type=True)
        try:
            sock.settimeout(_SEND_TIMEOUT)
            sock.sendall(_LENGTH.pack(len(body)) + body)
            sock.setblocking(False)
        except OSError:
            return False
        return True

    def _drop(self, conn: _Conn) -> None:
        fd = conn.sock.fileno()
        if self._conns.pop(fd, None) is not None:
            try:
                self._poller.unregister(fd)
            except KeyError:
                pass
        self._ptrace.release(conn.sock)
        conn.sock.close()


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


def verify(name: str, token: bytes, pid: int, deadline: float) -> Proof:
    """Connect to the proof socket ``name``, check that process ``pid`` listens there, and
    present ``token`` (from the metadata) for its registered regions.

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
        try:
            sock.sendall(token)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused at once (too many readers): its reason is waiting to be read
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
