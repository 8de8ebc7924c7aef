"""Transfer statistics through vLLM's KVConnectorStats: the stats object, vLLM's own logger
and Prometheus classes over it, vLLM's Scheduler adding the scheduler side, and real workers
over real tensors reporting what they moved."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import free_base_port
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from test_vllm_worker import BLOCKS, dense_caches, results, run_prefill
from vllm_kit import make_request, make_scheduler, runner_output, write_model

from rd2h.decode.layer_read import LayerStat
from rd2h.errors import TransferError
from rd2h.vllm.config import ConnectorConfig
from rd2h.vllm.connector import RD2HConnector
from rd2h.vllm.metadata import RecvSpec, SendFinish, SendSpec, StepMetadata
from rd2h.vllm.stats import RD2HStats, WorkerTally
from rd2h.vllm.worker import RD2HWorker

DECODE = {
    "pulled_bytes": 3_000_000_000, "read_time": 1.5, "pulled": 3,
    "read_batch_seconds": [0.001, 0.002, 0.003, 0.004, 0.010], "handshake_seconds": [0.02],
    "pull_failures": {"DeadlineExceeded": 1},
}  # fmt: skip
PREFILL = {"sent": 2, "send_failures": {"PeerGoneError": 1, "TransferError": 2}}
SCHEDULER = {"local": {"refused_params": 1}}
TRANSFER = SimpleNamespace(kv_connector="RD2HConnector", kv_connector_module_path="rd2h.vllm")


def test_stats_aggregate_reduce_and_reset() -> None:
    decode, other = RD2HStats(data=DECODE), RD2HStats(data={**DECODE, "pull_failures": {"PeerGoneError": 2}})
    total = decode.aggregate(other).aggregate(RD2HStats(data={**PREFILL, **SCHEDULER, "from_a_newer_rd2h": 1}))
    assert total is decode
    data = total.data
    assert data["pulled_bytes"] == 6_000_000_000 and data["pulled"] == 6 and data["read_time"] == 3.0
    assert data["read_batch_seconds"] == DECODE["read_batch_seconds"] * 2 and len(data["handshake_seconds"]) == 2
    assert data["pull_failures"] == {"DeadlineExceeded": 1, "PeerGoneError": 2}
    assert data["send_failures"] == {"PeerGoneError": 1, "TransferError": 2} and data["local"] == {"refused_params": 1}
    assert "from_a_newer_rd2h" not in data
    assert DECODE["read_batch_seconds"] == [0.001, 0.002, 0.003, 0.004, 0.010]  # payloads are not changed
    assert DECODE["pull_failures"] == {"DeadlineExceeded": 1}
    line = total.reduce()
    assert line["Pulled requests"] == 6 and line["Pulled GB"] == 6.0 and line["Read GB/s"] == 2.0
    assert line["Read batches"] == 10 and line["Avg read batch (ms)"] == 4.0 and line["P90 read batch (ms)"] == 10.0
    assert line["Failed pulls"] == 3 and line["Sent requests"] == 2 and line["Failed sends"] == 3
    assert line["Handshakes"] == 2 and line["Computed locally"] == 1
    assert not total.is_empty()
    total.reset()
    assert total.is_empty() and total.reduce() == {} and RD2HStats().is_empty()
    prefill_only = RD2HStats(data=PREFILL).reduce()
    assert (
        "Pulled requests" not in prefill_only and prefill_only["Failed sends"] == 3
    )  # a side with nothing is left out


def test_the_tally_counts_only_readiness_that_read_and_is_empty_once_taken() -> None:
    tally = WorkerTally()
    tally.on_layer(LayerStat(0, 4096, 2, 0.003, 0.004, 0))
    tally.on_layer(LayerStat(1, 0, 0, 0.0, 0.001, 1))  # its requests had failed already: nothing read
    tally.on_handshake(0.05)
    tally.pull_failed(None)
    stats = tally.take()
    assert stats.data["read_batch_seconds"] == [0.003] and stats.data["handshake_seconds"] == [0.05]
    assert stats.data["pull_failures"] == {"RD2HError": 1}
    assert tally.take() is None


def test_vllm_logger_builds_aggregates_and_logs_our_stats() -> None:
    """vLLM's KVConnectorLogging resolves the connector by name, rebuilds each payload with
    build_kv_connector_stats, sums them, and logs reduce()'s values once."""
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging

    import rd2h.vllm

    rd2h.vllm.register()
    logging = KVConnectorLogging(TRANSFER)
    logging.observe(RD2HStats(data=DECODE).to_dict())
    logging.observe(RD2HStats(data=PREFILL).to_dict())
    lines: list[str] = []
    logging.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    logging.log(log_fn=lambda fmt, *args: lines.append(fmt % args))  # reset after logging: nothing more
    assert len(lines) == 1
    assert "Pulled requests=3" in lines[0] and "Sent requests=2" in lines[0] and "Failed sends=3" in lines[0]


def prom_registry() -> tuple[CollectorRegistry, Any]:
    """vLLM's KVConnectorProm (what its Prometheus logger builds) over a registry of our own,
    two engines labelled as vLLM labels them; the metrics object our connector built."""
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm

    import rd2h.vllm

    rd2h.vllm.register()
    registry = CollectorRegistry()

    class Prom(KVConnectorProm):
        _gauge_cls = partial(Gauge, registry=registry)
        _counter_cls = partial(Counter, registry=registry)
        _histogram_cls = partial(Histogram, registry=registry)

    prom = Prom(SimpleNamespace(kv_transfer_config=TRANSFER), ["model_name", "engine"], {0: ["m", "0"], 1: ["m", "1"]})
    return registry, prom


def test_prometheus_series_are_registered_and_observed_per_engine() -> None:
    registry, prom = prom_registry()
    prom.observe(RD2HStats(data=DECODE).to_dict(), 0)
    prom.observe(RD2HStats(data={**DECODE, **PREFILL, **SCHEDULER}).to_dict(), 1)
    prom.observe(RD2HStats(data=SCHEDULER).to_dict(), 1)
    engine0, engine1 = {"model_name": "m", "engine": "0"}, {"model_name": "m", "engine": "1"}
    value = registry.get_sample_value
    assert value("vllm:rd2h_pulled_bytes_total", engine0) == 3e9
    assert value("vllm:rd2h_read_seconds_total", engine0) == 1.5
    assert value("vllm:rd2h_pulled_requests_total", engine1) == 3
    assert value("vllm:rd2h_sent_requests_total", engine0) == 0 and value("vllm:rd2h_sent_requests_total", engine1) == 2
    assert value("vllm:rd2h_pull_failures_total", {**engine0, "kind": "DeadlineExceeded"}) == 1
    assert value("vllm:rd2h_send_failures_total", {**engine1, "kind": "TransferError"}) == 2
    assert value("vllm:rd2h_send_failures_total", {**engine0, "kind": "TransferError"}) is None
    assert value("vllm:rd2h_local_recomputes_total", {**engine1, "reason": "refused_params"}) == 2
    assert value("vllm:rd2h_read_batch_seconds_count", engine0) == 5
    assert value("vllm:rd2h_read_batch_seconds_bucket", {**engine0, "le": "0.0025"}) == 2
    assert value("vllm:rd2h_read_batch_seconds_sum", engine1) == pytest.approx(0.02)
    assert value("vllm:rd2h_handshake_seconds_count", engine1) == 1


def scrape_example() -> str:
    """The series as a Decode's /metrics shows them after one interval (the example in docs/vllm.md)."""
    registry, prom = prom_registry()
    prom.observe(RD2HStats(data={**DECODE, **SCHEDULER}).to_dict(), 0)
    text = generate_latest(registry).decode()
    return "\n".join(line for line in text.splitlines() if 'engine="0"' in line and "_created" not in line)


def test_docs_list_every_series_the_scrape_shows() -> None:
    docs = (Path(__file__).parents[2] / "docs" / "vllm.md").read_text()
    names = {line.split("{")[0].removesuffix("_total") for line in scrape_example().splitlines()}
    names = {n.removesuffix("_bucket").removesuffix("_count").removesuffix("_sum") for n in names}
    series = names | {"vllm:rd2h_send_failures"}  # shown once a send failed: not in a Decode's scrape
    assert len(series) == 11 and [name for name in sorted(series) if f"`{name}" not in docs] == []


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("llama"))


def test_vllms_scheduler_adds_the_scheduler_side_to_the_workers_stats(model: Path, monkeypatch) -> None:
    """A request whose rd2h fields are not signed is computed here: vLLM's Scheduler asks our
    scheduler-side connector for its stats and sums them with what the workers returned."""
    scheduler, _ = make_scheduler(model, "kv_consumer")
    made: list[Any] = []
    monkeypatch.setattr(scheduler, "make_stats", lambda spec, kv, *a, **k: made.append(kv))
    scheduler.add_request(make_request("cmpl-9-0-abcdef12", 50, {"do_remote_prefill": True, "rd2h": "forged"}))
    out = scheduler.schedule()
    scheduler.update_from_output(out, runner_output(out, kv_connector_stats=RD2HStats(data=DECODE)))
    out = scheduler.schedule()
    scheduler.update_from_output(out, runner_output(out))  # nothing new on either side
    scheduler.connector.shutdown()
    (first, second) = made
    assert first.data["local"] == {"refused_params": 1} and first.data["pulled_bytes"] == DECODE["pulled_bytes"]
    assert second is None


@pytest.fixture
def workers() -> Iterator[tuple[RD2HWorker, RD2HWorker, dict, dict, str]]:
    """A dense Prefill worker and Decode worker over real tensors, as the worker tests build them."""
    config = ConnectorConfig.from_extra({"kv_port": free_base_port(1), "request_timeout": 30})
    src, dst = dense_caches(True), dense_caches(False)
    role = partial(RD2HWorker, config, rank=0, tp_size=1, dp_rank=0, block_sizes=[32])
    decode, prefill = role(consumer=True, producer=False), role(consumer=False, producer=True)
    try:
        decode.register(dst, {n: BLOCKS for n in dst})
        prefill.register(src, {n: BLOCKS for n in src})
        yield prefill, decode, src, dst, f"127.0.0.1:{config.kv_port}/1"
    finally:
        prefill.close()
        decode.close()


def connector_of(worker: Any) -> RD2HConnector:
    """The connector facade around a worker built by the worker tests (no vLLM process state)."""
    connector = RD2HConnector.__new__(RD2HConnector)
    connector._worker, connector._scheduler = worker, None
    return connector


def counting(sink: Any, batches: int) -> threading.Event:
    """An event set once ``sink``'s loop handled ``batches`` readiness (after the tally saw them):
    the last is observed after its request settled."""
    seen, observed = threading.Event(), sink.on_layer
    count = [0]

    def observe(stat: Any) -> None:
        if observed is not None:
            observed(stat)
        count[0] += 1
        if count[0] >= batches:
            seen.set()

    sink.on_layer = observe
    return seen


def test_real_workers_report_what_they_moved(workers) -> None:
    prefill, decode, src, dst, endpoint = workers
    layers = len(src)
    every_batch = counting(decode.sink, 2 * layers)  # two steps, each announcing every layer
    decode.bind(StepMetadata(recv=(RecvSpec("r-0", "d-req", ((9, 3, 12),), 0, 80),)))
    run_prefill(
        prefill,
        src,
        [
            StepMetadata(send_new=(SendSpec("r-0", "p-req", endpoint, ((0, 1, 2),), 80, 0),), computed=(("r-0", 64),)),
            StepMetadata(computed=(("r-0", 80),)),
            StepMetadata(send_finish=(SendFinish("r-0", "p-req", False),)),
        ],
    )
    assert results(prefill, decode) == ({"p-req"}, {"d-req"}, set())
    assert every_batch.wait(30)
    pulled = connector_of(decode).get_kv_connector_stats()
    assert pulled is not None
    block_bytes = sum(t[0].nbytes for t in dst.values())
    assert pulled.data["pulled_bytes"] == 3 * block_bytes and pulled.data["pulled"] == 1
    assert pulled.data["read_time"] > 0 and len(pulled.data["read_batch_seconds"]) == 2 * layers
    assert len(pulled.data["handshake_seconds"]) == 1 and not pulled.data["pull_failures"]
    assert connector_of(decode).get_kv_connector_stats() is None  # taken: the next interval starts empty
    sent = connector_of(prefill).get_kv_connector_stats()
    assert sent is not None and sent.data["sent"] == 1 and not sent.data["send_failures"]


def until_received(prefill: Any, decode: Any, recving: set[str]) -> tuple[set, set, set]:
    """Both workers' results, collected as vLLM does each step, until Prefill reported its
    request and Decode every one in ``recving``; each wait ends as soon as an outcome settles."""
    sending, got, failed = set(), set(), set()
    deadline = time.monotonic() + 60
    while not (sending and recving <= got):
        assert time.monotonic() < deadline, (sending, got)
        decode.sink.wait_any(0.05) or prefill.source.wait_any(0.05)
        s, _, _ = prefill.transfer_results()
        _, r, f = decode.transfer_results()
        sending, got, failed = sending | s, got | r, failed | f
    return sending, got, failed


def test_failed_pulls_are_counted_by_kind_on_both_sides_and_aborts_are_not(workers) -> None:
    prefill, decode, src, _, endpoint = workers

    def fail(*_: Any) -> None:
        raise TransferError("the link went down")

    decode.sink._engine.read_batch = fail  # the engine object the sink's reader calls (as tests/kit does)
    first_layer = counting(decode.sink, 1)
    decode.bind(StepMetadata(recv=(RecvSpec("r-0", "d-req", ((3,),), 0, 20),)))
    decode.bind(StepMetadata(recv=(RecvSpec("r-0", "d-again", ((4,),), 0, 20),)))  # the same id twice: refused
    decode.bind(StepMetadata(recv=(RecvSpec("r-1", "d-gone", ((5,),), 0, 20),)))
    decode.bind(StepMetadata(recv_abort=("r-1",)))  # the client went away: no failure of rd2h's
    run_prefill(
        prefill,
        src,
        [
            StepMetadata(send_new=(SendSpec("r-0", "p-req", endpoint, ((0,),), 20, 0),), computed=(("r-0", 20),)),
            StepMetadata(send_finish=(SendFinish("r-0", "p-req", False),)),
        ],
    )
    everyone = {"d-req", "d-again", "d-gone"}
    assert until_received(prefill, decode, everyone) == ({"p-req"}, everyone, everyone)
    assert first_layer.wait(30)
    pulled = connector_of(decode).get_kv_connector_stats()
    assert pulled.data["pull_failures"] == {"TransferError": 1, "DuplicateRequestError": 1}
    assert pulled.data["pulled"] == 0 and pulled.data["pulled_bytes"] == 0
    assert len(pulled.data["read_batch_seconds"]) == 1  # layer 0's read, tried; layer 1 reads nothing
    sent = connector_of(prefill).get_kv_connector_stats()
    assert sent.data["sent"] == 0 and sent.data["send_failures"] == {"TransferError": 1}


def test_the_connector_builds_stats_from_a_payload_that_crossed_processes() -> None:
    stats = RD2HConnector.build_kv_connector_stats(RD2HStats(data=DECODE).to_dict())
    assert isinstance(stats, RD2HStats) and stats.data["pulled"] == 3
    assert RD2HConnector.build_kv_connector_stats(None).is_empty()
