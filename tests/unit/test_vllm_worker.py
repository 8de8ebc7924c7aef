"""The connector's worker side over real tensors: a Prefill worker and a Decode worker in
one process, the local engine and zmq on loopback, fed the metadata the scheduler side
builds. Covers both main modes' data paths (``sfa`` cannot run attention on CPU vLLM)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from functools import partial

import pytest
import torch
from conftest import free_base_port
from rd2h_test_connector import HookedWorker

from rd2h.errors import ConfigError
from rd2h.vllm.config import ConnectorConfig, Mode
from rd2h.vllm.metadata import RecvSpec, SendBlocks, SendFinish, SendSpec, StepMetadata
from rd2h.vllm.worker import IDLE_WAIT_SECONDS, RD2HWorker, split_layers

BLOCKS = 16


def dense_caches(fill: bool) -> dict[str, torch.Tensor]:
    """CPU vLLM's layout: one [blocks, kv_heads, block_size, 2*head_size] tensor per layer."""
    make = torch.randn if fill else torch.zeros
    return {f"model.layers.{i}.self_attn.attn": make(BLOCKS, 2, 32, 64) for i in range(2)}


def sfa_caches(fill: bool) -> dict[str, torch.Tensor]:
    """MLA latent cache per layer plus the sparse indexer's own cache (another KV cache group)."""
    make = torch.randn if fill else torch.zeros
    caches = {}
    for i in range(2):
        caches[f"model.layers.{i}.self_attn.attn"] = make(BLOCKS, 32, 576)
        caches[f"model.layers.{i}.self_attn.indexer.k_cache"] = make(BLOCKS, 32, 132)
    return caches


@pytest.fixture
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[RD2HWorker, RD2HWorker, dict, dict, str]]:
    mode, hooks = request.param  # hooks: the test-only worker's (tests/kit/vllm/rd2h_test_connector.py)
    config = ConnectorConfig.from_extra({"kv_port": free_base_port(2), "mode": mode, "request_timeout": 30})
    make = dense_caches if mode == "dense" else sfa_caches
    src, dst = make(True), make(False)
    sizes = [32] if mode == "dense" else [32, 32]
    worker = partial(HookedWorker, **hooks) if hooks else RD2HWorker
    decode = worker(config, consumer=True, producer=False, rank=0, tp_size=1, dp_rank=0, block_sizes=sizes)
    prefill = RD2HWorker(config, consumer=False, producer=True, rank=0, tp_size=1, dp_rank=0, block_sizes=sizes)
    try:
        decode.register(dst, {n: BLOCKS for n in dst})
        prefill.register(src, {n: BLOCKS for n in src})
        yield prefill, decode, src, dst, f"127.0.0.1:{config.kv_port}/1"
    finally:
        prefill.close()
        decode.close()


def run_prefill(prefill: RD2HWorker, src: dict, steps: list[StepMetadata]) -> None:
    for meta in steps:
        prefill.bind(meta)
        for name, tensor in src.items():
            prefill.save_layer(name, tensor)
        prefill.step_done()


def results(prefill: RD2HWorker, decode: RD2HWorker, timeout: float = 60.0) -> tuple[set, set, set]:
    """Poll both workers as vLLM does each step, until each reported something (bounded)."""
    sending: set[str] = set()
    recving: set[str] = set()
    failed: set[str] = set()
    tick = threading.Event()
    deadline = time.monotonic() + timeout
    while not (sending and recving):
        assert time.monotonic() < deadline, (sending, recving)
        s, _, _ = prefill.transfer_results()
        _, r, f = decode.transfer_results()
        sending |= s
        recving |= r
        failed |= f
        tick.wait(0.01)
    return sending, recving, failed


DENSE = [("dense", {})]


@pytest.mark.parametrize("pair", DENSE, indirect=True)
def test_dense_chunks_land_in_the_destination_blocks(pair) -> None:
    prefill, decode, src, dst, endpoint = pair
    decode.bind(StepMetadata(recv=(RecvSpec("r-0", "d-req", ((9, 3, 12),), 0, 80),)))
    assert decode.worker_report().expected == {"r-0": 1}  # what the scheduler waits for
    run_prefill(prefill, src, [
        StepMetadata(send_new=(SendSpec("r-0", "p-req", endpoint, ((0, 1),), 80, 0),), computed=(("r-0", 64),)),
        StepMetadata(send_blocks=(SendBlocks("r-0", ((2,),)),), computed=(("r-0", 80),)),
        StepMetadata(send_finish=(SendFinish("r-0", "p-req", False),)),
    ])
    assert results(prefill, decode) == ({"p-req"}, {"d-req"}, set())
    for name in src:
        assert torch.equal(dst[name][[9, 3, 12]], src[name][[0, 1, 2]])
        untouched = [b for b in range(BLOCKS) if b not in (9, 3, 12)]
        assert not dst[name][untouched].any()


@pytest.mark.parametrize("pair", DENSE, indirect=True)
def test_dense_prefix_hit_pulls_only_the_tail(pair) -> None:
    prefill, decode, src, dst, endpoint = pair
    decode.bind(StepMetadata(recv=(RecvSpec("r-0", "d-req", ((4, 5, 6),), 2, 80),)))
    run_prefill(prefill, src, [
        StepMetadata(send_new=(SendSpec("r-0", "p-req", endpoint, ((7, 8, 9),), 80, 2),), computed=(("r-0", 80),)),
        StepMetadata(send_finish=(SendFinish("r-0", "p-req", False),)),
    ])
    assert results(prefill, decode) == ({"p-req"}, {"d-req"}, set())
    for name in src:
        assert torch.equal(dst[name][6], src[name][9])
        assert not dst[name][[4, 5]].any()  # Decode's own prefix: not written


@pytest.mark.parametrize("pair", [("sfa", {})], indirect=True)
def test_sfa_main_and_indexer_groups_land_separately(pair) -> None:
    prefill, decode, src, dst, endpoint = pair
    decode.bind(StepMetadata(recv=(RecvSpec("r-0", "d-req", ((1, 2), (14, 15)), 0, 50),)))
    run_prefill(prefill, src, [
        StepMetadata(send_new=(SendSpec("r-0", "p-req", endpoint, ((5, 6), (10, 11)), 50, 0),), computed=(("r-0", 50),)),
        StepMetadata(send_finish=(SendFinish("r-0", "p-req", False),)),
    ])
    assert results(prefill, decode) == ({"p-req"}, {"d-req"}, set())
    for i in range(2):
        attn, indexer = f"model.layers.{i}.self_attn.attn", f"model.layers.{i}.self_attn.indexer.k_cache"
        assert torch.equal(dst[attn][[1, 2]], src[attn][[5, 6]])
        assert torch.equal(dst[indexer][[14, 15]], src[indexer][[10, 11]])


@pytest.mark.parametrize("pair", [("dense", {"corrupt": True})], indirect=True)
def test_corruption_hook_changes_what_arrived(pair) -> None:
    prefill, decode, src, dst, endpoint = pair
    decode.bind(StepMetadata(recv=(RecvSpec("r-0", "d-req", ((3,),), 0, 20),)))
    run_prefill(prefill, src, [
        StepMetadata(send_new=(SendSpec("r-0", "p-req", endpoint, ((0,),), 20, 0),), computed=(("r-0", 20),)),
        StepMetadata(send_finish=(SendFinish("r-0", "p-req", False),)),
    ])
    results(prefill, decode)
    assert not torch.equal(dst["model.layers.0.self_attn.attn"][3], src["model.layers.0.self_attn.attn"][0])


@pytest.mark.parametrize("pair", DENSE, indirect=True)
def test_decode_abort_is_reported_finished_and_failed(pair) -> None:
    decode = pair[1]
    decode.bind(StepMetadata(recv=(RecvSpec("r-0", "d-req", ((3,),), 0, 20),)))
    decode.bind(StepMetadata(recv_abort=("r-0",)))
    _, recving, failed = decode.transfer_results()
    assert recving == {"d-req"}  # vLLM frees its blocks
    assert failed == {"d-req"}
    assert decode.load_errors() == {3} and decode.load_errors() == set()  # for a vLLM without failed_recving, once


@pytest.mark.parametrize("pair", DENSE, indirect=True)
def test_blocks_freed_by_an_abort_may_go_to_a_new_request_in_the_same_step(pair) -> None:
    """vLLM frees an aborted request's blocks at once and may give them to a new request in
    the very next step, whose metadata carries both: the abort is applied first, so the new
    request is expected (it was refused as "block held by live request", and failed)."""
    decode = pair[1]
    decode.bind(StepMetadata(recv=(RecvSpec("old-0", "old-req", ((3, 4),), 0, 40),)))
    decode.bind(StepMetadata(recv=(RecvSpec("new-0", "new-req", ((4, 3),), 0, 40),), recv_abort=("old-0",)))
    _, recving, failed = decode.transfer_results()
    assert recving == {"old-req"} and failed == {"old-req"}  # only the aborted one
    assert decode.sink.abort("new-0")  # live on the sink: it was expected


@pytest.mark.parametrize("pair", DENSE, indirect=True)
def test_prefill_abort_before_decode_replied_is_still_reported(pair) -> None:
    prefill, _, src, _, endpoint = pair
    run_prefill(prefill, src, [
        StepMetadata(send_new=(SendSpec("r-9", "p-req", endpoint, ((0, 1),), 64, 0),), computed=(("r-9", 32),)),
        StepMetadata(send_finish=(SendFinish("r-9", "p-req", True),)),
    ])
    deadline = time.monotonic() + 40
    sending: set[str] = set()
    while not sending:  # Decode never expected r-9: it refuses it; Prefill settles it
        assert time.monotonic() < deadline
        sending, _, _ = prefill.transfer_results()
        threading.Event().wait(0.01)
    assert sending == {"p-req"}


def test_split_layers_skips_shared_caches_and_splits_kv_pairs() -> None:
    owner = torch.zeros(2, BLOCKS, 32, 64)
    layers = split_layers({"a": owner, "b": owner, "c": torch.zeros(BLOCKS, 4, 8)}, {"a": BLOCKS, "b": BLOCKS, "c": BLOCKS},
                          Mode.DENSE)
    assert list(layers) == ["a", "c"] and len(layers["a"].main) == 2
    with pytest.raises(ConfigError):
        split_layers({"x": torch.zeros(3, 5)}, {"x": BLOCKS}, Mode.DENSE)
    with pytest.raises(ConfigError, match="indexer"):
        split_layers({"m.indexer.k_cache": torch.zeros(BLOCKS, 4)}, {"m.indexer.k_cache": BLOCKS}, Mode.SFA)


def test_config_refuses_unknown_keys_and_modes() -> None:
    with pytest.raises(ConfigError, match="kv_prot"):
        ConnectorConfig.from_extra({"kv_prot": 1})
    with pytest.raises(ConfigError, match="mode"):
        ConnectorConfig.from_extra({"mode": "sparse"})
    for hook in ("test_corrupt", "_test_corrupt", "_test_hold_file"):  # test hooks live in tests/kit, not here
        with pytest.raises(ConfigError, match="unknown"):
            ConnectorConfig.from_extra({hook: True})
    assert ConnectorConfig.from_extra({"mode": "sfa"}).mode is Mode.SFA


def _workers(config: ConnectorConfig, *, role: str, tp: int, caches: list[dict], sizes: list[int]) -> list[RD2HWorker]:
    workers = []
    for rank in range(tp):
        worker = RD2HWorker(config, consumer=role == "decode", producer=role == "prefill", rank=rank, tp_size=tp,
                            dp_rank=0, block_sizes=sizes)
        workers.append(worker)
        worker.register(caches[rank], {n: BLOCKS for n in caches[rank]})
    return workers


def _settle(prefills: list[RD2HWorker], decodes: list[RD2HWorker], timeout: float = 60.0) -> tuple[list, list]:
    sent: list[set] = [set() for _ in prefills]
    got: list[set] = [set() for _ in decodes]
    deadline = time.monotonic() + timeout
    while not (all(sent) and all(got)):
        assert time.monotonic() < deadline, (sent, got)
        for i, w in enumerate(prefills):
            sent[i] |= w.transfer_results()[0]
        for i, w in enumerate(decodes):
            _, recving, failed = w.transfer_results()
            assert not failed
            got[i] |= recving
        threading.Event().wait(0.01)
    return sent, got


def _mla_caches(fill: bool) -> dict[str, torch.Tensor]:
    make = torch.randn if fill else torch.zeros
    return {f"model.layers.{i}.self_attn.attn": make(BLOCKS, 32, 576) for i in range(2)}


def test_dense_mla_prefill_tp2_to_decode_tp1() -> None:
    """MLA's latent is replicated on every Prefill rank: the two contributors split the
    blocks and Decode's single rank gets every one (``main_split="replicated"``)."""
    config = ConnectorConfig.from_extra({"kv_port": free_base_port(2), "request_timeout": 30})
    src = _mla_caches(True)
    prefills = _workers(config, role="prefill", tp=2, caches=[src, src], sizes=[32])
    decodes = _workers(config, role="decode", tp=1, caches=[_mla_caches(False)], sizes=[32])
    try:
        endpoint = f"127.0.0.1:{config.kv_port}/1"
        decodes[0].bind(StepMetadata(recv=(RecvSpec("r-0", "d", ((2, 4, 6, 8, 10),), 0, 150),)))
        for p in prefills:
            run_prefill(p, src, [
                StepMetadata(send_new=(SendSpec("r-0", "p", endpoint, ((0, 1, 3, 5, 7),), 150, 0),), computed=(("r-0", 150),)),
                StepMetadata(send_finish=(SendFinish("r-0", "p", False),)),
            ])
        _settle(prefills, decodes)
        dst = decodes[0]._tensors
        for name in src:
            assert torch.equal(dst[name].main[0][[2, 4, 6, 8, 10]], src[name][[0, 1, 3, 5, 7]])
    finally:
        for w in prefills + decodes:
            w.close()


def test_sfa_prefill_tp1_to_decode_tp2_shared_main_pool() -> None:
    """sfa: the Decode ranks map one main pool and read disjoint shares of it; each rank's
    own indexer cache gets the whole indexer."""
    config = ConnectorConfig.from_extra({"kv_port": free_base_port(2), "mode": "sfa", "request_timeout": 30})
    src = sfa_caches(True)
    pool = sfa_caches(False)
    ranks = [dict(pool), dict(pool)]
    for rank in ranks:  # the indexer is rank-local; main is the one shared pool
        for name in list(rank):
            if name.endswith("indexer.k_cache"):
                rank[name] = torch.zeros(BLOCKS, 32, 132)
    prefills = _workers(config, role="prefill", tp=1, caches=[src], sizes=[32, 32])
    decodes = _workers(config, role="decode", tp=2, caches=ranks, sizes=[32, 32])
    try:
        endpoint = f"127.0.0.1:{config.kv_port}/2"
        for d in decodes:
            d.bind(StepMetadata(recv=(RecvSpec("r-0", "d", ((1, 2, 3, 4), (9, 10, 11, 12)), 0, 128),)))
        run_prefill(prefills[0], src, [
            StepMetadata(send_new=(SendSpec("r-0", "p", endpoint, ((5, 6, 7, 8), (0, 1, 2, 3)), 128, 0),),
                         computed=(("r-0", 128),)),
            StepMetadata(send_finish=(SendFinish("r-0", "p", False),)),
        ])
        _settle(prefills, decodes)
        for i in range(2):
            attn, indexer = f"model.layers.{i}.self_attn.attn", f"model.layers.{i}.self_attn.indexer.k_cache"
            assert torch.equal(pool[attn][[1, 2, 3, 4]], src[attn][[5, 6, 7, 8]])
            for rank in ranks:
                assert torch.equal(rank[indexer][[9, 10, 11, 12]], src[indexer][[0, 1, 2, 3]])
    finally:
        for w in prefills + decodes:
            w.close()


@pytest.mark.parametrize("pair", DENSE, indirect=True)
def test_prefill_send_aborted_on_preemption_is_not_reported(pair) -> None:
    prefill, _, src, _, endpoint = pair
    run_prefill(prefill, src, [
        StepMetadata(send_new=(SendSpec("r-7", "p-req", endpoint, ((0, 1),), 64, 0),), computed=(("r-7", 32),)),
        StepMetadata(send_abort=("r-7",)),
    ])
    deadline = time.monotonic() + 40
    while "r-7" in prefill._forget:  # its outcome arrives and is dropped
        assert time.monotonic() < deadline
        assert prefill.transfer_results() == (set(), set(), set())
        threading.Event().wait(0.01)


@pytest.mark.parametrize("pair", DENSE, indirect=True)
def test_vllm_ascend_hooks_announce_and_gate_layers(pair) -> None:
    """vllm-ascend calls ``wait_for_layer_send`` before it overwrites a layer and
    ``on_kv_cache_written`` after; through the connector they announce as ``save_kv_layer``
    does, and a second step on the same layer never waits for Decode (no slot is reused)."""
    from rd2h.vllm.connector import RD2HConnector

    prefill, decode, src, dst, endpoint = pair
    connector = object.__new__(RD2HConnector)  # a worker-role connector around our worker
    connector._worker, connector._scheduler, connector._connector_metadata = prefill, None, None
    decode.bind(StepMetadata(recv=(RecvSpec("r-0", "d-req", ((3, 4),), 0, 64),)))
    steps = [
        StepMetadata(send_new=(SendSpec("r-0", "p-req", endpoint, ((0,),), 64, 0),), computed=(("r-0", 32),)),
        StepMetadata(send_blocks=(SendBlocks("r-0", ((1,),)),), computed=(("r-0", 64),)),
        StepMetadata(send_finish=(SendFinish("r-0", "p-req", False),)),
    ]
    for meta in steps:
        connector.bind_connector_metadata(meta)
        for name, tensor in src.items():
            connector.wait_for_layer_send(name)
            connector.on_kv_cache_written(name, tensor)
        connector.clear_connector_metadata()
    assert results(prefill, decode) == ({"p-req"}, {"d-req"}, set())
    for name in src:
        assert torch.equal(dst[name][[3, 4]], src[name][[0, 1]])


@pytest.mark.parametrize("pair", DENSE, indirect=True)
def test_an_idle_step_waits_for_a_transfer_and_a_busy_one_does_not(pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM steps again at once after a step that computed nothing; with a pull in flight such
    a step waits (bounded) on the sink for an outcome instead, so an idle Decode does not spin
    through empty steps. A step that computes something never waits."""
    decode = pair[1]
    waits: list[float] = []
    monkeypatch.setattr(decode.sink, "wait_any", lambda timeout: waits.append(timeout) or False)
    decode.bind(StepMetadata(recv=(RecvSpec("r-0", "d-req", ((3,),), 0, 20),)))  # a step with work
    decode.transfer_results()
    assert waits == []
    decode.bind(StepMetadata(idle=True))
    decode.transfer_results()
    assert waits == [IDLE_WAIT_SECONDS]
    decode.bind(StepMetadata(recv_abort=("r-0",)))  # nothing in flight after this step
    decode.transfer_results()
    decode.bind(StepMetadata(idle=True))
    decode.transfer_results()
    assert waits == [IDLE_WAIT_SECONDS]


@pytest.mark.parametrize("pair", DENSE, indirect=True)
def test_an_idle_step_that_expects_a_request_reports_it_without_waiting(pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """The step that hands Decode's workers a new request computes nothing (the request waits
    for its KV), and vLLM collects the transfer results before the worker's report. The
    scheduler posts the rendezvous, which starts Prefill, only once it has that report: the
    step must not wait for a transfer first (it cost every P/D request IDLE_WAIT_SECONDS of
    TTFT). The next idle step, with the pull in flight, waits as before."""
    decode = pair[1]
    waits: list[float] = []
    monkeypatch.setattr(decode.sink, "wait_any", lambda timeout: waits.append(timeout) or False)
    decode.bind(StepMetadata(recv=(RecvSpec("r-0", "d-req", ((3,),), 0, 20),), idle=True))
    decode.transfer_results()  # vLLM's order: transfer results, then the worker's report
    assert waits == []
    assert decode.worker_report().expected == {"r-0": 1}
    decode.bind(StepMetadata(idle=True))
    decode.transfer_results()
    assert waits == [IDLE_WAIT_SECONDS]
    assert decode.worker_report() is None


@pytest.mark.parametrize("pair", DENSE, indirect=True)
def test_bad_requests_fail_alone_in_every_hook_and_the_engine_serves_on(pair) -> None:
    """What used to escape bind_connector_metadata and kill the engine: a port past 65535, a
    first block of -5, a duplicate id, an endpoint that is not one. Each fails its own request
    (reported finished so vLLM frees it); the good request of the same step is pulled."""
    from rd2h.vllm.connector import RD2HConnector

    prefill, decode, src, dst, endpoint = pair
    connector = object.__new__(RD2HConnector)
    connector._worker, connector._scheduler, connector._connector_metadata = prefill, None, None
    decode.bind(StepMetadata(recv=(RecvSpec("ok", "d-ok", ((5,),), 0, 20),)))
    decode.bind(StepMetadata(recv=(RecvSpec("ok", "d-dup", ((6,),), 0, 20),)))  # a second request, same id
    bad = [
        SendSpec("port", "p-port", "127.0.0.1:65535/2", ((0,),), 20, 0),  # Decode rank 1 would be 65536
        SendSpec("neg", "p-neg", endpoint, ((0,),), 20, -5),
        SendSpec("junk", "p-junk", "not an endpoint", ((0,),), 20, 0),
        SendSpec("ok", "p-ok", endpoint, ((1,),), 20, 0),
        SendSpec("ok", "p-dup", endpoint, ((2,),), 20, 0),  # the same id again
    ]
    steps = [
        StepMetadata(send_new=tuple(bad), computed=tuple((s.ext_id, 20) for s in bad)),
        StepMetadata(send_finish=tuple(SendFinish(s.ext_id, s.req_id, False) for s in bad[:4])),
    ]
    for meta in steps:
        connector.bind_connector_metadata(meta)  # never raises
        for name, tensor in src.items():
            connector.save_kv_layer(name, tensor, None)
        connector.clear_connector_metadata()
    sending: set[str] = set()
    recving: set[str] = set()
    failed: set[str] = set()
    deadline = time.monotonic() + 60
    while not ({"p-port", "p-neg", "p-junk", "p-ok"} <= sending and "d-ok" in recving):
        assert time.monotonic() < deadline, (sending, recving)
        sending |= prefill.transfer_results()[0]
        _, r, f = decode.transfer_results()
        recving, failed = recving | r, failed | f
        threading.Event().wait(0.01)
    assert "d-dup" in failed and "d-ok" not in failed
    for name in src:
        assert torch.equal(dst[name][5], src[name][1])  # the good one, from its own source block


@pytest.mark.parametrize("pair", DENSE, indirect=True)
def test_one_prefill_request_serves_every_sample_and_is_finished_after_the_last(pair) -> None:
    """n=2: Prefill computed the prompt once; two Decode requests pull it from the same source
    blocks, and vLLM may free those blocks only once both are done."""
    prefill, decode, src, dst, endpoint = pair
    decode.bind(StepMetadata(recv=(RecvSpec("s-0", "d-0", ((3,),), 0, 20), RecvSpec("s-1", "d-1", ((4,),), 0, 20))))
    specs = (SendSpec("s-0", "p-req", endpoint, ((0,),), 20, 0), SendSpec("s-1", "p-req", endpoint, ((0,),), 20, 0))
    run_prefill(prefill, src, [
        StepMetadata(send_new=specs, computed=(("s-0", 20), ("s-1", 20))),
        StepMetadata(send_finish=(SendFinish("s-0", "p-req", False), SendFinish("s-1", "p-req", False))),
    ])
    sending: set[str] = set()
    recving: set[str] = set()
    deadline = time.monotonic() + 60
    while not (sending and recving == {"d-0", "d-1"}):
        assert time.monotonic() < deadline, (sending, recving)
        sending |= prefill.transfer_results()[0]
        recving |= decode.transfer_results()[1]
        threading.Event().wait(0.01)
    assert sending == {"p-req"} and not prefill._send_exts  # reported once, after both samples
    for name in src:
        assert torch.equal(dst[name][3], src[name][0]) and torch.equal(dst[name][4], src[name][0])
