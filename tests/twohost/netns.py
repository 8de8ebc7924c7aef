"""Two "hosts" on one machine: two network namespaces joined by a veth pair (root only).

Each namespace has loopback and one interface named ``rd2h0`` with its own address; the
link between them can be cut and restored. Only these two addresses are ever dialled.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence

__all__ = ["TwoHosts", "why_not"]

DEVICE = "rd2h0"  # the same name on both sides, so one UCX_NET_DEVICES serves both


def why_not() -> str:
    """Why namespaces cannot be made here ("" if they can)."""
    if os.geteuid() != 0:
        return "needs root (ip netns add)"
    if shutil.which("ip") is None:
        return "needs iproute2 (ip)"
    return ""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


class TwoHosts:
    """``prefill`` and ``decode`` namespaces at ``prefill_addr`` and ``decode_addr`` (a /24).

    ``subnet`` picks the third octet, so runs that overlap in time use different names and
    addresses. ``close()`` deletes both namespaces (and with them the veth pair).
    """

    def __init__(self, tag: str, subnet: int) -> None:
        self.prefill = f"rd2h-{tag}-p"
        self.decode = f"rd2h-{tag}-d"
        self.prefill_addr = f"10.231.{subnet}.1"
        self.decode_addr = f"10.231.{subnet}.2"
        self._made: list[str] = []
        try:
            for ns in (self.prefill, self.decode):
                _ip("netns", "add", ns)
                self._made.append(ns)
            a, b = f"rd2h{subnet}a{os.getpid() % 1000}", f"rd2h{subnet}b{os.getpid() % 1000}"
            _ip("link", "add", a, "type", "veth", "peer", "name", b)
            for dev, ns, addr in ((a, self.prefill, self.prefill_addr), (b, self.decode, self.decode_addr)):
                _ip("link", "set", dev, "netns", ns)
                _ip("-n", ns, "link", "set", dev, "name", DEVICE)
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", DEVICE)
                _ip("-n", ns, "link", "set", DEVICE, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def cut(self) -> None:
        """Drop every packet both ways, silently, as a pulled cable does (no reset is sent)."""
        for ns in (self.prefill, self.decode):
            _ip("-n", ns, "link", "set", DEVICE, "down")

    def restore(self) -> None:
        for ns in (self.prefill, self.decode):
            _ip("-n", ns, "link", "set", DEVICE, "up")

    def command(self, ns: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside namespace ``ns``."""
        return ["ip", "netns", "exec", ns, *argv]

    def close(self) -> None:
        for ns in self._made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
        self._made.clear()

    def __enter__(self) -> TwoHosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
