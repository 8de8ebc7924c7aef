"""What docs/vllm.md and README.md tell vLLM users to run, checked without an engine: every
``--kv-transfer-config`` is one the connector accepts, a Decode that binds beyond loopback
carries the control channel's consent (the zmq channel refuses it otherwise: a real bind
shows it), and README's quick start blocks are docs/vllm.md's, which
tests/e2e/test_vllm_quickstart.py runs with engines."""

from __future__ import annotations

import ipaddress
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from rd2h import plugins
from rd2h.errors import ConfigError
from rd2h.vllm.config import ConnectorConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
import quickstart_doc  # noqa: E402 - the e2e test's own reader of the doc
import vllm_cluster  # noqa: E402

_CONFIG = re.compile(r"--kv-transfer-config '(.*?)'", re.S)


def transfer_configs() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for path in (quickstart_doc.DOC, quickstart_doc.README):
        for i, text in enumerate(_CONFIG.findall(path.read_text())):
            found.append((f"{path.name}#{i}", json.loads(text)))
    return found


def test_the_docs_show_transfer_configs() -> None:
    roles = {config["kv_role"] for _, config in transfer_configs()}
    assert {"kv_producer", "kv_consumer"} <= roles


@pytest.mark.parametrize(("where", "config"), transfer_configs(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_documented_transfer_config_is_accepted(where: str, config: dict[str, Any]) -> None:
    assert config["kv_connector"] == "RD2HConnector", where
    ConnectorConfig.from_extra(config.get("kv_connector_extra_config"))  # raises naming a bad key or value


def _binds_beyond_loopback(config: dict[str, Any]) -> bool:
    host = ConnectorConfig.from_extra(config.get("kv_connector_extra_config")).host
    return config["kv_role"] in ("kv_consumer", "kv_both") and not ipaddress.ip_address(host).is_loopback


def test_a_documented_decode_that_binds_beyond_loopback_can_listen() -> None:
    """The Decode example that binds 0.0.0.0 listens with its own channel options (a real
    bind); the same config without them is refused, as the example once was."""
    decodes = [(where, c) for where, c in transfer_configs() if _binds_beyond_loopback(c)]
    assert decodes, "no documented Decode binds beyond loopback: this test checks nothing"
    for where, config in decodes:
        cfg = ConnectorConfig.from_extra(config["kv_connector_extra_config"])
        listener = plugins.load_channel(cfg.channel, **dict(cfg.channel_options)).listen(f"tcp://{cfg.host}:0")
        listener.close()
        with pytest.raises(ConfigError, match="allow_insecure"):
            plugins.load_channel(cfg.channel).listen(f"tcp://{cfg.host}:0")
        assert cfg.advertise_host, f"{where}: Prefill cannot dial {cfg.host}"


def test_readme_shows_the_quick_start_blocks_the_doc_runs() -> None:
    doc, readme = quickstart_doc.blocks(), quickstart_doc.blocks(quickstart_doc.README)
    assert set(doc) == set(quickstart_doc.NAMES)
    assert readme, "README.md shows no quick start block"
    for name, text in readme.items():
        assert text == doc[name], f"README.md's quickstart: {name} differs from docs/vllm.md's"


def test_the_quick_start_gives_the_cpu_settings_the_tests_use() -> None:
    exported = quickstart_doc.exported(quickstart_doc.blocks()["env"])
    assert {k: exported.get(k) for k in vllm_cluster.CPU_SETTINGS} == vllm_cluster.CPU_SETTINGS
    assert {k: v for k, v in vllm_cluster.ENGINE_ENV.items() if k in exported} == {
        k: v for k, v in exported.items() if k in vllm_cluster.ENGINE_ENV
    }
