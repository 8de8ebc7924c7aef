"""Mooncake's timeouts and queue limit are process-wide: every engine a test process builds uses
these (``rd2h_mooncake._native.apply`` refuses others), the conformance suite included."""

from __future__ import annotations

from typing import Any

OPTIONS: dict[str, Any] = {"timeout": 5.0, "transfer_timeout_s": 2, "progress_timeout_s": 2}
