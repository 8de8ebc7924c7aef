"""Addresses of the tcp channel: ``tcp://host:port`` and ``ipc:///path`` (zmq's spellings, so
the same configuration names either channel). Pure."""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass

from rd2h.errors import ChannelError

__all__ = ["Address", "parse"]


@dataclass(frozen=True, slots=True)
class Address:
    family: int  # socket.AF_INET, AF_INET6 or AF_UNIX
    target: tuple[str, int] | str  # what bind()/connect() take
    host: str  # "" for ipc

    @property
    def local(self) -> bool:
        """Reachable from this host only: loopback TCP or a unix socket."""
        if self.family == socket.AF_UNIX:
            return True
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:  # "*", a host name: not known to be loopback
            return False


def parse(address: str) -> Address:
    """Raises ``ChannelError`` naming what is wrong with ``address``."""
    if not isinstance(address, str):
        raise ChannelError(f"a tcp channel address is a string, got {address!r}")
    scheme, sep, rest = address.partition("://")
    if sep and scheme == "ipc":
        if not rest:
            raise ChannelError(f"ipc address {address!r} names no path (ipc:///path/to/socket)")
        return Address(socket.AF_UNIX, rest, "")
    if not sep or scheme != "tcp":
        raise ChannelError(f"tcp channel addresses look like tcp://host:port or ipc:///path, got {address!r}")
    host, colon, port_text = rest.rpartition(":")
    if not colon or not host:
        raise ChannelError(f"address {address!r} has no host:port")
    try:
        port = int(port_text)
    except ValueError:
        raise ChannelError(f"address {address!r}: port {port_text!r} is not a number") from None
    if not 0 <= port <= 65535:
        raise ChannelError(f"address {address!r}: port {port} is outside 0..65535")
    bracketed = host.startswith("[") and host.endswith("]")
    host = host.strip("[]")
    if host == "*":
        host = "::" if bracketed else "0.0.0.0"
    family = socket.AF_INET6 if bracketed or ":" in host else socket.AF_INET
    return Address(family, (host, port), host)


def show(family: int, sockname: object) -> str:
    """The address string of a bound socket (a port 0 resolved)."""
    if family == socket.AF_UNIX:
        return f"ipc://{sockname}"
    host, port = sockname[0], sockname[1]  # type: ignore[index]
    return f"tcp://[{host}]:{port}" if family == socket.AF_INET6 else f"tcp://{host}:{port}"
