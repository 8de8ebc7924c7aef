"""bench/vllm_pd.py --at-once: the named P/D arms' proxies run with ``--prefill-at-once``, the
others in the sequential flow (one run compares the two flows over the same code). The cluster's
processes are captured, not started."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path += [str(ROOT / "bench"), str(ROOT / "tests" / "e2e")]

import vllm_cluster  # noqa: E402
import vllm_pd  # noqa: E402


class Captured:
    def __init__(self, name: str, argv: list[str], *_: Any, **__: Any) -> None:
        self.name, self.argv = name, argv
        started.append(self)

    def wait_healthy(self, *_: Any, **__: Any) -> None:
        pass

    def stop(self) -> None:
        pass


started: list[Captured] = []


def test_only_the_named_arms_proxy_sends_prefill_its_request_at_once(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setattr(vllm_cluster, "Process", Captured)
    cluster = vllm_pd._traced_cluster(tmp_path, tmp_path, tmp_path / "trace", None, None, frozenset({"proxy"}))
    try:
        cluster.ports.update({"proxy-before": 1, "proxy-before/internal": 2})
        cluster._proxy("proxy", ["decode"])
        cluster._proxy("proxy-before", ["decode"])
        argv = {p.name: p.argv for p in started}
        assert "--prefill-at-once" in argv["proxy"]
        assert "--prefill-at-once" not in argv["proxy-before"]
    finally:
        cluster.close()
