"""bench/pd_hops.py: a P/D request's TTFT cut at the marks of the client, the proxy and both engines."""

from __future__ import annotations

import pd_hops
import pytest

TAG = "pd3-abc123"
RID = "f" * 32


def _record(origin: float) -> dict:
    t = {"begun": 0.2, "decode_sent": 1.0, "rendezvous_0": 12.0, "prefill_sent": 13.0, "first_byte": 90.0}
    return {"id": RID, "x_request_id": TAG, "t_origin": origin, "t": t}


def _events(origin: float) -> tuple[list[dict], list[dict]]:
    at = lambda ms: origin + ms / 1e3  # noqa: E731
    vid = f"cmpl-{TAG}-0-1234abcd"
    decode = [
        {"t": at(-500), "ev": "matched", "id": f"cmpl-warm-{TAG}-0-00000000"},  # a tag that contains ours
        {"t": at(5.0), "ev": "matched", "id": vid}, {"t": at(5.5), "ev": "alloc", "id": vid},
        {"t": at(10.0), "ev": "posted", "id": None, "ext": f"{RID}-0-0"},
        {"t": at(30.0), "ev": "layer<", "id": None, "exts": [f"{RID}-0-0"]},
        {"t": at(70.0), "ev": "layer<", "id": None, "exts": [f"{RID}-0-0"]},
        {"t": at(72.0), "ev": "recv_done", "id": vid}, {"t": at(74.0), "ev": "compute", "id": vid},
        {"t": at(80.0), "ev": "step_end", "id": vid},
    ]
    prefill = [
        {"t": at(18.0), "ev": "compute", "id": f"cmpl-{TAG}-0-99999999"},
        {"t": at(29.0), "ev": "announce", "id": None}, {"t": at(69.0), "ev": "announce", "id": None},
    ]
    return decode, prefill


def test_the_hops_add_up_to_the_ttft_and_each_ends_at_its_mark() -> None:
    origin = 1000.0
    sent, first = origin - 0.0005, origin + 0.091
    decode, prefill = _events(origin)
    marks = pd_hops.pd_boundaries(sent, first, _record(origin), decode, prefill, TAG)
    hops = pd_hops.hops(marks, pd_hops.HOPS)
    assert list(hops) == [key for key, _ in pd_hops.HOPS]
    assert sum(hops.values()) == pytest.approx((first - sent) * 1e3)
    assert hops["proxy_in_ms"] == pytest.approx(1.5)  # the client's send to Decode's leg
    assert hops["decode_api_ms"] == pytest.approx(4.0)  # not the warm-up request's earlier match
    assert hops["decode_sched_ms"] == pytest.approx(5.0)
    assert hops["rendezvous_ms"] == pytest.approx(2.0)
    assert hops["prefill_compute_ms"] == pytest.approx(51.0)  # first step to the last announcement
    assert hops["last_layer_ms"] == pytest.approx(1.0)
    assert hops["decode_step_ms"] == pytest.approx(6.0) and hops["decode_out_ms"] == pytest.approx(10.0)
    assert pd_hops.layer_transfers(decode, prefill, sent, first) == pytest.approx([1.0, 1.0])


def test_a_missing_mark_merges_its_hop_into_the_next_and_an_older_proxy_gives_none() -> None:
    origin = 50.0
    decode, prefill = _events(origin)
    without_posted = [e for e in decode if e["ev"] != "posted"]
    sent, first = origin, origin + 0.091
    hops = pd_hops.hops(pd_hops.pd_boundaries(sent, first, _record(origin), without_posted, prefill, TAG), pd_hops.HOPS)
    assert hops["decode_sched_ms"] is None and hops["rendezvous_ms"] == pytest.approx(7.0)
    old = pd_hops.pd_boundaries(sent, first, {"id": RID}, decode, prefill, TAG)  # no t_origin: no proxy marks
    hops = pd_hops.hops(old, pd_hops.HOPS)
    assert hops["proxy_in_ms"] is None and hops["response_ms"] == pytest.approx(11.0)
    assert sum(v for v in hops.values() if v is not None) == pytest.approx(91.0)
