"""On a failed end-to-end test, the tails of every engine's and the proxy's log go into the
report: a 500 from an engine says nothing by itself, and CI keeps no temporary files."""

from __future__ import annotations

from typing import Any

import pytest
from vllm_cluster import live_clusters


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Any:
    report = yield
    if report.failed:
        for cluster in live_clusters():
            for name, tail in cluster.log_tails(lines=80).items():
                report.sections.append((f"log {name}", tail))
    return report
