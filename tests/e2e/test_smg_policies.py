"""The real SGLang model gateway (smg 1.13.0 from PyPI) in front of simulated workers, routing by key:
what its own policy branches say of each keyed follow-up reaches the exporter, equals what the
workers themselves saw, and lights the sticky-collision check with no request record at all.

- ``--policy manual``: sessions pinned by ``X-SMG-Routing-Key``; a worker is killed, so the keys it
  held move (``occupied_miss``: migrations, not collisions) and the others stay (``occupied_hit``).
- ``--policy prefix_hash``: bursts of one prompt head overload its ring worker, so the gateway walks
  requests off it (``load_balance_walk``: collisions — the ring worker was healthy, only busy).
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise
from pathlib import Path

import requests

from fleet.worker_http import WORKER_HEADER
from tests.e2e.router_stack import MODEL, P, Stack, StackOptions, open_stack
from tests.e2e.routers import SMG
from tests.support import wait_for

ROUTING_KEY = "X-SMG-Routing-Key"  # smg's sticky header (--policy manual)
FOLLOWUPS = f"{P}_router_sticky_followups_total"


def complete(s: Stack, prompt: str, key: str | None = None) -> str:
    """One completion through the gateway; the worker that served it (the simulated worker's header)."""
    r = requests.post(f"{s.router.url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4},
                      headers={ROUTING_KEY: key} if key else {}, timeout=30)
    assert r.status_code == 200, r.text
    return r.headers[WORKER_HEADER]


def gateway_branches(s: Stack, family: str) -> Counter[str]:
    """The gateway's own branch counts, read from its /metrics."""
    out: Counter[str] = Counter()
    for line in requests.get(s.router.metrics_url, timeout=5).text.splitlines():
        if line.startswith(family + "{"):
            branch = line.split('branch="', 1)[1].split('"', 1)[0]
            out[branch] += int(float(line.rsplit(" ", 1)[1]))
    return out


def exported_followups(s: Stack, policy: str) -> dict[str, float | None]:
    return {o: s.value(FOLLOWUPS, router=SMG, policy=policy, outcome=o) for o in ("kept", "collision", "migration")}


def test_manual_sessions_stay_and_a_dead_workers_sessions_migrate(tmp_path: Path) -> None:
    keys = [f"session-{i}" for i in range(6)]
    with open_stack(SMG, tmp_path, StackOptions(policy="manual")) as s:
        served: dict[str, list[str]] = {k: [] for k in keys}
        for turn in range(2):
            for k in keys:
                served[k].append(complete(s, f"conversation {k}, turn {turn}: " + "tell me more. " * 20, k))
        assert all(len(set(ws)) == 1 for ws in served.values())  # pinned
        dead = Counter(ws[0] for ws in served.values()).most_common(1)[0][0]
        s.fleet.kill(dead)
        wait_for(lambda: s.value(f"{P}_router_worker_healthy", router=SMG, worker=dead) == 0.0,
                 "the gateway to mark the killed worker unhealthy")
        for k in keys:
            served[k].append(complete(s, f"conversation {k}, turn 2: " + "tell me more. " * 20, k))

        # What the workers saw: a follow-up on its session's previous worker stayed; one elsewhere
        # moved because that worker was dead (the gateway never moves a key off a healthy worker).
        truth: Counter[str] = Counter()
        for ws in served.values():
            for prev, cur in pairwise(ws):
                truth["kept" if cur == prev else "migration"] += 1
        assert truth["migration"] == sum(ws[0] == dead for ws in served.values()) > 0
        want = {"kept": float(truth["kept"]), "collision": 0.0, "migration": float(truth["migration"])}
        wait_for(lambda: exported_followups(s, "manual") == want, f"the exporter's follow-ups to be {want}")
        own = gateway_branches(s, "smg_manual_policy_branch_total")
        assert (own["occupied_hit"], own["occupied_miss"], own["vacant"]) == (truth["kept"], truth["migration"], len(keys))

        # Step 2 lights with no record: the gateway's own count says no session left a healthy worker.
        sticky = s.checks()["sticky_session_collision_rate"]
        assert sticky["status"] == "ok" and sticky["value"] == 0.0, sticky
        assert s.value(f"{P}_signal_available", signal="affinity_outcomes") == 1.0
        assert s.value(f"{P}_signal_available", signal="session_key") == 0.0  # nothing else claimed it


def test_prefix_hash_walks_off_a_busy_ring_worker_are_collisions(tmp_path: Path) -> None:
    heads = [f"You are an expert assistant on topic {g}. " * 40 for g in range(3)]  # past the hashed head
    args = ("--prefix-hash-balance-abs-threshold", "0")  # walk as soon as the ring worker is busier than average
    with open_stack(SMG, tmp_path, StackOptions(policy="prefix_hash", router_args=args)) as s:
        ring = {g: complete(s, head + "warm-up") for g, head in enumerate(heads)}  # idle fleet: the ring worker
        served: list[tuple[int, str]] = [(g, w) for g, w in ring.items()]
        with ThreadPoolExecutor(6) as pool:
            for g, head in enumerate(heads):
                burst = pool.map(lambda i, head=head: complete(s, head + f"question {i}"), range(6))
                served += [(g, w) for w in burst]
        truth = Counter("kept" if w == ring[g] else "collision" for g, w in served)
        assert truth["collision"] > 0  # the bursts overloaded their ring workers
        own = gateway_branches(s, "smg_prefix_hash_policy_branch_total")
        assert (own["ring_hit"], own["load_balance_walk"]) == (truth["kept"], truth["collision"])
        want = {"kept": float(truth["kept"]), "collision": float(truth["collision"]), "migration": 0.0}
        wait_for(lambda: exported_followups(s, "prefix_hash") == want, f"the exporter's follow-ups to be {want}")
        # The check reads the gateway's collision share over the window: its increases since the
        # first scrape that showed the family (the gateway registers it at its first request, so
        # that scrape is the baseline, as it is for Prometheus's rate).
        store = s.runtime.state.store
        collisions = store.window_counter(FOLLOWUPS.removesuffix("_total"), lambda lab: lab[2] == "collision")
        followups = store.window_counter(FOLLOWUPS.removesuffix("_total"))
        assert collisions is not None and followups and 0 < collisions <= truth["collision"]
        sticky = s.checks()["sticky_session_collision_rate"]
        assert sticky["value"] == collisions / followups and sticky["status"] == "firing", sticky


def test_the_gateways_tree_is_read_against_its_bound(tmp_path: Path) -> None:
    """Cache-aware routing keeps one string tree per model; each eviction pass sets its size, which
    the exporter reads against --max-tree-size (the one given here, not the gateway's default)."""
    bound = 100_000
    args = ("--eviction-interval-secs", "1", "--max-tree-size", str(bound))
    with open_stack(SMG, tmp_path, StackOptions(router_args=args, max_tree_size=bound)) as s:
        for i in range(6):
            complete(s, f"You are an expert assistant on topic {i % 2}. " * 10 + f"question {i}")

        def own_chars() -> float:
            lines = requests.get(s.router.metrics_url, timeout=5).text.splitlines()
            return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines if ln.startswith("smg_cache_tree_chars{"))

        wait_for(lambda: own_chars() > 0, "an eviction pass to set the gateway's tree size")
        wait_for(lambda: s.value(f"{P}_router_tree_fill_ratio", router=SMG) == own_chars() / bound,
                 "the exporter's fill ratio to be the gateway's own tree over its bound")
