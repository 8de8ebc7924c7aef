"""Registration, the rendezvous poster, and the optional hooks other vLLM builds call."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from vllm_kit import SECRET, make_request, make_scheduler, runner_output, write_model

from rd2h.vllm.metadata import StepMetadata, WorkerReport
from rd2h.vllm.params import decode_fields, ext_id, prompt_index, sample_index
from rd2h.vllm.rendezvous import RendezvousPoster


def test_registration_is_idempotent_and_the_module_path_works() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    import rd2h.vllm
    from rd2h.vllm.connector import RD2HConnector

    rd2h.vllm.register()
    rd2h.vllm.register()  # plugins load in several processes, some more than once
    config = type("T", (), {"kv_connector": "RD2HConnector", "kv_connector_module_path": None})()
    assert KVConnectorFactory.get_connector_class(config) is RD2HConnector
    config.kv_connector_module_path = "rd2h.vllm"
    assert KVConnectorFactory.get_connector_class(config) is RD2HConnector


def test_poster_retries_transport_errors_and_counts_http_errors_as_delivered() -> None:
    calls: list[str] = []
    done = threading.Event()

    def post(url: str, body: Any) -> int:
        calls.append(body["ext_id"])
        if len(calls) < 3:
            raise ConnectionError("refused")
        if body["ext_id"] == "b":
            done.set()
        return 404 if body["ext_id"] == "a" else 200

    poster = RendezvousPoster(post=post, retries=5, backoff=0.001)
    poster.submit("a", "http://m", {"ext_id": "a"})
    poster.submit("b", "http://m", {"ext_id": "b"})
    assert done.wait(5)
    poster.close()
    assert calls == ["a", "a", "a", "b"] and list(poster.recent) == ["a", "b"]


def test_poster_cancel_and_close_drop_what_is_not_posted() -> None:
    release = threading.Event()
    calls: list[str] = []

    def post(url: str, body: Any) -> int:
        calls.append(body["ext_id"])
        release.wait(5)
        return 200

    poster = RendezvousPoster(post=post)
    poster.submit("a", "u", {"ext_id": "a"})
    poster.submit("b", "u", {"ext_id": "b"})
    poster.cancel("b")
    poster.submit("c", "u", {"ext_id": "c"})
    release.set()
    poster.close()  # c may or may not have gone; b never does
    assert "b" not in calls


def test_prompt_and_sample_of_an_engine_request() -> None:
    """vLLM names prompt-list children <id>-<i>-<8 chars> and the samples of n <k>_<that>."""
    assert prompt_index("chatcmpl-abc-12345678", 1) == 0
    assert prompt_index("cmpl-abc-2-12345678", 3) == 2
    assert sample_index("1_cmpl-abc-2-12345678", 2) == 1 and sample_index("cmpl-abc-12345678", 1) == 0
    assert ext_id("ab", 1, 0) == "ab-1-0"
    for bad in (lambda: prompt_index("cmpl-abc-7-12345678", 2), lambda: sample_index("cmpl-abc-12345678", 2),
                lambda: sample_index("5_cmpl-abc-12345678", 2)):
        with pytest.raises(ValueError):
            bad()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("llama"))


def test_first_child_of_upstream_multiconnector(model: Path) -> None:
    """Listed first under MultiConnector, rd2h's Decode flow runs unchanged."""
    (model / "rd2h.secret").write_bytes(SECRET)
    ours_config = {"secret_file": str(model / "rd2h.secret"), "metaserver": "http://x"}
    extra = {"connectors": [{"kv_connector": "RD2HConnector", "kv_role": "kv_consumer",
                             "kv_connector_extra_config": ours_config},
                            {"kv_connector": "ExampleConnector", "kv_role": "kv_consumer",
                             "kv_connector_extra_config": {"shared_storage_path": str(model / "store")}}]}
    from vllm.config import KVTransferConfig  # noqa: F401 - vLLM must accept the nesting

    scheduler, _ = make_scheduler(model, "kv_consumer", connector="MultiConnector", extra=extra)
    ours = scheduler.connector._connectors[0]
    rid = "6d" * 16
    params = {"do_remote_prefill": True, "rd2h": decode_fields(SECRET, rid, 1, 1, time.time())}
    scheduler.add_request(make_request("cmpl-m-0-abcdef12", 70, params))
    out = scheduler.schedule()
    metas = out.kv_connector_metadata.metadata
    assert isinstance(metas[0], StepMetadata) and [s.ext_id for s in metas[0].recv] == [f"{rid}-0-0"]
    assert out.total_num_scheduled_tokens == 0
    scheduler.update_from_output(out, runner_output(out, kv_connector_worker_meta=None))
    ours.shutdown()


def test_vllm_ascend_hooks(model: Path) -> None:
    scheduler, _ = make_scheduler(model, "kv_consumer")
    connector = scheduler.connector
    assert connector.requires_full_blocks_on_update_after_alloc() is True
    report = WorkerReport({"a": 1}).aggregate(WorkerReport({"a": 1, "b": 1}))
    assert report.expected == {"a": 2, "b": 1}
    connector.shutdown()


def test_dense_gqa_with_unequal_tp_is_refused_at_startup_only_where_heads_cannot_split(model: Path) -> None:
    """The tiny model has 2 KV heads: a peer of TP 2 or 4 splits them as vLLM does (Decode reads
    head ranges of blocks, rd2h.layout.heads); TP 3 cannot run the model at all."""
    from rd2h.errors import ConfigError

    with pytest.raises(ConfigError, match="2 KV heads cannot be split over peer_tp's TP 3"):
        make_scheduler(model, "kv_consumer", extra={"peer_tp": 3})
    for peer in (1, 2, 4):
        scheduler, _ = make_scheduler(model, "kv_consumer", extra={"peer_tp": peer})
        scheduler.connector.shutdown()
