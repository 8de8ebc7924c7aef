"""rd2h.plugins against real entry points: throwaway distributions put on sys.path, and the
installed zmq channel and local engine."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from rd2h import plugins
from rd2h.errors import BackendError, BackendNotFoundError, BackendUnavailableError, ConfigError
from rd2h.interfaces import ControlChannel, TransferEngine

ENGINES = textwrap.dedent(
    '''
    from rd2h.interfaces import Availability, ControlChannel, TransferEngine

    class _Engine(TransferEngine):
        def __init__(self, *, role, depth=1):
            self.role, self.depth = role, depth
        session_id = "fake"
        def register(self, regions): return b""
        def connect(self, peer_metadata): raise NotImplementedError
        def read_batch(self, session, local_addrs, remote_addrs, lengths): raise NotImplementedError

    class OkEngine(_Engine):
        name = "fake-ok"

    class UnavailableEngine(_Engine):
        @classmethod
        def availability(cls):
            return Availability(False, "needs an accelerator this machine does not have")

    class RaisingEngine(_Engine):
        @classmethod
        def availability(cls):
            raise RuntimeError("probe exploded")

    class OpenChannel(ControlChannel):
        def __init__(self, **options):
            self.options = options
        def listen(self, address): raise NotImplementedError
        def dialer(self): raise NotImplementedError

    def helper():
        return None
    '''
)

FAKE_ENTRY_POINTS = """\
[rd2h.transfer_engines]
fake-ok = rd2h_fake_engines:OkEngine
fake-unavailable = rd2h_fake_engines:UnavailableEngine
fake-raising = rd2h_fake_engines:RaisingEngine
fake-missing = rd2h_fake_missing:Engine
fake-not-a-class = rd2h_fake_engines:helper
fake-channel-as-engine = rd2h_fake_engines:OpenChannel
fake-gone = rd2h_fake_deleted_package:Engine
fake-twice = rd2h_fake_engines:OkEngine

[rd2h.control_channels]
fake-open = rd2h_fake_engines:OpenChannel
fake-missing = rd2h_fake_missing:Channel
"""


def write_distribution(root: Path, name: str, requires: list[str], entry_points: str) -> None:
    info = root / f"{name.replace('-', '_')}-0.3.1.dist-info"
    info.mkdir()
    lines = ["Metadata-Version: 2.1", f"Name: {name}", "Version: 0.3.1"]
    lines += [f"Requires-Dist: {r}" for r in requires]
    (info / "METADATA").write_text("\n".join(lines) + "\n")
    (info / "entry_points.txt").write_text(entry_points)


@pytest.fixture
def fake_dists(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Two distributions on sys.path: rd2h-fake declares the dependency its module lacks,
    rd2h-fake-other publishes a duplicate name (another class: an identical entry point
    twice is one to stevedore) and a module with an undeclared import."""
    (tmp_path / "rd2h_fake_engines.py").write_text(ENGINES)
    (tmp_path / "rd2h_fake_missing.py").write_text("import rd2h_absent_dependency\n")
    (tmp_path / "rd2h_fake_undeclared.py").write_text("import rd2h_undeclared_dependency.sub\n")
    write_distribution(tmp_path, "rd2h-fake", ["rd2h", "rd2h_absent-dependency>=1.0"], FAKE_ENTRY_POINTS)
    write_distribution(
        tmp_path,
        "rd2h-fake-other",
        ["rd2h"],
        "[rd2h.transfer_engines]\nfake-twice = rd2h_fake_engines:RaisingEngine\n"
        "fake-undeclared = rd2h_fake_undeclared:Engine\n",
    )
    before = set(sys.modules)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for module in set(sys.modules) - before:
        if module.startswith("rd2h_fake"):
            del sys.modules[module]


# -- errors ----------------------------------------------------------------------------------


def test_unknown_name_lists_what_is_installed(fake_dists: Path) -> None:
    with pytest.raises(BackendNotFoundError) as caught:
        plugins.engine_class("no-such-engine")
    message = str(caught.value)
    assert "'no-such-engine'" in message and "fake-ok" in message and "fake-missing" in message
    assert isinstance(caught.value, LookupError)
    with pytest.raises(BackendNotFoundError, match="fake-open"):
        plugins.load_channel("no-such-channel")


def test_missing_declared_dependency_names_module_and_requirement(fake_dists: Path) -> None:
    with pytest.raises(BackendUnavailableError) as caught:
        plugins.engine_class("fake-missing")
    message = str(caught.value)
    assert "'rd2h_absent_dependency'" in message
    assert "pip install rd2h_absent-dependency" in message and "rd2h-fake" in message
    assert caught.value.name == "rd2h_absent_dependency"
    assert isinstance(caught.value, ImportError)
    assert isinstance(caught.value.__cause__, ModuleNotFoundError)
    with pytest.raises(BackendUnavailableError, match="rd2h_absent_dependency"):
        plugins.load_channel("fake-missing")


def test_missing_undeclared_dependency_suggests_the_distribution(fake_dists: Path) -> None:
    with pytest.raises(BackendUnavailableError) as caught:
        plugins.load_engine("fake-undeclared", role="decode")
    message = str(caught.value)
    assert "'rd2h_undeclared_dependency'" in message
    assert "pip install rd2h-fake-other" in message and "provides 'rd2h_undeclared_dependency" in message


def test_missing_own_module_says_reinstall(fake_dists: Path) -> None:
    with pytest.raises(BackendUnavailableError, match="reinstall.*rd2h-fake"):
        plugins.engine_class("fake-gone")


def test_unavailable_class_loads_but_cannot_be_used(fake_dists: Path) -> None:
    cls = plugins.engine_class("fake-unavailable")
    assert issubclass(cls, TransferEngine)
    with pytest.raises(BackendUnavailableError, match="needs an accelerator"):
        plugins.load_engine("fake-unavailable", role="prefill")
    with pytest.raises(BackendUnavailableError, match="probe exploded"):
        plugins.load_engine("fake-raising", role="prefill")


def test_not_an_engine_is_a_backend_error(fake_dists: Path) -> None:
    for name in ("fake-not-a-class", "fake-channel-as-engine"):
        with pytest.raises(BackendError, match="not a subclass of rd2h.interfaces.TransferEngine") as caught:
            plugins.engine_class(name)
        assert type(caught.value) is BackendError


def test_name_published_twice_is_a_backend_error(fake_dists: Path) -> None:
    with pytest.raises(BackendError, match="more than once") as caught:
        plugins.engine_class("fake-twice")
    assert "rd2h-fake" in str(caught.value) and "rd2h-fake-other" in str(caught.value)


# -- construction ------------------------------------------------------------------------------


def test_load_engine_passes_role_and_options(fake_dists: Path) -> None:
    engine = plugins.load_engine("fake-ok", role="decode", depth=3)
    assert (engine.role, engine.depth) == ("decode", 3)


def test_unknown_option_or_role_is_config_error(fake_dists: Path) -> None:
    with pytest.raises(ConfigError, match="colour.*takes: depth, role"):
        plugins.load_engine("fake-ok", role="decode", colour="red")
    with pytest.raises(ConfigError, match="role"):
        plugins.load_engine("fake-ok", role="both")
    # a class that takes **options decides for itself
    channel = plugins.load_channel("fake-open", anything=1)
    assert isinstance(channel, ControlChannel) and channel.options == {"anything": 1}


# -- listing ---------------------------------------------------------------------------------


def test_list_backends_reports_every_entry_point(fake_dists: Path) -> None:
    rows = {(b.kind, b.name, b.distribution): b for b in plugins.list_backends()}
    ok = rows["engine", "fake-ok", "rd2h-fake"]
    assert ok.available and ok.reason == "" and ok.version == "0.3.1"
    assert not rows["engine", "fake-unavailable", "rd2h-fake"].available
    assert "needs an accelerator" in rows["engine", "fake-unavailable", "rd2h-fake"].reason
    assert "probe exploded" in rows["engine", "fake-raising", "rd2h-fake"].reason
    missing = rows["channel", "fake-missing", "rd2h-fake"]
    assert not missing.available and "rd2h_absent_dependency" in missing.reason
    assert "not a subclass" in rows["engine", "fake-not-a-class", "rd2h-fake"].reason
    assert ("engine", "fake-twice", "rd2h-fake-other") in rows
    kinds = [b.kind for b in plugins.list_backends()]
    assert kinds == sorted(kinds, key=lambda k: k != "engine")


def test_distributions_left_on_sys_path_are_forgotten_when_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "later"
    root.mkdir()
    write_distribution(root, "rd2h-fake-later", [], "[rd2h.control_channels]\nfake-later = nowhere:X\n")
    with pytest.raises(BackendNotFoundError):
        plugins.channel_class("fake-later")
    with monkeypatch.context() as patch:
        patch.syspath_prepend(str(root))
        with pytest.raises(BackendUnavailableError):
            plugins.channel_class("fake-later")
    with pytest.raises(BackendNotFoundError):
        plugins.channel_class("fake-later")


# -- the real backends ------------------------------------------------------------------------


def test_real_zmq_channel_loads() -> None:
    from rd2h_zmq import ZmqChannel

    assert plugins.channel_class("zmq") is ZmqChannel
    channel = plugins.load_channel("zmq", max_frame_bytes=1 << 16)
    assert isinstance(channel, ZmqChannel)
    with pytest.raises(ConfigError):
        plugins.load_channel("zmq", no_such_option=1)
    row = next(b for b in plugins.list_backends() if (b.kind, b.name) == ("channel", "zmq"))
    assert row.available and row.distribution == "rd2h-zmq"
    assert row.version == importlib.metadata.version("rd2h-zmq")


def test_real_local_engine_loads() -> None:
    # rd2h depends on rd2h-local and every supported machine is Linux: neither may be skipped
    importlib.metadata.distribution("rd2h-local")
    cls = plugins.engine_class("local")
    assert issubclass(cls, TransferEngine)
    row = next(b for b in plugins.list_backends() if (b.kind, b.name) == ("engine", "local"))
    assert row.distribution == "rd2h-local"
    assert row.available, row.reason
    engine = plugins.load_engine("local", role="decode")
    try:
        assert isinstance(engine, cls)
    finally:
        engine.close()


def test_importing_rd2h_loads_no_backend() -> None:
    code = (
        "import sys, rd2h, rd2h.errors, rd2h.interfaces\n"
        "loaded = [m for m in ('stevedore', 'zmq', 'rd2h.plugins', 'rd2h_zmq', 'rd2h_local') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
