"""Linux facts the local engine needs: the syscall, host and process identity, Yama.

Everything here is read on demand; importing this module loads libc and nothing else.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import select
import socket
import sys

__all__ = [
    "IOV_MAX",
    "process_vm_readv",
    "syscall_available",
    "boot_id",
    "hostname",
    "pid_namespace",
    "start_time",
    "ptrace_scope",
    "set_ptracer",
    "PTRACER_ANY",
    "ProcessHandle",
]

IOV_MAX = 1024  # UIO_MAXIOV: the kernel refuses more iovecs per call with EINVAL

_PR_SET_PTRACER = 0x59616D61
_PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value

_libc: ctypes.CDLL | None = None
process_vm_readv = None  # ctypes function, set by _load(); tests may replace it


def _load() -> None:
    global _libc, process_vm_readv
    if _libc is not None:
        return
    name = ctypes.util.find_library("c") or "libc.so.6"
    libc = ctypes.CDLL(name, use_errno=True)
    fn = libc.process_vm_readv  # AttributeError when this libc lacks it
    # CDLL functions release the GIL for the duration of the call: readers in
    # several threads copy in parallel.
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    fn.restype = ctypes.c_ssize_t
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    libc.prctl.restype = ctypes.c_int
    _libc = libc
    if process_vm_readv is None:
        process_vm_readv = fn


def syscall_available() -> tuple[bool, str]:
    """Whether ``process_vm_readv`` can be called here, and if not, why."""
    if not sys.platform.startswith("linux"):
        return False, f"process_vm_readv is Linux only (this is {sys.platform})"
    try:
        _load()
    except (OSError, AttributeError) as exc:
        return False, f"libc has no process_vm_readv ({exc})"
    return True, ""


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return None


def boot_id() -> str:
    """Identity of the running kernel: equal for every process on this host, this boot."""
    return _read("/proc/sys/kernel/random/boot_id") or ""


def hostname() -> str:
    return socket.gethostname()


def pid_namespace() -> int | None:
    """Inode of this process's pid namespace; pids mean the same thing only within one."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (tells a reused pid apart)."""
    stat = _read(f"/proc/{pid}/stat")
    if stat is None:
        return None
    # comm (field 2) is in parentheses and may itself contain spaces and parentheses.
    fields = stat[stat.rfind(")") + 2 :].split()
    try:
        return int(fields[19])  # field 22 of the whole line
    except (IndexError, ValueError):
        return None


def ptrace_scope() -> int | None:
    """Yama's ``ptrace_scope`` (0 to 3), or None where Yama is not built in."""
    value = _read("/proc/sys/kernel/yama/ptrace_scope")
    return int(value) if value is not None and value.isdigit() else None


PTRACER_ANY = _PR_SET_PTRACER_ANY


def set_ptracer(pid: int) -> bool:
    """``prctl(PR_SET_PTRACER, pid)``: under Yama scope 1, let ``pid`` (and its descendants)
    read this process; 0 clears, ``PTRACER_ANY`` lets every same-user process. Whether the
    call succeeded. Yama keeps one such pid per process: a call replaces the last."""
    _load()
    assert _libc is not None
    return _libc.prctl(_PR_SET_PTRACER, pid, 0, 0, 0) == 0


class ProcessHandle:
    """A peer process followed by identity, not by pid number alone.

    Holds a pidfd where the kernel has them (it becomes readable once the process exits,
    so a reused pid is never mistaken for the peer); otherwise compares the start time
    in ``/proc`` on every check. Raises ``ProcessLookupError`` when the process is gone.
    """

    def __init__(self, pid: int, expected_start: int | None) -> None:
        self.pid = pid
        self._start = expected_start
        try:
            self._fd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:
            raise
        except (AttributeError, OSError):  # kernel < 5.3 or a sandbox without pidfds
            self._fd = None
        # Checked after opening the pidfd: a match proves the fd names the peer itself.
        if expected_start is not None and start_time(pid) != expected_start:
            self.close()
            raise ProcessLookupError(pid)

    def exited(self) -> bool:
        """Whether the process has exited (a zombie counts), without blocking."""
        fd = self._fd
        if fd is not None:
            # poll, not select: select refuses fds >= 1024, which a busy Decode reaches, and
            # taking that refusal for "exited" would fail every read of a live peer. A poll
            # object per call: several threads may ask at once.
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            try:
                return bool(poller.poll(0))
            except OSError:
                return True
        return self._start is not None and start_time(self.pid) != self._start

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
