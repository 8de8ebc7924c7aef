"""rd2h's vLLM integration: the ``RD2HConnector`` KV connector (vLLM imported only here).

Load it by name once the ``vllm.general_plugins`` entry point registered it
(``kv_connector="RD2HConnector"``), or by module: ``kv_connector_module_path="rd2h.vllm"``.
Importing this package imports vLLM; :func:`register` imports nothing until vLLM asks.
"""

from __future__ import annotations

from typing import Any

__all__ = ["RD2HConnector", "register"]

CONNECTOR_NAME = "RD2HConnector"


def register() -> None:
    """``vllm.general_plugins`` entry point: register the connector by name, lazily.

    vLLM loads plugins in every process it starts (and some more than once), and its
    registry raises on a duplicate name, so a name already there is left alone.
    """
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    registry = getattr(KVConnectorFactory, "_registry", {})
    if CONNECTOR_NAME in registry:
        return
    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "rd2h.vllm.connector", "RD2HConnector")
    except ValueError:  # registered by another thread or a differently named registry
        pass


def __getattr__(name: str) -> Any:
    # kv_connector_module_path="rd2h.vllm" looks the class up here; import vLLM only then
    if name == "RD2HConnector":
        from rd2h.vllm.connector import RD2HConnector

        return RD2HConnector
    raise AttributeError(name)
