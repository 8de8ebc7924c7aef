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

A Decode proves many Prefills at once, some of which may never answer (a busy interpreter,
or a hostile local process whose socket accepts and stays silent). :class:`ProofLoad` keeps
that from queueing anyone behind strangers: one process may have only a few proofs waiting
(more are refused at once), the proofs waiting in all are bounded, and a new one cuts the
oldest short instead of waiting for it, so a Prefill that answers is proven within its own
answer time. The reply itself is bounded (``MAX_REPLY_BYTES``, ``MAX_REGIONS``): a proof
costs Decode a few MiB at most, whatever the peer sends.
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

__all__ = ["PTRACER_MODES", "TOKEN_BYTES", "Witness", "Proof", "ProofLoad", "verify"]

PTRACER_MODES = ("peer", "any", "none")
_MAGIC = b"rd2h-local-proof"
_VERSION = 1
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_LENGTH = struct.Struct(">I")
# The regions of one process: a real registration is a few hundred regions (vLLM: a
# tensor or two per layer), ~11 bytes each; 16 MiB cost Decode +565 MB and 6 s to decode.
MAX_REPLY_BYTES = 1 << 20
MAX_REGIONS = 1 << 16
# Proofs one Decode engine waits on at once: a new one past this cuts the oldest short.
MAX_WAITING = 32
# Of those, from one process (the pid the kernel names): more are refused at once. A real
# Prefill process has one witness per engine, and a proof takes milliseconds.
MAX_WAITING_PER_PROCESS = 4
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


class _Waiting:
    __slots__ = ("sock", "pid", "started", "cut_by")

    def __init__(self, sock: socket.socket, pid: int) -> None:
        self.sock, self.pid, self.started, self.cut_by = sock, pid, time.monotonic(), 0


class ProofLoad:
    """The proofs one reading engine waits on, for fairness between the processes proving.

    ``enter`` is called once the kernel named the process at the other end of a proof
    socket: it refuses a process that already has ``max_per_process`` proofs waiting and,
    with ``max_waiting`` proofs waiting in all, cuts the oldest short (shuts its socket, so
    the reader blocked on it fails at once) to make room. Thread-safe; holds no thread.
    """

    def __init__(self, max_waiting: int = MAX_WAITING, max_per_process: int = MAX_WAITING_PER_PROCESS) -> None:
        if max_waiting < 1 or max_per_process < 1:
            raise ConfigError("proof limits must be positive")
        self.max_waiting, self.max_per_process = max_waiting, max_per_process
        self._lock = threading.Lock()
        self._waiting: dict[int, _Waiting] = {}  # id -> entry; insertion order is age
        self.refused = 0  # proofs refused for their process's count
        self.cut = 0  # proofs cut short to make room

    def __len__(self) -> int:
        return len(self._waiting)

    def enter(self, sock: socket.socket, pid: int) -> _Waiting:
        """Start waiting on ``sock`` (connected to process ``pid``). TransferError when that
        process has its share waiting already."""
        with self._lock:
            mine = sum(1 for w in self._waiting.values() if w.pid == pid)
            if mine >= self.max_per_process:
                self.refused += 1
                raise TransferError(
                    f"process {pid} already has {mine} proofs waiting on this Decode (at most "
                    f"{self.max_per_process} per process): refused until one ends"
                )
            while len(self._waiting) >= self.max_waiting:
                oldest = self._waiting.pop(next(iter(self._waiting)))
                oldest.cut_by = len(self._waiting) + 1
                self.cut += 1
                try:
                    oldest.sock.shutdown(socket.SHUT_RDWR)  # its reader's recv returns at once
                except OSError:
                    pass
            waiting = _Waiting(sock, pid)
            self._waiting[id(waiting)] = waiting
            return waiting

    def leave(self, waiting: _Waiting) -> None:
        """The proof ended (before its socket is closed: ``enter`` may shut it until then)."""
        with self._lock:
            self._waiting.pop(id(waiting), None)


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


def _regions_of(reply: object, pid: int) -> Regions:
    if not (isinstance(reply, list) and len(reply) >= 4 and reply[0] == _MAGIC and reply[1] == _VERSION):
        raise TransferError("the Prefill's proof reply is malformed")
    refusal, regions = reply[2], reply[3]
    if refusal is not None:
        raise TransferError(f"the Prefill (process {pid}) refused this reader: {str(refusal)[:300]}")
    if not isinstance(regions, list) or not all(
        isinstance(r, list) and len(r) == 2 and all(type(v) is int and v >= 0 for v in r) for r in regions
    ):
        raise TransferError("the Prefill's proof reply carries malformed regions")
    return [(a, n) for a, n in regions]


def verify(name: str, token: bytes, pid: int, deadline: float, load: ProofLoad | None = None) -> Proof:
    """Connect to the proof socket ``name``, check that process ``pid`` listens there, and
    present ``token`` (from the metadata) for its registered regions. ``load``: the proofs
    this engine waits on (see :class:`ProofLoad`), None for no limits.

    Raises ``TransferError`` when nothing listens there (or its queue of connections is
    full), another process does, the Prefill refuses (with its reason), answers more than
    ``MAX_REPLY_BYTES`` or ``MAX_REGIONS``, does not answer by ``deadline``, or its proof
    was refused or cut short by ``load``.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    waiting: _Waiting | None = None
    try:
        sock.setblocking(False)  # a Unix socket connects at once or says its queue is full
        try:
            sock.connect(b"\0" + name.encode())
        except BlockingIOError:
            raise TransferError(
                f"the proof socket {name!r} of process {pid} has a full queue of connections: refused"
            ) from None
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
        if load is not None:
            waiting = load.enter(sock, pid)
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        try:
            sock.sendall(token)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused at once (too many readers): its reason is waiting to be read
        (size,) = _LENGTH.unpack(_recv_exact(sock, _LENGTH.size, deadline))
        if size > MAX_REPLY_BYTES:
            raise TransferError(
                f"the Prefill's proof reply of {size} bytes is above {MAX_REPLY_BYTES}: refused unread"
            )
        try:
            reply = msgpack.unpackb(
                _recv_exact(sock, size, deadline), raw=False, use_list=True, max_array_len=MAX_REGIONS,
                max_map_len=0, max_ext_len=0, max_str_len=size, max_bin_len=size,
            )  # fmt: skip
        except (ValueError, msgpack.UnpackException):  # garbage raises several types
            raise TransferError(f"the Prefill's proof reply is not msgpack of at most {MAX_REGIONS} regions") from None
        regions = _regions_of(reply, pid)
    except BaseException as exc:
        if load is not None and waiting is not None:
            load.leave(waiting)  # before the close: until then ``enter`` may shut the socket
        sock.close()
        if waiting is not None and waiting.cut_by and isinstance(exc, (OSError, TransferError)):
            raise TransferError(
                f"the proof of process {pid} was cut short after {time.monotonic() - waiting.started:.1f} s: "
                f"{waiting.cut_by} newer proofs were waiting on this Decode (at most {load.max_waiting if load else MAX_WAITING})"
            ) from None
        if isinstance(exc, TimeoutError):
            raise TransferError(f"the Prefill (process {pid}) did not answer its proof socket in time") from None
        if isinstance(exc, OSError):
            raise TransferError(f"proof of process {pid} failed: {exc}") from None
        raise
    if load is not None and waiting is not None:
        load.leave(waiting)
    return Proof(sock, regions)
