"""Soak: random requests with random faults, Prefill TP 4 -> Decode TP 2, for
``RD2H_SOAK_SECONDS`` (60 by default; CI runs it).

Every rank is a process (tests/faults/harness.py). Each round expects and adds 2-6 requests
of random lengths at random blocks, sometimes in two chunks, announces them layer by layer
and injects faults at random points of that sequence: an abort on Prefill (then on Decode,
as a rendezvous would), an abort on one Decode rank (at a random point, or just after the
last layer was announced, racing the final read, its reply and Prefill's confirmation: an
abort once the final layer was answered READ_DONE changes nothing, the request ends as
Prefill confirms it, DONE on both sides), a Decode deadline that passes before
Prefill sends, a request Decode never expected, a request Decode allocated too few blocks
for, a Prefill rank killed mid-request (restarted after the round). Then every request must
be terminal on every live rank; the round checks:

- agreement: a request is DONE on Decode when every Decode rank says DONE, on Prefill when
  every Prefill rank does (a killed rank says nothing): the two must be equal;
- bytes: every request DONE on a Decode rank holds its sources in that rank's indexer and
  scale, and in main when DONE on both; no block given to no request is written;
- resources: RSS and open fds of the Decode ranks, of the Prefill ranks never killed and of
  this process are flat (first third of the run against the last).

The summary (requests, faults, outcomes, RSS and fds first and last) is printed and
recorded as the test's ``soak`` property.
"""

from __future__ import annotations

import collections
import json
import os
import random
import time
from dataclasses import dataclass, field

import numpy as np
import pytest
from harness import (
    BLOCK,
    ChildError,
    Cluster,
    Rank,
    Request,
    Shape,
    poll,
    process_usage,
)

pytestmark = [pytest.mark.faults, pytest.mark.soak]

SECONDS = float(os.environ.get("RD2H_SOAK_SECONDS", "60"))
P_TP, D_TP = 4, 2
SHAPE = Shape(layers=4, src_blocks=192, dst_blocks=224, decode_tp=D_TP)
KILLABLE = (2, 3)  # Prefill ranks 0 and 1 live the whole run: their RSS and fds are measured
FAULTS = ("prefill_abort", "decode_abort", "late_decode_abort", "deadline", "unknown", "short", "kill")
# injected after the round's last layer was announced, racing its final read, the reply and
# Prefill's confirmation; the others at a random point of the announcements
AFTER_THE_LAST_LAYER = ("late_decode_abort",)
MiB = 1024
# Decode's default deadline: bounds a request whose killed contributor Decode never admitted
# (killed during its first handshake), the one case the pidfd cannot tell
DEADLINE = 10.0


@dataclass
class Round:
    requests: list[Request]
    faults: dict[str, str] = field(default_factory=dict)  # kind -> the request it hits
    killed: int | None = None


def _plan(rng: random.Random, counter: int) -> tuple[Round, int]:
    n = rng.randint(2, 6)
    src = rng.sample(range(SHAPE.src_blocks), SHAPE.src_blocks)
    dst = rng.sample(range(SHAPE.dst_blocks), SHAPE.dst_blocks)
    requests = []
    for _ in range(n):
        size = rng.randint(1, 12)
        requests.append(Request(f"q{counter}", counter, tuple(src[:size]), tuple(dst[:size])))
        del src[:size], dst[:size]
        counter += 1
    plan = Round(requests)
    victims = rng.sample(requests, len(requests))
    for kind in FAULTS:
        chance = 0.15 if kind == "kill" else 0.25  # a restart costs a process start
        fits = [r for r in victims if kind != "short" or len(r.src) >= 2]
        if fits and rng.random() < chance:
            plan.faults[kind] = fits[0].ext_id
            victims.remove(fits[0])
    if "kill" in plan.faults:
        plan.killed = rng.choice(KILLABLE)
    return plan, counter


class Soak:
    def __init__(self, cluster: Cluster, seed: int) -> None:
        self.cluster = cluster
        self.rng = random.Random(seed)
        self.decode = [cluster.decode(r, request_timeout=DEADLINE) for r in range(D_TP)]
        self.prefill: list[Rank | None] = [self._prefill(r) for r in range(P_TP)]
        self.stats: collections.Counter[str] = collections.Counter()
        self.problems: list[str] = []
        self.usage: dict[str, list[tuple[float, int, int]]] = collections.defaultdict(list)

    def _prefill(self, rank: int) -> Rank:
        return self.cluster.prefill(rank, tp=P_TP, reply_timeout=10.0)

    def run_round(self, plan: Round) -> None:
        faults, by_id = plan.faults, {r.ext_id: r for r in plan.requests}
        expected = [r for r in plan.requests if r.ext_id != faults.get("unknown")]
        for d in self.decode:
            for r in expected:
                dst = r.dst[:-1] if r.ext_id == faults.get("short") else r.dst  # a block too few
                deadline = 0.2 if r.ext_id == faults.get("deadline") else None
                d.call("expect", Request(r.ext_id, r.index, r.src, dst), deadline=deadline)
        alive = list(self.prefill)
        for p in alive:
            for r in plan.requests:
                p.call("add", r)
        chunked = self.rng.random() < 0.3
        steps = []
        if chunked:
            steps.append({r.ext_id: (len(r.src) // 2) * BLOCK for r in plan.requests if len(r.src) >= 2})
        steps.append({r.ext_id: r.tokens for r in plan.requests})
        events = [(s, layer) for s in range(len(steps)) for layer in range(SHAPE.layers)]
        at = {kind: self.rng.randrange(len(events)) for kind in faults if kind not in AFTER_THE_LAST_LAYER}
        if "kill" in faults:  # mid-way through the last step: the killed rank announced every
            # request, so Decode knows what it owes (a contributor never heard from is only
            # bounded by the request's deadline)
            at["kill"] = self.rng.randrange(len(events) - SHAPE.layers + 1, len(events))
        decode_seen: list[dict[str, tuple]] = [{} for _ in self.decode]
        if "deadline" in faults:  # Decode gives up on it before Prefill sends anything
            victim = faults["deadline"]

            def settled() -> bool:
                for rank, d in enumerate(self.decode):
                    decode_seen[rank].update(d.call("take"))
                return all(victim in seen for seen in decode_seen)

            poll(settled, 10, "the deadline victim fails on every Decode rank")
        for i, (step, layer) in enumerate(events):
            if layer == 0:
                for p in alive:
                    if p is not None:
                        p.call("schedule", steps[step])
            for kind, when in at.items():
                if when == i:
                    self._inject(kind, faults[kind], plan, alive, decode_seen)
            live = [p for p in alive if p is not None]
            for p in live:
                p.send("layers", layer, layer + 1)
            for p in live:
                p.result(60, "layers")
        for kind in AFTER_THE_LAST_LAYER:
            if kind in faults:
                self._inject(kind, faults[kind], plan, alive, decode_seen)
        self._settle(plan, expected, alive, decode_seen, by_id)

    def _inject(self, kind: str, ext_id: str, plan: Round, alive: list, decode_seen: list) -> None:
        self.stats[f"fault {kind}"] += 1
        if kind == "kill":
            alive[plan.killed].kill()
            alive[plan.killed].close()  # reaped, its pipe closed
            alive[plan.killed] = None
        elif kind == "prefill_abort":
            for p in alive:
                if p is not None:
                    p.call("abort", ext_id)
            for d in self.decode:
                d.call("abort", ext_id)
        elif kind == "decode_abort":
            self.decode[self.rng.randrange(D_TP)].call("abort", ext_id)
        elif kind == "late_decode_abort":  # the final layer may be read, answered, even confirmed
            found = self.decode[self.rng.randrange(D_TP)].call("abort", ext_id)
            self.stats[f"late_decode_abort: the abort found it {'live' if found else 'settled'}"] += 1

    def _settle(self, plan: Round, expected: list[Request], alive: list, decode_seen: list, by_id: dict) -> None:
        ids = [r.ext_id for r in plan.requests]
        on_decode: list[dict[str, tuple]] = []
        for rank, d in enumerate(self.decode):
            pending = [r.ext_id for r in expected if r.ext_id not in decode_seen[rank]]
            try:
                got = {**decode_seen[rank], **d.call("wait", pending, 45, timeout=60)}
            except (ChildError, TimeoutError) as exc:  # not terminal: a failure of the run
                self.problems.append(f"Decode rank {rank} not terminal: {exc}"[:300])
                got = dict(decode_seen[rank])
            on_decode.append(got)
        on_prefill: list[dict[str, tuple] | None] = []
        for rank, p in enumerate(alive):
            if p is None:
                on_prefill.append(None)
                continue
            try:
                on_prefill.append(p.call("wait", ids, 45, timeout=60))
            except (ChildError, TimeoutError) as exc:
                self.problems.append(f"Prefill rank {rank} not terminal: {exc}"[:300])
                on_prefill.append({})
        allowed: list[int] = []
        for r in plan.requests:
            self.stats["requests"] += 1
            states_d = [seen.get(r.ext_id, ("none", None, ""))[0] for seen in on_decode]
            states_p = ["killed" if seen is None else seen.get(r.ext_id, ("none",))[0] for seen in on_prefill]
            decode_done = all(s == "done" for s in states_d)
            prefill_done = all(s == "done" for s in states_p)
            kind = next((k for k, v in plan.faults.items() if v == r.ext_id), "clean")
            if plan.killed is not None and kind == "clean":
                kind = "clean, a Prefill rank killed"
            self.stats[f"{kind}: Decode {'DONE' if decode_done else 'not DONE'}, Prefill {'DONE' if prefill_done else 'not DONE'}"] += 1
            if decode_done != prefill_done:
                self.problems.append(f"{r.ext_id} ({kind}): Decode {states_d}, Prefill {states_p}")
            if kind == "clean" and not decode_done:
                self.problems.append(f"{r.ext_id} with no fault not DONE: Decode {on_decode[0].get(r.ext_id)} / {on_decode[1].get(r.ext_id)}, Prefill {states_p}")
            if r in expected:
                allowed.extend(r.dst)
            done_ranks = [rank for rank, s in enumerate(states_d) if s == "done"]
            if done_ranks:
                wrong = self.cluster.arrived(r, done_ranks, main=decode_done)
                self.stats["bytes checked"] += 1
                if wrong:
                    self.problems.append(f"{r.ext_id}: corrupted {wrong[:4]}")
        outside = self.cluster.written_outside(allowed)
        if outside:
            self.problems.append(f"{outside} block(s) outside every request's destinations written")
        self.cluster.zero()
        if plan.killed is not None:
            self.prefill[plan.killed] = self._prefill(plan.killed)
            self.stats["restarts"] += 1

    def sample(self, elapsed: float) -> None:
        for rank, d in enumerate(self.decode):
            rss, fds = d.call("usage")
            self.usage[f"decode {rank}"].append((elapsed, rss, fds))
        for rank in range(P_TP):
            if rank not in KILLABLE:
                rss, fds = self.prefill[rank].call("usage")
                self.usage[f"prefill {rank}"].append((elapsed, rss, fds))
        rss, fds = process_usage()
        self.usage["test process"].append((elapsed, rss, fds))

    def flat(self) -> dict[str, dict[str, object]]:
        """Per process: RSS and fds at the start and the end, and whether they stayed flat."""
        report = {}
        for name, series in self.usage.items():
            third = max(1, len(series) // 3)
            first, last = series[:third], series[-third:]
            rss_first, rss_last = np.median([s[1] for s in first]), np.median([s[1] for s in last])
            fds_first, fds_last = max(s[2] for s in first), max(s[2] for s in last)
            rss_ok = rss_last - rss_first <= max(16 * MiB, 0.10 * rss_first)
            fds_ok = fds_last - fds_first <= 2
            report[name] = {
                "rss_kib": [int(series[0][1]), int(series[-1][1])],
                "rss_median_first_last_third_kib": [int(rss_first), int(rss_last)],
                "fds": [series[0][2], series[-1][2]],
                "flat": bool(rss_ok and fds_ok),
            }
            if not (rss_ok and fds_ok):
                self.problems.append(f"{name}: not flat: {report[name]}")
        return report


def test_soak_tp4_to_tp2_random_requests_and_faults(kv_port: int, record_property) -> None:
    seed = int(os.environ.get("RD2H_SOAK_SEED", str(random.randrange(2**32))))
    started = time.monotonic()
    with Cluster(SHAPE, kv_port) as cluster:
        soak = Soak(cluster, seed)
        rounds, counter = 0, 0
        while time.monotonic() - started < SECONDS:
            plan, counter = _plan(soak.rng, counter)
            soak.run_round(plan)
            rounds += 1
            soak.sample(time.monotonic() - started)
            if len(soak.problems) > 20:
                break
        resources = soak.flat()
    summary = {
        "seed": seed, "seconds": round(time.monotonic() - started, 1), "rounds": rounds,
        "stats": dict(sorted(soak.stats.items())), "resources": resources, "problems": soak.problems,
    }
    text = json.dumps(summary, indent=1)
    print(text)
    record_property("soak", text)
    assert rounds >= 3, summary
    assert not soak.problems, text
