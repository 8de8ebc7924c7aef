"""Issue 9, trust model: the local engine believes a peer's pid and regions only once the
process at the other end of its proof socket proves them, and a Prefill lets only the
reader that proved itself ptrace it under Yama.

The attacks were run against 87b7601 (``git worktree add /tmp/old 87b7601``): there
``connect`` accepted metadata naming any pid and any regions, so a local process made
Decode copy a non-Prefill process's memory, or Decode's own, into a request's cache; the
forgery tests below connect and read there, and fail.
"""

from __future__ import annotations

import base64
import dataclasses
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from rd2h_local import LocalEngine, _metadata, _proof, _sys

from rd2h.errors import TransferError
from rd2h.interfaces import Region
from rd2h.testing.channel_suite import until
from rd2h.testing.peer import PeerProcess

I64 = np.int64

# A reader in a process of its own: connects with the metadata in argv, says "ok" (or the
# error), and holds its session until stdin closes.
_READER = """
import base64, sys
from rd2h_local import LocalEngine
engine = LocalEngine("decode")
try:
    session = engine.connect(base64.b64decode(sys.argv[1]))
except Exception as exc:
    print("refused", exc, flush=True)
else:
    print("ok", flush=True)
sys.stdin.read()
engine.close()
"""


@pytest.fixture
def peer():
    with PeerProcess("local", sizes=[1 << 20], seed=3) as p:
        yield p


@pytest.fixture
def decode():
    engine = LocalEngine("decode", threads=1)
    dst = np.zeros(1 << 20, dtype=np.uint8)
    engine.register([Region(dst.ctypes.data, dst.nbytes)])
    yield engine, dst
    engine.close()


def _forge(blob: bytes, **changes: object) -> bytes:
    return _metadata.encode(dataclasses.replace(_metadata.decode(blob), **changes))


def test_metadata_naming_decodes_own_process_is_refused(peer, decode):
    """The copy-Decode's-own-memory attack: a peer names the Decode process and its memory."""
    engine, dst = decode
    secret = np.full(4096, 0x77, dtype=np.uint8)
    forged = _forge(
        peer.metadata, pid=os.getpid(), start_time=_sys.start_time(os.getpid()),
        regions=(Region(secret.ctypes.data, secret.nbytes),),
    )  # fmt: skip
    with pytest.raises(TransferError, match="answers its proof socket"):
        session = engine.connect(forged)
        # 87b7601 gets here: the read copies Decode's own memory into a destination
        engine.read_batch(session, np.array([dst.ctypes.data], I64), np.array([secret.ctypes.data], I64), np.array([4096], I64))
    assert not dst.any()


def test_metadata_naming_a_non_prefill_process_is_refused(peer, decode):
    """A process that runs no rd2h engine (here a plain child) cannot be named."""
    engine, _ = decode
    bystander = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        forged = _forge(peer.metadata, pid=bystander.pid, start_time=_sys.start_time(bystander.pid))
        with pytest.raises(TransferError, match="answers its proof socket"):
            engine.connect(forged).close()
    finally:
        bystander.stdin.close()
        bystander.wait(10)


def test_regions_beyond_the_registration_are_refused(peer, decode):
    engine, _ = decode
    addr, length = peer.regions[0]
    for regions in ((Region(addr - 4096, length + 4096),), (Region(addr, length), Region(addr + length, 4096))):
        with pytest.raises(TransferError, match="did not register"):
            engine.connect(_forge(peer.metadata, regions=regions)).close()
    engine.connect(_forge(peer.metadata, regions=(Region(addr + 4096, 4096),))).close()  # a subset is fine


def test_a_proof_socket_of_nobody_or_none_is_refused(peer, decode):
    engine, _ = decode
    with pytest.raises(TransferError, match="nothing answers"):
        engine.connect(_forge(peer.metadata, proof_socket="rd2h-local.nobody"))
    with pytest.raises(TransferError, match="names no proof socket"):
        engine.connect(_forge(peer.metadata, proof_socket=""))


def test_a_silent_proof_socket_times_out(decode):
    """Every call is bounded: a socket that accepts and never answers fails the connect."""
    import socket

    engine, _ = decode
    engine.timeout = 0.3
    name = "rd2h-local.silent-" + os.urandom(4).hex()
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.bind(b"\0" + name.encode())
    silent.listen(1)
    try:
        blob = _metadata.encode(_metadata.PeerInfo(
            _sys.boot_id(), _sys.hostname(), _sys.pid_namespace(), os.getpid(), _sys.start_time(os.getpid()),
            (Region(4096, 4096),), name,
        ))  # fmt: skip
        with pytest.raises(TransferError, match="did not answer"):
            engine.connect(blob)
    finally:
        silent.close()


class _Grants:
    """Yama at scope 1, with prctl recorded instead of made."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[int] = []
        self.changed = threading.Condition()
        monkeypatch.setattr(_sys, "ptrace_scope", lambda: 1)
        monkeypatch.setattr(_sys, "set_ptracer", self._record)

    def _record(self, pid: int) -> bool:
        with self.changed:
            self.calls.append(pid)
            self.changed.notify_all()
        return True

    def wait_for(self, calls: list[int]) -> None:
        with self.changed:
            assert self.changed.wait_for(lambda: self.calls == calls, timeout=10), self.calls


def _reader(blob: bytes) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _READER, base64.b64encode(blob).decode()],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def test_prefill_grants_ptrace_to_the_proven_reader_only(monkeypatch):
    """Under Yama scope 1 the Prefill grants PR_SET_PTRACER to the pid that proved itself on
    its socket (never PR_SET_PTRACER_ANY), refuses a second reading process while the first
    holds the grant (Yama keeps one), and revokes when the reader's session ends."""
    grants = _Grants(monkeypatch)
    src = np.ones(1 << 16, dtype=np.uint8)
    with LocalEngine("prefill") as prefill:
        blob = prefill.register([Region(src.ctypes.data, src.nbytes)])
        assert grants.calls == []
        first, said = _reader(blob)
        try:
            assert said == "ok"
            grants.wait_for([first.pid])
            with LocalEngine("decode") as second, pytest.raises(TransferError, match="one process read this Prefill"):
                second.connect(blob)
        finally:
            first.communicate("", timeout=10)
        grants.wait_for([first.pid, 0])  # the reader left: the grant is revoked
        with LocalEngine("decode") as second:
            second.connect(blob).close()
        grants.wait_for([first.pid, 0, os.getpid(), 0])
    assert _sys.PTRACER_ANY not in grants.calls


def test_witness_caps_its_readers(monkeypatch):
    """Connections a Prefill keeps for its readers are bounded: past the cap, refused."""
    from rd2h_local import _proof

    src = np.ones(4096, dtype=np.uint8)
    witness = _proof.Witness(lambda: [(src.ctypes.data, src.nbytes)], max_readers=2)

    try:
        proofs = [_proof.verify(witness.name, witness.token, os.getpid(), time.monotonic() + 5) for _ in range(2)]
        with pytest.raises(TransferError, match="already serves 2"):
            _proof.verify(witness.name, witness.token, os.getpid(), time.monotonic() + 5)
        for p in proofs:
            p.close()
    finally:
        witness.close()
    assert witness.readers == 0


def test_the_socket_name_alone_earns_nothing(monkeypatch):
    """The proof socket's name is visible to every process (/proc/net/unix). A process that
    finds it but lacks the token from the metadata gets no regions and no ptrace grant."""

    from rd2h_local import _proof

    grants = _Grants(monkeypatch)
    src = np.ones(4096, dtype=np.uint8)
    witness = _proof.Witness(lambda: [(src.ctypes.data, src.nbytes)])
    try:
        with pytest.raises(TransferError, match="wrong token"):
            _proof.verify(witness.name, bytes(_proof.TOKEN_BYTES), os.getpid(), time.monotonic() + 5)
        assert grants.calls == []
        proof = _proof.verify(witness.name, witness.token, os.getpid(), time.monotonic() + 5)
        assert proof.regions == [(src.ctypes.data, src.nbytes)] and grants.calls == [os.getpid()]
        proof.close()
    finally:
        witness.close()


class _Silent:
    """A proof socket of this process that accepts and answers nothing (or ``reply``)."""

    def __init__(self, reply: bytes = b"") -> None:
        import socket

        self.name = "rd2h-local.test-" + os.urandom(6).hex()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(b"\0" + self.name.encode())
        self.sock.listen(64)
        self.reply, self.conns = reply, []
        self.accepted = threading.Semaphore(0)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn = self.sock.accept()[0]
            except OSError:
                return
            self.conns.append(conn)
            if self.reply:
                threading.Thread(target=self._send, args=(conn,), daemon=True).start()
            self.accepted.release()

    def _send(self, conn) -> None:
        try:
            conn.sendall(self.reply)
        except OSError:
            pass

    def blob(self) -> bytes:
        return _metadata.encode(_metadata.PeerInfo(
            _sys.boot_id(), _sys.hostname(), _sys.pid_namespace(), os.getpid(), _sys.start_time(os.getpid()),
            (Region(4096, 4096),), self.name,
        ))  # fmt: skip

    def close(self) -> None:
        import socket

        self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        for conn in self.conns:
            conn.close()


def _connect_in_thread(engine: LocalEngine, blob: bytes) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            engine.connect(blob)
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, errors


def test_a_proof_reply_over_the_bound_is_refused_unread(decode):
    """Issue 19, item 4: a 16 MiB proof reply cost Decode +565 MB and 6.3 s of a handshake
    thread. A reply whose length is over MAX_REPLY_BYTES is refused from its 4-byte header,
    and one under it naming more than MAX_REGIONS regions is refused while decoding."""
    import msgpack

    engine, _ = decode
    body = b"\0" * (2 << 20)  # under the old 16 MiB bound
    silent = _Silent(_proof._LENGTH.pack(len(body)) + body)
    try:
        with pytest.raises(TransferError, match=f"above {_proof.MAX_REPLY_BYTES}"):
            engine.connect(silent.blob())
    finally:
        silent.close()
    many = msgpack.packb((b"rd2h-local-proof", 1, None, [[4096, 1]] * (_proof.MAX_REGIONS + 1)))
    assert len(many) < _proof.MAX_REPLY_BYTES
    silent = _Silent(_proof._LENGTH.pack(len(many)) + many)
    try:
        with pytest.raises(TransferError, match=f"at most {_proof.MAX_REGIONS} regions"):
            engine.connect(silent.blob())
    finally:
        silent.close()


def test_proofs_waiting_are_bounded_per_process_and_in_all(decode):
    """Issue 19, item 3: one process gets at most ``max_per_process`` proofs waiting (the
    next is refused at once, not queued), and past ``max_waiting`` a new proof cuts the
    oldest short instead of waiting behind it: its connect fails at once, naming why."""
    engine, _ = decode
    engine.proofs = _proof.ProofLoad(max_waiting=2, max_per_process=3)
    silent = _Silent()
    runs = []
    try:
        for _ in range(2):
            runs.append(_connect_in_thread(engine, silent.blob()))
            assert silent.accepted.acquire(timeout=10)
        assert until(lambda: len(engine.proofs) == 2, 10), len(engine.proofs)  # both entered
        third = _connect_in_thread(engine, silent.blob())
        assert silent.accepted.acquire(timeout=10)
        runs[0][0].join(5)  # cut short: well before the engine's 30 s bound
        assert not runs[0][0].is_alive() and "cut short" in str(runs[0][1][0]), runs[0][1]
        assert engine.proofs.cut == 1 and runs[1][0].is_alive() and third[0].is_alive()
        engine.proofs.max_waiting = 10
        assert until(lambda: len(engine.proofs) == 2, 10), len(engine.proofs)  # the third entered
        runs.append(_connect_in_thread(engine, silent.blob()))
        assert silent.accepted.acquire(timeout=10)
        refused = _connect_in_thread(engine, silent.blob())  # the fourth of this process
        refused[0].join(5)
        assert not refused[0].is_alive() and "already has 3 proofs waiting" in str(refused[1][0]), refused[1]
    finally:
        silent.close()
        for thread, _ in [*runs, third]:
            thread.join(10)
