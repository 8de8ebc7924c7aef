"""Find transfer engines and control channels by name, through entry points.

A backend is a class published by any installed distribution under one of two
entry-point groups::

    [project.entry-points."rd2h.transfer_engines"]
    local = "rd2h_local:LocalEngine"

    [project.entry-points."rd2h.control_channels"]
    zmq = "rd2h_zmq:ZmqChannel"

This is the only module that talks to stevedore. Nothing is imported until a backend is
asked for by name (or listed), and every failure is one of three errors:

- ``BackendNotFoundError``: no backend of that name is installed (the message lists those
  that are);
- ``BackendUnavailableError``: it is installed but cannot be used here: importing it
  failed for a missing module (the message names the module and what to ``pip install``),
  or its ``availability()`` says no (the message gives its reason);
- ``BackendError``: anything else (two distributions publish one name, the entry point
  is not an engine/channel class, importing it raised something other than ImportError).
"""

from __future__ import annotations

import importlib.metadata
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import stevedore

from rd2h.errors import (
    BackendError,
    BackendNotFoundError,
    BackendUnavailableError,
    ConfigError,
)
from rd2h.interfaces import Availability, ControlChannel, TransferEngine

__all__ = [
    "ENGINE_GROUP",
    "CHANNEL_GROUP",
    "BackendInfo",
    "engine_class",
    "channel_class",
    "load_engine",
    "load_channel",
    "list_backends",
]

ENGINE_GROUP = "rd2h.transfer_engines"
CHANNEL_GROUP = "rd2h.control_channels"

Kind = Literal["engine", "channel"]
_GROUPS: dict[Kind, str] = {"engine": ENGINE_GROUP, "channel": CHANNEL_GROUP}
_BASES: dict[Kind, type] = {"engine": TransferEngine, "channel": ControlChannel}
_WORDS: dict[Kind, str] = {"engine": "transfer engine", "channel": "control channel"}
_ROLES = ("prefill", "decode")

B = TypeVar("B")


@dataclass(frozen=True, slots=True)
class BackendInfo:
    """One installed backend as ``rd2h backends`` shows it."""

    kind: Kind
    name: str
    distribution: str
    version: str
    available: bool
    reason: str = ""


def engine_class(name: str) -> type[TransferEngine]:
    """The transfer-engine class published as ``name``, imported now.

    Does not check ``availability()`` (``load_engine`` does). Raises
    ``BackendNotFoundError``, ``BackendUnavailableError`` (a missing module) or ``BackendError``.
    """
    return _load_class("engine", name)  # type: ignore[return-value]


def channel_class(name: str) -> type[ControlChannel]:
    """The control-channel class published as ``name``, imported now.

    Does not check ``availability()`` (``load_channel`` does). Raises as ``engine_class``.
    """
    return _load_class("channel", name)  # type: ignore[return-value]


def load_engine(name: str, role: str, **options: Any) -> TransferEngine:
    """Build the transfer engine ``name`` for ``role`` (``"prefill"`` or ``"decode"``).

    Raises ``ConfigError`` for a bad role or an option the engine does not take,
    ``BackendNotFoundError``, ``BackendUnavailableError`` (missing module, or
    ``availability()`` not ok), ``BackendError``, and whatever the engine raises.
    """
    if role not in _ROLES:
        raise ConfigError(f"role must be one of {', '.join(_ROLES)}, got {role!r}")
    cls = engine_class(name)
    _require_available("engine", name, cls)
    return _construct("engine", name, cls, dict(options, role=role))


def load_channel(name: str, **options: Any) -> ControlChannel:
    """Build the control channel ``name`` with ``options``; raises as ``load_engine``."""
    cls = channel_class(name)
    _require_available("channel", name, cls)
    return _construct("channel", name, cls, options)


def list_backends() -> list[BackendInfo]:
    """Every installed engine and channel, imported to ask whether it can run here.

    Never raises for a broken backend: it is listed with ``available=False`` and the reason.
    """
    infos: list[BackendInfo] = []
    for kind, group in _GROUPS.items():
        failures: list[tuple[importlib.metadata.EntryPoint, BaseException]] = []
        manager = stevedore.ExtensionManager(
            _fresh(group), on_load_failure_callback=_collect_into(failures)
        )
        for ext in manager.extensions:
            dist, version = _distribution_of(group, ext.entry_point)
            available = _check_loaded(kind, ext.name, ext.plugin)
            infos.append(BackendInfo(kind, ext.name, dist, version, available.ok, available.reason))
        for ep, err in failures:
            dist, version = _distribution_of(group, ep)
            reason = _failure_reason(ep, err, dist)
            infos.append(BackendInfo(kind, ep.name, dist, version, False, reason))
    return sorted(infos, key=lambda i: (i.kind != "engine", i.name, i.distribution))


# -- loading -------------------------------------------------------------------------------


def _fresh(group: str) -> str:
    # stevedore memoizes each group's entry points in a class attribute for the life of the
    # process; drop it so a distribution put on sys.path later is seen. Its own cache below
    # that is keyed by sys.path and file mtimes, so this costs a dict lookup, not a scan.
    stevedore.ExtensionManager.ENTRY_POINT_CACHE.pop(group, None)
    return group


def _collect_into(
    failures: list[tuple[importlib.metadata.EntryPoint, BaseException]],
) -> Callable[[Any, importlib.metadata.EntryPoint, BaseException], None]:
    def on_failure(_manager: Any, ep: importlib.metadata.EntryPoint, err: BaseException) -> None:
        failures.append((ep, err))

    return on_failure


def _load_class(kind: Kind, name: str) -> type:
    group = _GROUPS[kind]
    failures: list[tuple[importlib.metadata.EntryPoint, BaseException]] = []
    manager = stevedore.NamedExtensionManager(
        _fresh(group),
        names=[name],
        on_load_failure_callback=_collect_into(failures),
        on_missing_entrypoints_callback=None,
    )
    found = [ext.entry_point for ext in manager.extensions] + [ep for ep, _ in failures]
    if not found:
        installed = sorted(set(manager.entry_points_names()))
        listing = ", ".join(installed) if installed else "none"
        raise BackendNotFoundError(f"no {_WORDS[kind]} named {name!r} is installed (installed: {listing})")
    if len(found) > 1:
        owners = ", ".join(f"{_distribution_of(group, ep)[0]} ({ep.value})" for ep in found)
        raise BackendError(f"{_WORDS[kind]} {name!r} is published more than once: {owners}; uninstall all but one")
    if failures:
        ep, err = failures[0]
        dist, version = _distribution_of(group, ep)
        reason = _failure_reason(ep, err, dist)
        where = f"{dist} {version}"
        if isinstance(err, ImportError):
            raise BackendUnavailableError(
                f"{_WORDS[kind]} {name!r} (from {where}) is installed but cannot be imported: {reason}",
                name=err.name,
            ) from err
        raise BackendError(f"{_WORDS[kind]} {name!r} (from {where}) failed to import: {reason}") from err
    plugin = manager.extensions[0].plugin
    if not (isinstance(plugin, type) and issubclass(plugin, _BASES[kind])):
        raise BackendError(
            f"{_WORDS[kind]} {name!r} ({found[0].value}) is not a subclass of rd2h.interfaces.{_BASES[kind].__name__}"
        )
    return plugin


def _check_loaded(kind: Kind, name: str, plugin: object) -> Availability:
    if not (isinstance(plugin, type) and issubclass(plugin, _BASES[kind])):
        return Availability(False, f"not a subclass of rd2h.interfaces.{_BASES[kind].__name__}")
    return _availability(plugin)


def _availability(cls: type) -> Availability:
    try:
        result = cls.availability()  # type: ignore[attr-defined]
    except Exception as exc:  # the contract says it must not raise; report, do not crash
        return Availability(False, f"availability() raised {exc!r}")
    if not isinstance(result, Availability):
        return Availability(False, f"availability() returned {result!r}, not an Availability")
    return result


def _require_available(kind: Kind, name: str, cls: type) -> None:
    result = _availability(cls)
    if not result.ok:
        raise BackendUnavailableError(f"{_WORDS[kind]} {name!r} cannot run here: {result.reason}")


def _construct(kind: Kind, name: str, cls: Callable[..., B], options: dict[str, Any]) -> B:
    # Check option names against the signature first, so an unknown option is a
    # ConfigError even from a backend whose __init__ would only raise TypeError.
    try:
        params = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):
        params = None
    if params is not None and not any(p.kind is p.VAR_KEYWORD for p in params):
        accepted = {p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
        unknown = sorted(set(options) - accepted)
        if unknown:
            raise ConfigError(
                f"{_WORDS[kind]} {name!r} does not take option(s) {', '.join(unknown)}; "
                f"it takes: {', '.join(sorted(accepted)) or 'none'}"
            )
    return cls(**options)


# -- distributions and install hints -------------------------------------------------------


def _distribution_of(group: str, ep: importlib.metadata.EntryPoint) -> tuple[str, str]:
    """(name, version) of the distribution that publishes ``ep``; stevedore's cache drops it."""
    for candidate in importlib.metadata.entry_points(group=group, name=ep.name):
        dist = getattr(candidate, "dist", None)
        if candidate.value == ep.value and dist is not None:
            return dist.metadata["Name"], dist.version
    return "unknown", "?"


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(requirement: str) -> str:
    return re.split(r"[\s;<>=!~\[(@]", requirement.strip(), maxsplit=1)[0]


def _failure_reason(ep: importlib.metadata.EntryPoint, err: BaseException, dist: str) -> str:
    if not isinstance(err, ImportError):
        return f"{type(err).__name__}: {err}"
    missing = err.name
    if missing is None:
        return f"{err} ({_install_hint(dist, None)})"
    if missing.split(".")[0] == ep.value.split(":")[0].split(".")[0]:
        return f"its own module {missing!r} is missing; reinstall it: pip install --force-reinstall {dist}"
    return f"module {missing!r} is not installed ({_install_hint(dist, missing)})"


def _install_hint(dist: str, missing: str | None) -> str:
    """What to ``pip install`` so that ``dist`` imports: the declared requirement that provides
    ``missing`` if one matches its name, else the distribution again (which pulls in its
    declared dependencies), or the rd2h extra that names it."""
    if missing is not None:
        top = _normalize(missing.split(".")[0])
        for requirement in _requires(dist):
            req_name = _requirement_name(requirement)
            if _normalize(req_name) == top:
                return f"pip install {req_name}, a dependency of {dist}"
    choices = [f"pip install {dist}"]
    extra = _rd2h_extra_for(dist)
    if extra is not None:
        choices.append(f"pip install 'rd2h[{extra}]'")
    hint = " or ".join(choices)
    if missing is not None:
        hint += f", or install the package that provides {missing!r}"
    return hint


def _requires(dist: str) -> list[str]:
    try:
        return importlib.metadata.requires(dist) or []
    except importlib.metadata.PackageNotFoundError:
        return []


def _rd2h_extra_for(dist: str) -> str | None:
    for requirement in _requires("rd2h"):
        match = re.search(r"""extra\s*==\s*["']([^"']+)["']""", requirement)
        if match and _normalize(_requirement_name(requirement)) == _normalize(dist):
            return match.group(1)
    return None
