"""rd2h under vLLM's own ``MultiConnector`` (issue 20, item 5), over vLLM's objects: its
Scheduler, its MultiConnector in both roles, and a second connector that records what vLLM
asks of it (recording_connector.py). The specification's order rules: rd2h listed first is
called first for ``wait_for_layer_load`` and ``save_kv_layer``; it loads a request even when the
other child also has a hit; it sees the request's whole block table when the other child loads
(what vllm-ascend's ``requires_full_blocks_on_update_after_alloc`` asks for); its statistics,
worker reports, transfer results and ``kv_transfer_params`` come through the composition."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import recording_connector
import torch
from conftest import free_base_port
from recording_connector import CALLS
from vllm_kit import SECRET, Posts, make_request, make_scheduler, runner_output, write_model

from rd2h.testing.channel_suite import wait_for
from rd2h.vllm.metadata import RecvSpec, StepMetadata, WorkerReport
from rd2h.vllm.params import decode_fields, prefill_fields
from rd2h.vllm.rendezvous import RendezvousPoster
from rd2h.vllm.stats import RD2HStats

OTHER = {"kv_connector": "RecordingConnector", "kv_connector_module_path": "recording_connector"}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = write_model(tmp_path_factory.mktemp("llama"))
    (path / "rd2h.secret").write_bytes(SECRET)
    return path


@pytest.fixture(autouse=True)
def _calls() -> None:
    CALLS.clear()


def hexid(tag: str) -> str:
    return tag.encode().hex().ljust(32, "0")


def children(model: Path, role: str, *, first: str = "rd2h", hit: int = 0, params: dict | None = None,
             ours: dict | None = None) -> dict[str, Any]:
    """MultiConnector's config: rd2h and the recording connector, in the order ``first`` says."""
    rd2h = {"kv_connector": "RD2HConnector", "kv_role": role,
            "kv_connector_extra_config": {"secret_file": str(model / "rd2h.secret"), "metaserver": "http://proxy/rdv",
                                          **(ours or {})}}
    other = {**OTHER, "kv_role": role, "kv_connector_extra_config": {"hit": hit, "params": params}}
    return {"connectors": [rd2h, other] if first == "rd2h" else [other, rd2h]}


def multi_scheduler(model: Path, role: str, **kw: Any) -> tuple[Any, Any, Any, Posts]:
    """vLLM's Scheduler over MultiConnector; (scheduler, multi, rd2h's child, its posts)."""
    scheduler, _ = make_scheduler(model, role, connector="MultiConnector", extra=children(model, role, **kw))
    multi = scheduler.connector
    (ours,) = [c for c in multi._connectors if type(c).__name__ == "RD2HConnector"]
    posts = Posts()
    if ours.scheduler._poster is not None:
        ours.scheduler._poster.close()
        ours.scheduler._poster = RendezvousPoster(post=posts)
    return scheduler, multi, ours, posts


def decode_params(rid: str) -> dict[str, Any]:
    return {"do_remote_prefill": True, "rd2h": decode_fields(SECRET, hexid(rid), 1, 1, time.time())}


def test_decode_pulls_through_rd2h_listed_first_even_where_the_other_child_has_a_hit(model: Path) -> None:
    """The first child that reports tokens loads the request: rd2h, listed first, pulls it; the
    other child gets the request's real blocks with no external tokens. rd2h's worker report
    comes back wrapped in MultiConnector's worker metadata and the rendezvous is posted."""
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiKVConnectorWorkerMetadata

    scheduler, multi, ours, posts = multi_scheduler(model, "kv_consumer", hit=64)
    req = "cmpl-m1-0-abcdef12"
    scheduler.add_request(make_request(req, 100, decode_params("m1")))
    out = scheduler.schedule()
    ours_meta, other_meta = out.kv_connector_metadata.metadata
    (spec,) = ours_meta.recv
    assert spec.ext_id == f"{hexid('m1')}-0-0" and spec.first_block == 0 and len(spec.blocks[0]) == 4
    other = multi._connectors[1]
    assert other.allocated[req] == (0, [list(spec.blocks[0])])  # the real blocks, nothing to load
    assert out.total_num_scheduled_tokens == 0  # waiting for rd2h's pull, not the other child's load
    report = MultiKVConnectorWorkerMetadata(metadata=(WorkerReport({spec.ext_id: 1}), None))
    scheduler.update_from_output(out, runner_output(out, kv_connector_worker_meta=report))
    assert posts.posted.wait(10) and posts.bodies[0]["ext_id"] == spec.ext_id
    multi.shutdown()


def test_a_load_another_child_took_is_counted_and_its_claim_released(model: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """rd2h listed second: the first child's hit wins, vLLM allocates the request with no
    external tokens for rd2h. rd2h posts nothing, says so with a count, and releases the id, so
    that the same signed fields are not refused as a replay afterwards."""
    scheduler, multi, ours, posts = multi_scheduler(model, "kv_consumer", first="other", hit=64)
    req = "cmpl-m2-0-abcdef12"
    scheduler.add_request(make_request(req, 100, decode_params("m2")))
    with caplog.at_level("WARNING", logger="rd2h.vllm"):
        out = scheduler.schedule()
    assert out.kv_connector_metadata.metadata[1].recv == ()
    assert out.num_scheduled_tokens[req] == 100 - 64  # the other child loaded 64, the rest is computed
    assert "list rd2h first" in caplog.text and "(1 such requests so far)" in caplog.text
    assert ours.scheduler._claims == {}  # released
    stats = multi.get_kv_connector_stats()
    assert stats["RD2HConnector"].data["local"] == {"load_not_taken": 1}
    scheduler.update_from_output(out, runner_output(out))
    assert posts.bodies == []
    multi.shutdown()


def test_prefill_sees_every_block_when_the_other_child_loads_the_prefix(model: Path) -> None:
    """What vllm-ascend's requires_full_blocks_on_update_after_alloc asks for, under upstream's
    MultiConnector: the other child loads 64 prompt tokens, and rd2h still announces the
    request's whole block table, from block 0, with the loaded tokens counted as computed."""
    scheduler, multi, ours, _ = multi_scheduler(model, "kv_producer", hit=64)
    assert ours.requires_full_blocks_on_update_after_alloc() is True
    req = "cmpl-m3-0-abcdef12"
    targets = {0: [{"endpoint": "127.0.0.1:5600/1", "first_block": 0}]}
    params = {"do_remote_decode": True, "rd2h": prefill_fields(SECRET, hexid("m3"), 1, 1, targets, time.time())}
    scheduler.add_request(make_request(req, 100, params, max_tokens=1))
    out = scheduler.schedule()
    meta = out.kv_connector_metadata.metadata[0]
    (send,) = meta.send_new
    other = multi._connectors[1]
    assert other.allocated[req][0] == 64  # the other child was chosen to load
    assert list(send.blocks[0]) == other.allocated[req][1][0] and len(send.blocks[0]) == 4
    assert meta.computed == ((send.ext_id, 100),)  # 64 loaded + 36 computed in this step
    multi.shutdown()


def test_kv_transfer_params_of_both_children_reach_the_request(model: Path) -> None:
    """vLLM's own P/D convention on a Prefill (handoff_port): rd2h's signed params and the other
    child's come back merged in the finished request's kv_transfer_params."""
    scheduler, multi, _, _ = multi_scheduler(model, "kv_producer", params={"recorder": "here"},
                                             ours={"handoff_port": free_base_port(1)})
    req = "cmpl-m4-0-abcdef12"
    scheduler.add_request(make_request(req, 40, {"do_remote_decode": True}, max_tokens=1))
    out = scheduler.schedule()
    engine_out = scheduler.update_from_output(out, runner_output(out, sampled={req: 7}))
    (output,) = [o for outs in engine_out.values() for o in outs.outputs]
    params = output.kv_transfer_params
    assert params["recorder"] == "here" and params["do_remote_prefill"] is True and "rd2h" in params
    multi.shutdown()


def prom(vllm_config: Any) -> Any:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetric  # noqa: F401
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    registry = CollectorRegistry()

    def bound(cls: type) -> type:
        return type(cls.__name__, (cls,), {"__init__": lambda s, *a, **k: cls.__init__(s, *a, registry=registry, **k)})

    types = {Gauge: bound(Gauge), Counter: bound(Counter), Histogram: bound(Histogram)}
    return registry, MultiConnector.build_prom_metrics(vllm_config, types, ["model_name", "engine"], {0: ["m", "0"]})


@pytest.mark.parametrize("name", ["RD2HConnector", "SubclassedRD2H"])
def test_statistics_cross_processes_under_multiconnector(model: Path, name: str) -> None:
    """MultiConnector files each child's stats under its class name and, once they crossed to
    the API process as a dict, rebuilds them through vLLM's registry by that name. A subclass
    loaded by kv_connector_module_path (the tests' own) was not in the registry: the stats
    logger raised 'Connector ... is not registered' on every step."""
    from prometheus_client import generate_latest
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
        MultiConnector,
        MultiKVConnectorStats,
    )

    stats = MultiKVConnectorStats()
    stats[name] = RD2HStats(data={"pulled": 2, "pulled_bytes": 4096})
    stats.aggregate(MultiKVConnectorStats(data={name: RD2HStats(data={"local": {"load_not_taken": 1}})}))
    payload = stats.to_dict()  # what vLLM sends to the API process
    rebuilt = MultiConnector.build_kv_connector_stats(data=payload)
    assert isinstance(rebuilt[name], RD2HStats)
    assert rebuilt.reduce()[name]["Pulled requests"] == 2 and rebuilt.reduce()[name]["Computed locally"] == 1
    scheduler, _ = make_scheduler(model, "kv_consumer", connector="MultiConnector", extra=children(model, "kv_consumer"))
    config = scheduler.vllm_config
    config.kv_transfer_config.kv_connector_extra_config["connectors"][0].update(
        kv_connector=name, kv_connector_module_path="recording_connector")
    registry, metrics = prom(config)
    metrics.observe(payload, 0)
    text = generate_latest(registry).decode()
    assert 'vllm:rd2h_pulled_requests_total{engine="0",model_name="m"} 2.0' in text
    assert 'reason="load_not_taken"' in text
    scheduler.connector.shutdown()


def test_worker_hooks_reach_rd2h_first_and_its_results_come_through(model: Path, monkeypatch) -> None:
    """The worker role of MultiConnector: rd2h (listed first) is called before the other child
    for wait_for_layer_load and save_kv_layer, and its announcement (its worker's save_layer)
    has happened by the time the other child sees the layer. Its worker report and transfer
    results come back through MultiConnector's."""
    import vllm.distributed.parallel_state as parallel_state
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
        MultiConnector,
        MultiKVConnectorMetadata,
    )

    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: 0)
    scheduler, _ = make_scheduler(model, "kv_both", connector="MultiConnector",
                                  extra=children(model, "kv_both", ours={"kv_port": free_base_port(1), "request_timeout": 0.5}))
    config, kv_config = scheduler.vllm_config, scheduler.kv_cache_config
    scheduler.connector.shutdown()
    multi = MultiConnector(config, KVConnectorRole.WORKER, kv_config)
    ours = multi._connectors[0]
    try:
        layers = kv_config.kv_cache_groups[0].layer_names
        caches = {name: torch.zeros(kv_config.num_blocks, 2, 32, 64) for name in layers}
        multi.register_kv_caches(caches)
        save = ours.worker.save_layer
        monkeypatch.setattr(ours.worker, "save_layer", lambda n, t: (CALLS.append(("rd2h", "save_kv_layer", n)),
                                                                     save(n, t)))
        monkeypatch.setattr(ours, "wait_for_layer_load", lambda n: CALLS.append(("rd2h", "wait_for_layer_load", n)))
        ext = f"{hexid('w1')}-0-0"
        step = StepMetadata(recv=(RecvSpec(ext, "cmpl-w1-0-abcdef12", ((0, 1),), 0, 40),))
        multi.bind_connector_metadata(MultiKVConnectorMetadata(metadata=(step, KVConnectorMetadata())))
        for name in layers:
            multi.wait_for_layer_load(name)
            multi.save_kv_layer(name, caches[name], None)
        hooks = [call for call in CALLS if call[1] in ("wait_for_layer_load", "save_kv_layer")]
        assert hooks == [(who, hook, name) for name in layers for hook in ("wait_for_layer_load", "save_kv_layer")
                         for who in ("rd2h", "other")]
        assert not hasattr(MultiConnector, "on_kv_cache_written")  # vllm-ascend's own MultiConnector calls it
        report = multi.build_connector_worker_meta()
        assert report.metadata == (WorkerReport({ext: 1}), None)
        multi.clear_connector_metadata()
        # no Prefill ever announces it: the pull fails at its request_timeout, and the failure comes
        # back through MultiConnector's transfer results (per request; no flat block set on 0.32)
        results = wait_for(lambda: (r := multi.get_transfer_results(set())).failed_recving and r or None, 30)
        assert results is not None, "the pull never failed"
        assert results.failed_recving == {"cmpl-w1-0-abcdef12"} <= results.finished_recving
        assert multi.get_block_ids_with_load_errors() == set()
    finally:
        multi.shutdown()
    assert recording_connector.CALLS is CALLS


def test_a_load_vllm_itself_drops_is_counted_too(model: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Without MultiConnector: vLLM asks rd2h for matched tokens, then ignores them for a request
    that skips reading cached prefixes (prompt_logprobs sets it). rd2h said so nowhere and kept the
    id claimed; now it warns, counts and releases it."""
    scheduler, _ = make_scheduler(model, "kv_consumer")
    ours = scheduler.connector
    request = make_request("cmpl-m5-0-abcdef12", 100, decode_params("m5"))
    request.skip_reading_prefix_cache = True  # what vLLM sets for prompt_logprobs
    scheduler.add_request(request)
    with caplog.at_level("WARNING", logger="rd2h.vllm"):
        out = scheduler.schedule()
    assert out.kv_connector_metadata.recv == () and out.num_scheduled_tokens[request.request_id] == 100
    assert "vLLM's scheduler dropped the load" in caplog.text and ours.scheduler._claims == {}
    assert ours.get_kv_connector_stats().data["local"] == {"load_not_taken": 1}
    ours.shutdown()
