"""The local engine's registration blob: who the peer is and what it registered.

A positional msgpack array, append-only like the rest of rd2h's wire formats:

    (b"rd2h-local", version, boot_id, hostname, pid_namespace | None, pid, start_time | None,
     [(addr, length), ...], proof_socket, proof_token)

``proof_socket`` names the Prefill's socket in the abstract namespace and ``proof_token`` is
what a reader presents there (see ``_proof``): the pid and regions above are believed only
once the process there proves them.
"""

from __future__ import annotations

from dataclasses import dataclass

from rd2h.engine_support import MetadataEnvelope
from rd2h.interfaces import Region

__all__ = ["PeerInfo", "encode", "decode"]

ENVELOPE = MetadataEnvelope("local", b"rd2h-local", 1)


@dataclass(frozen=True, slots=True)
class PeerInfo:
    boot_id: str
    hostname: str
    pid_namespace: int | None
    pid: int
    start_time: int | None
    regions: tuple[Region, ...]
    proof_socket: str
    proof_token: bytes = b""


def encode(info: PeerInfo) -> bytes:
    regions = [(r.addr, r.length) for r in info.regions]
    return ENVELOPE.pack(info.boot_id, info.hostname, info.pid_namespace, info.pid, info.start_time, regions, info.proof_socket, info.proof_token)


def _optional_int(value: object, field: str) -> int | None:
    return None if value is None else ENVELOPE.integer(value, field)


def decode(blob: bytes) -> PeerInfo:
    """Parse a peer's blob. Raises ``TransferError`` naming the field that is wrong."""
    boot, host, pidns, pid, start, regions, proof, token = ENVELOPE.unpack(blob, 8)
    if not isinstance(boot, str) or not isinstance(host, str):
        raise ENVELOPE.malformed("boot_id and hostname must be strings")
    if not ENVELOPE.integer(pid, "pid"):
        raise ENVELOPE.malformed("pid must be positive")
    if not isinstance(proof, str) or len(proof) > 100:
        raise ENVELOPE.malformed("proof_socket must be a socket name")
    if not isinstance(token, bytes) or len(token) > 64:
        raise ENVELOPE.malformed("proof_token must be bytes")
    return PeerInfo(
        boot, host, _optional_int(pidns, "pid_namespace"), pid, _optional_int(start, "start_time"),
        tuple(Region(addr, length) for addr, length in ENVELOPE.regions(regions)),
        proof,
        token,
    )
