"""The mf_meta message: its wire forms, :class:`MfMeta`, and the rule for accepting a peer (pure).

``mf_meta`` opens every Prefill -> Decode connection. Three implementations send it in four
layouts (:class:`MetaForm`): the reference implementation's 3-field form and its newer form
with a version and the Prefill's pipeline rank and size appended; rd2h's form, which fills
those reference fields and appends one map of its own; and rd2h protocol 2, whose fields
collide with the reference's newer form and which is recognised only to be refused. The
decoder tells them apart by shape alone (``docs/protocol.md`` section 4.1); ``rd2h.wire.protocol``
frames them with the other messages.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rd2h.errors import IncompatiblePeerError, RemoteProtocolError
from rd2h.layout.layers import LayerLayout
from rd2h.wire.fields import VERSION_END as _VERSION_END
from rd2h.wire.fields import as_bytes as _as_bytes
from rd2h.wire.fields import check_int as _check_int
from rd2h.wire.fields import check_str as _check_str
from rd2h.wire.fields import kind as _kind
from rd2h.wire.layer_metadata import (
    LAYOUT_VERSION,
    LEGACY_LAYOUT_VERSION,
    READ_LAYOUT_VERSIONS,
    decode_layer_metadata,
    encode_layer_metadata,
)

__all__ = [
    "PROTOCOL_VERSION",
    "LEGACY_PROTOCOL_VERSION",
    "REFERENCE_PROTOCOL_VERSION",
    "MetaForm",
    "MfMeta",
    "check_compatible",
    "mf_meta_fields",
    "decode_mf_meta",
]

# v3: mf_meta keeps the reference's fields first, rd2h's own in one map
# v4: Prefill tells Decode how each request ended (``settled``); Decode waits for it to report DONE
PROTOCOL_VERSION = 4
LEGACY_PROTOCOL_VERSION = 1  # the reference implementation's 3-field mf_meta
# What rd2h writes in the reference's own version field of mf_meta (docs/protocol.md 4.1)
REFERENCE_PROTOCOL_VERSION = 2

# keys of the map rd2h appends to mf_meta after the reference's fields
_OWN_PROTOCOL, _OWN_LAYOUT, _OWN_ENGINE = "rd2h", "layout", "engine"


def _set(obj: object, name: str, value: object) -> None:
    object.__setattr__(obj, name, value)  # normalising a field of a frozen dataclass


class MetaForm(enum.Enum):
    """Which of the known layouts of ``mf_meta`` a peer sent (see ``docs/protocol.md`` 4)."""

    RD2H = "rd2h"  # the reference's versioned fields, then one map of rd2h's own: this build
    REFERENCE = "reference"  # (tag, p_session, layer_metadata): the reference implementation
    REFERENCE_PP = "reference-pp"  # + (version, pp_rank, pp_size): the reference's newer form
    RD2H_V2 = "rd2h-v2"  # rd2h protocol 2: + (protocol, layout, engine bytes); always refused


# What a form does not carry on the wire must hold the value decoding gives it, so that every
# message round-trips; MfMeta.reference() fills these in.
_FORM_FIXED: dict[MetaForm, dict[str, object]] = {
    MetaForm.RD2H: {},
    MetaForm.REFERENCE: {
        "protocol_version": LEGACY_PROTOCOL_VERSION,
        "layout_version": LEGACY_LAYOUT_VERSION,
        "engine_metadata": b"",
        "reference_version": LEGACY_PROTOCOL_VERSION,
        "pp_rank": 0,
        "pp_size": 1,
    },
    MetaForm.REFERENCE_PP: {
        "protocol_version": LEGACY_PROTOCOL_VERSION,
        "layout_version": LEGACY_LAYOUT_VERSION,
        "engine_metadata": b"",
    },
    MetaForm.RD2H_V2: {"reference_version": LEGACY_PROTOCOL_VERSION, "pp_rank": 0, "pp_size": 1},
}


@dataclass(frozen=True, slots=True)
class MfMeta:
    """Prefill -> Decode, once per connection before any readiness: who I am, where my cache is.

    ``layer_metadata`` is the msgpack map built by :func:`~rd2h.wire.layer_metadata.encode_layer_metadata`;
    ``engine_metadata`` is opaque to rd2h, produced by the transfer engine's ``register`` and
    consumed by its ``connect``. ``protocol_version``/``layout_version`` are rd2h's own;
    ``reference_version``, ``pp_rank`` and ``pp_size`` fill the reference implementation's
    fields. ``form`` says which wire layout this is; the defaults build this build's form, and
    :meth:`reference` builds the reference's (for tests and hand-written peers).
    Raises TypeError/ValueError on a bad field, or a field its ``form`` cannot carry.
    """

    p_session: str
    layer_metadata: bytes
    protocol_version: int = PROTOCOL_VERSION
    layout_version: int = LAYOUT_VERSION
    engine_metadata: bytes = b""
    pp_rank: int = 0
    pp_size: int = 1
    form: MetaForm = MetaForm.RD2H
    reference_version: int = REFERENCE_PROTOCOL_VERSION

    def __post_init__(self) -> None:
        _check_str(self.p_session, "p_session", allow_empty=True)
        _set(self, "layer_metadata", _as_bytes(self.layer_metadata, "layer_metadata"))
        _check_int(self.protocol_version, "protocol_version", 1, _VERSION_END)
        _check_int(self.layout_version, "layout_version", 1, _VERSION_END)
        _set(self, "engine_metadata", _as_bytes(self.engine_metadata, "engine_metadata"))
        _check_int(self.reference_version, "reference_version", 0, _VERSION_END)
        _check_int(self.pp_size, "pp_size", 1, _VERSION_END)
        _check_int(self.pp_rank, "pp_rank", 0, self.pp_size)
        if type(self.form) is not MetaForm:
            raise TypeError(f"form: expected a MetaForm, got {_kind(self.form)}")
        for name, value in _FORM_FIXED[self.form].items():
            if getattr(self, name) != value:
                raise ValueError(f"{name}: a {self.form.value} mf_meta does not carry it (must be {value!r})")

    @classmethod
    def from_layers(
        cls, p_session: str, layers: Mapping[str, LayerLayout], *, engine_metadata: bytes = b"", pp_rank: int = 0,
        pp_size: int = 1,
    ) -> MfMeta:
        """Build this build's mf_meta from layouts; ``pp_rank``/``pp_size``: the pipeline stage
        whose layers these are. Raises TypeError/ValueError on bad layouts or stage."""
        return cls(
            p_session, encode_layer_metadata(layers), engine_metadata=engine_metadata, pp_rank=pp_rank, pp_size=pp_size
        )

    @classmethod
    def reference(
        cls, p_session: str, layer_metadata: bytes, *, version: int | None = None, pp_rank: int = 0, pp_size: int = 1
    ) -> MfMeta:
        """The reference implementation's mf_meta: 3 fields, or with ``version`` its newer form."""
        legacy = (LEGACY_PROTOCOL_VERSION, LEGACY_LAYOUT_VERSION)
        if version is None:
            return cls(p_session, layer_metadata, *legacy, form=MetaForm.REFERENCE, reference_version=legacy[0])
        return cls(
            p_session, layer_metadata, *legacy, pp_rank=pp_rank, pp_size=pp_size,
            form=MetaForm.REFERENCE_PP, reference_version=version,
        )

    @property
    def legacy(self) -> bool:
        """True for the reference implementation's forms: no rd2h versions, no engine metadata."""
        return self.form in (MetaForm.REFERENCE, MetaForm.REFERENCE_PP)

    def layers(self) -> dict[str, LayerLayout]:
        """Decode ``layer_metadata``.

        Raises RemoteProtocolError if it is malformed, IncompatiblePeerError if its layout
        version is unknown to this build.
        """
        return decode_layer_metadata(self.layer_metadata, layout_version=self.layout_version)


def check_compatible(meta: MfMeta, *, accept_legacy: bool = False) -> None:
    """Refuse a peer this build cannot serve safely; return if it can.

    Accepted: this build's form with equal protocol and cache-layout versions, and the
    reference implementation's forms (``meta.legacy``) only with ``accept_legacy=True``.
    Refused: rd2h protocol 2 (whose mf_meta collides with the reference's newer form),
    other versions, and a pipeline stage (``pp_size > 1``) in the reference's forms, whose
    stages rd2h does not model (an rd2h stage names the layers it holds: Decode completes a
    request from several). Raises IncompatiblePeerError saying why and what to do.
    """
    who = f"peer {meta.p_session[:80]!r}"
    ours = f"this build speaks rd2h protocol {PROTOCOL_VERSION}, cache layout {LAYOUT_VERSION}"
    theirs = f"rd2h protocol {meta.protocol_version}, cache layout {meta.layout_version}"
    if meta.form is MetaForm.RD2H_V2:
        raise IncompatiblePeerError(
            f"{who} speaks rd2h protocol {meta.protocol_version}, upgrade it: {ours}, and the older "
            "mf_meta put its versions where the reference implementation now sends pp_rank and "
            "pp_size. Run the same rd2h version on Prefill and Decode."
        )
    if meta.legacy:
        if not accept_legacy:
            raise IncompatiblePeerError(
                f"{who} is a legacy build (the reference implementation's mf_meta); {ours}. Mixing "
                "legacy and unequal-TP contributor builds can duplicate writes, so the handshake is "
                "refused. Upgrade the peer to rd2h, or accept legacy peers (accept_legacy=True) only "
                "where Prefill and Decode TP sizes are equal."
            )
    elif (meta.protocol_version, meta.layout_version) != (PROTOCOL_VERSION, LAYOUT_VERSION):
        raise IncompatiblePeerError(
            f"{who} speaks {theirs}; {ours}. The handshake is refused rather than risk reading a "
            "layout differently on the two sides: run the same rd2h version on Prefill and Decode."
        )
    if meta.pp_size != 1 and meta.legacy:
        raise IncompatiblePeerError(
            f"{who} is pipeline stage {meta.pp_rank} of {meta.pp_size} of a legacy build; rd2h takes the "
            "stages of an rd2h Prefill only (a legacy Prefill with pp_size 1): run Prefill with pp_size 1, or rd2h."
        )


def mf_meta_fields(msg: MfMeta) -> tuple[object, ...]:
    """The fields of ``msg`` after the tag, in the layout its ``form`` names."""
    head = (msg.p_session, msg.layer_metadata)
    if msg.form is MetaForm.REFERENCE:
        return head
    if msg.form is MetaForm.RD2H_V2:
        return (*head, msg.protocol_version, msg.layout_version, msg.engine_metadata)
    reference = (*head, msg.reference_version, msg.pp_rank, msg.pp_size)
    if msg.form is MetaForm.REFERENCE_PP:
        return reference
    own = {_OWN_PROTOCOL: msg.protocol_version, _OWN_LAYOUT: msg.layout_version, _OWN_ENGINE: msg.engine_metadata}
    return (*reference, own)


def decode_mf_meta(f: tuple[Any, ...]) -> MfMeta:
    """Decode a whole mf_meta array (tag first), telling the forms apart by shape.

    Raises TypeError/ValueError naming the field; the caller makes them RemoteProtocolError.
    """
    n = len(f)
    if n < 3:
        raise ValueError(f"needs at least 3 fields, got {n}")
    if n == 3:
        meta = MfMeta.reference(f[1], f[2])
    elif n >= 6 and type(f[5]) is bytes:  # rd2h protocol 2; the reference sends an int (pp_size)
        meta = MfMeta(f[1], f[2], f[3], f[4], f[5], form=MetaForm.RD2H_V2, reference_version=LEGACY_PROTOCOL_VERSION)
        return meta  # its layout is refused, never read: check_compatible says why
    else:
        version, pp_rank, pp_size = f[3], f[4] if n > 4 else 0, f[5] if n > 5 else 1
        _check_int(version, "reference_version", 0, _VERSION_END)
        _check_int(pp_size, "pp_size", 1, _VERSION_END)
        _check_int(pp_rank, "pp_rank", 0, pp_size)
        own = f[6] if n > 6 else None
        if type(own) is dict and _OWN_PROTOCOL in own:
            protocol, layout, engine = own[_OWN_PROTOCOL], own.get(_OWN_LAYOUT), own.get(_OWN_ENGINE, b"")
            if layout is None:
                raise ValueError(f"rd2h_fields.{_OWN_LAYOUT}: missing")
            _check_int(protocol, f"rd2h_fields.{_OWN_PROTOCOL}", 1, _VERSION_END)
            _check_int(layout, f"rd2h_fields.{_OWN_LAYOUT}", 1, _VERSION_END)
            engine = _as_bytes(engine, f"rd2h_fields.{_OWN_ENGINE}")
            meta = MfMeta(f[1], f[2], protocol, layout, engine, pp_rank, pp_size, MetaForm.RD2H, version)
        else:  # the reference's newer form, or one it extends later: trailing fields ignored
            meta = MfMeta.reference(f[1], f[2], version=version, pp_rank=pp_rank, pp_size=pp_size)
    # Validate the nested map now for the layout versions this build reads; for any other the
    # bytes stay opaque and check_compatible refuses the peer with the better message.
    if meta.layout_version in READ_LAYOUT_VERSIONS:
        try:
            meta.layers()
        except RemoteProtocolError as exc:
            raise ValueError(str(exc)) from exc
    return meta
