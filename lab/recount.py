"""The simulator's ground truth: each check's raw value recounted from a run's own records.

The exporter computes each check from what a real cluster exposes; this module counts the same
quantity from what the simulation knows for certain (every request record, engine counter
sample, eviction, placement and root), so a test can hold the exporter's answer against it.
One small function per check over a :class:`Window` of the run; :func:`signals` runs them all.

Follow-ups are requests of a session key seen before, or the first request of a new key that
continues another key's conversation (a re-keyed session: its prompt extends that session's last
prompt). A collision is a follow-up served away from the session's previous worker while that
worker was still in the pool (a migration is not a collision). Cold prefill is read as the
exporter's check reads it (:func:`cold_prefill_ratio`). ``None`` means the window had nothing to
measure. The thresholds the counts depend on (the cold share, the full-cache share, the baseline
window) are handed in, never read from disk here.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from itertools import pairwise
from statistics import median

from fleet.fallback import quantile
from fleet.scenarios import Scenario
from fleet.simulation import ROOT_WINDOW_S, Sample, SimResult
from prefixscope.catalog import CHECKS_BY_ALERT, CHECKS_BY_KEY, prompt_class
from prefixscope.thresholds import Thresholds

MOE_LEAD_BLOCKS = 2  # blocks that decide the expert signature (WorkerSpec.expert_signature_blocks)


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def _counter_delta(samples: list[Sample], since: float, until: float, key: str) -> float:
    inside = [s for s in samples if since <= s.t <= until]
    if len(inside) < 2:
        return 0.0
    return sum(inside[-1].workers[w][key] - inside[0].workers[w][key] for w in inside[-1].workers)


def is_cold(record: dict, cold_share: float) -> bool:
    """A cold request as the exporter counts one: prefill timed, at most ``cold_share`` of the prompt reused."""
    cached = record.get("cached_tokens")
    return (record.get("prefill_s") is not None and cached is not None
            and cached <= cold_share * record["prompt_tokens"])


@dataclass(frozen=True)
class FollowUp:
    record: dict
    previous_worker: str  # where the session's previous turn was served
    collided: bool  # served elsewhere, not migrated, while the previous worker was in the pool


@dataclass
class Window:
    """``[since, until)`` seconds of a run, and what several checks read from it."""

    result: SimResult
    since: float
    until: float
    thresholds: Thresholds

    @property
    def lo(self) -> float:
        return self.result.start + self.since

    @property
    def hi(self) -> float:
        return self.result.start + self.until

    @property
    def minutes(self) -> float:
        return (self.until - self.since) / 60

    @cached_property
    def records(self) -> list[dict]:
        return [r for r in self.result.records if self.lo <= r["ts"] < self.hi]

    @cached_property
    def samples(self) -> list[Sample]:
        return [s for s in self.result.samples if self.since <= s.t <= self.until]

    def counter_delta(self, key: str) -> float:
        return _counter_delta(self.result.samples, self.since, self.until, key)

    def in_pool_at(self, ts: float) -> set[str]:
        """The workers in the pool at the latest sample at or before ``ts``."""
        t = ts - self.result.start
        best = self.result.samples[0]
        for s in self.result.samples:
            if s.t > t:
                break
            best = s
        return {w for w, v in best.workers.items() if v["in_pool"]}

    @cached_property
    def history(self) -> list[dict]:
        """The records before the window, up to the first at or after its start (records are
        kept in the order they were served)."""
        out = []
        for r in self.result.records:
            if r["ts"] >= self.lo:
                break
            out.append(r)
        return out

    @cached_property
    def follow_ups(self) -> list[FollowUp]:
        """The window's follow-up turns; session history from before the window counts."""
        last_worker: dict[str, str] = {}
        tail: dict[int, str] = {}  # last block hash of a session's latest prompt -> its key

        def continued(r: dict) -> str | None:
            return next((k for h in reversed(r.get("block_hashes") or ()) if (k := tail.get(h)) is not None), None)

        def remember(r: dict) -> None:
            if key := r.get("session_key"):
                last_worker[key] = r["worker"]
                if r.get("block_hashes"):
                    tail[r["block_hashes"][-1]] = key

        for r in self.history:
            remember(r)
        out = []
        for r in self.records:
            key = r.get("session_key")
            prev_key = key if key in last_worker else (continued(r) if key else None)
            if prev_key is not None:
                prev = last_worker[prev_key]
                collided = prev != r["worker"] and not r.get("migrated_from") and prev in self.in_pool_at(r["ts"])
                out.append(FollowUp(r, prev, collided))
            remember(r)
        return out


# ---- one function per check ------------------------------------------------------------------

def prefix_hit_rate_total(w: Window) -> float | None:
    return _ratio(w.counter_delta("prefix_hits"), w.counter_delta("prefix_queries"))


def prefix_hit_rate_per_session(w: Window) -> float | None:
    return _ratio(sum(f.record.get("cached_tokens") or 0 for f in w.follow_ups),
                  sum(f.record["prompt_tokens"] for f in w.follow_ups))


def sticky_session_collision_rate(w: Window) -> float | None:
    return _ratio(sum(f.collided for f in w.follow_ups), len(w.follow_ups))


def prefix_block_count_per_worker(w: Window) -> float | None:
    """Cache pressure as the check reads it: the thrash of the workers whose cache is full (a full
    cache alone is normal)."""
    full_share = w.thresholds.checks["prefix_block_count_per_worker"].value
    pressure: list[float] = []
    for worker, batches in w.result.evictions.items():
        fills = [s.workers[worker]["resident_blocks"] / s.workers[worker]["capacity_blocks"]
                 for s in w.samples if worker in s.workers]
        got = [(n, again) for ts, n, again in batches if w.lo <= ts < w.hi]
        stored = sum(n for n, _ in got)
        if fills and stored:
            pressure.append(sum(again for _, again in got) / stored if max(fills) > full_share else 0.0)
    return max(pressure) if pressure else None


def prefix_hit_rate_worker_outlier(w: Window) -> float | None:
    """The lowest hit ratio of a worker against the median worker's, among the workers in the pool
    whose lookups are at least the ``worker_peer_traffic`` share of the median worker's (from each
    engine's own counters: tokens found cached / tokens looked up over the window)."""
    if len(w.samples) < 2:
        return None
    first, last = w.samples[0].workers, w.samples[-1].workers
    looked: dict[str, float] = {}
    found: dict[str, float] = {}
    for worker, end in last.items():
        if worker in first and end["in_pool"]:
            looked[worker] = end["prefix_queries"] - first[worker]["prefix_queries"]
            found[worker] = end["prefix_hits"] - first[worker]["prefix_hits"]
    ratios = {worker: found[worker] / n for worker, n in looked.items() if n > 0}
    if not ratios:
        return None
    peers = median(ratios.values())
    floor = w.thresholds.checks["worker_peer_traffic"].value * median(looked.values())
    comparable = [r / peers for worker, r in ratios.items() if looked[worker] >= floor]
    return min(comparable) if peers > 0 and comparable else None


def prefix_tree_depth_p99(w: Window) -> float | None:
    """p99 radix depth of the leaves of the tree all workers' caches hold together (a run of blocks
    without branching counts once; a block whose parent is not cached starts at the root).

    The depth is a snapshot, and the run's only snapshot of every cache is its end: measured for a
    window that ends with the run, None for others. A block's parent is the block before it in a
    request's chain (every cached block was computed for some request; the pre-warmed system prompts
    are requested too)."""
    if not w.result.samples or w.until < w.result.samples[-1].t:
        return None
    cached: set[int] = set()
    for engine in w.result.engines.values():
        cached |= engine.cache.resident()
    if not cached:
        return None
    parent_of: dict[int, int] = {}
    for r in w.result.records:
        chain = r.get("block_hashes") or ()
        parent_of.update((h, p) for p, h in pairwise(chain) if h in cached)
    parent = {h: p if (p := parent_of.get(h)) in cached else None for h in cached}
    children = Counter(parent.values())
    depth: dict[int | None, int] = {None: 0}
    for leaf in cached:
        path = []
        h: int | None = leaf
        while h not in depth:
            path.append(h)
            h = parent[h]
        for h in reversed(path):
            up = parent[h]  # type: ignore[index]
            depth[h] = depth[up] + (up is None or children[up] > 1)
    return float(quantile([depth[h] for h in cached if h not in children], 0.99) or 0)


def prefix_root_instability(w: Window) -> float | None:
    return _ratio(unstable_roots(w.result, w.since, w.until), len(w.records)) if w.result.roots else None


def warm_pool_utilization(w: Window) -> float | None:
    warm = [t.name for t in w.result.topology.workers if t.warm_pool]
    if not warm or not w.samples:
        return None
    used = [sum(max(s.workers[n]["kv_usage"], s.workers[n]["running"] / s.workers[n]["max_running"]) for n in warm)
            / len(warm) for s in w.samples]
    return sum(used) / len(used)


def session_migration_count_per_minute(w: Window) -> float | None:
    moved = sum(1 for r in w.records if r.get("migrated_from"))
    return moved / w.minutes if w.minutes else None


def cross_node_migration_count_per_minute(w: Window) -> float | None:
    topo = w.result.topology
    crossed = sum(1 for r in w.records if (src := r.get("migrated_from")) and src in topo
                  and topo.node_of(src) != topo.node_of(r["worker"]))
    return crossed / w.minutes if w.minutes else None


def cold_prefill_time_p99(w: Window) -> float | None:
    return cold_prefill_ratio(w.result, w.since, w.until, w.thresholds.cold_reuse_share,
                              w.thresholds.baseline_window_s)


def cold_prefill_budget(w: Window) -> float | None:
    """Cold prefill p99 in seconds over the absolute budget of its prompt-length class, per model
    and class, the worst (the budgets of the threshold file's ``cold_prefill_seconds_budget``)."""
    budgets = w.thresholds.checks["cold_prefill_seconds_budget"].budgets
    times: dict[tuple[str, str], list[float]] = {}
    for r in w.records:
        if is_cold(r, w.thresholds.cold_reuse_share):
            times.setdefault((r["model"], prompt_class(r["prompt_tokens"])), []).append(r["prefill_s"])
    return max(((quantile(v, 0.99) or 0.0) / budgets[cls] for (_, cls), v in times.items() if cls in budgets),
               default=None)


def cold_prefill_cost_per_request(w: Window) -> float | None:
    topo = w.result.topology
    costs = [r["prefill_s"] * (t := topo.worker(r["worker"])).gpus * t.price_per_gpu_hour / 3600
             for r in w.records if is_cold(r, w.thresholds.cold_reuse_share)]
    return sum(costs) / len(costs) if costs else None


def async_prefill_wait_time_p99(w: Window) -> float | None:
    return quantile([r["async_wait_s"] for r in w.records if r.get("async_wait_s") is not None], 0.99)


def prefix_tree_walk_latency(w: Window) -> float | None:
    return quantile([r["walk_s"] for r in w.records if r.get("walk_s") is not None], 0.99)


def topology_aware_placement_hit_rate(w: Window) -> float | None:
    topo = w.result.topology
    placed = [topo.domain_of(worker) in domain for ts, domain, worker in w.result.placements if w.lo <= ts < w.hi]
    return sum(placed) / len(placed) if placed else None


def speculative_decoding_acceptance_rate(w: Window) -> float | None:
    return _ratio(w.counter_delta("spec_accepted_tokens"), w.counter_delta("spec_draft_tokens"))


def moe_expert_alignment_rate(w: Window) -> float | None:
    """Of the window's cache hits on a known lead, the share whose expert signature is the one
    that first cached that lead (leads seen before the window count)."""
    def lead(r: dict) -> tuple[int, ...]:
        return tuple((r.get("block_hashes") or ())[:MOE_LEAD_BLOCKS])

    first_signature: dict[tuple[int, ...], str] = {}
    for r in w.history:
        if r.get("expert_signature") and lead(r):
            first_signature.setdefault(lead(r), r["expert_signature"])
    hits = aligned = 0
    for r in w.records:
        sig, opening = r.get("expert_signature"), lead(r)
        if not sig or not opening:
            continue
        if (r.get("cached_tokens") or 0) > 0 and opening in first_signature:
            hits += 1
            aligned += first_signature[opening] == sig
        first_signature.setdefault(opening, sig)
    return _ratio(aligned, hits)


def continuous_batching_affinity_admission_rate(w: Window) -> float | None:
    admitted = [bool(r["admitted_by_affinity"]) for r in w.records if r.get("admitted_by_affinity") is not None]
    return _ratio(sum(admitted), len(admitted))


def kv_event_staleness(w: Window) -> float | None:
    """The longest a serving worker's KV-event stream had been silent (an idle worker publishes
    nothing and is not stale)."""
    last_served = {r["worker"]: r["ts"] for r in w.records}
    last_batch = w.result.router.kv_last_batch
    return max((max(0.0, ts - last_batch.get(worker, w.result.start)) for worker, ts in last_served.items()),
               default=None)


def index_staleness(w: Window) -> float | None:
    stale = sum(max(0, r["predicted_cached_tokens"] - (r.get("cached_tokens") or 0))
                for r in w.records if r.get("predicted_cached_tokens") is not None)
    return _ratio(stale, sum(r["prompt_tokens"] for r in w.records))


# check key -> its recount, in the order the table prints them
RECOUNTS: dict[str, Callable[[Window], float | None]] = {
    f.__name__: f for f in (
        prefix_hit_rate_total, prefix_hit_rate_worker_outlier, prefix_block_count_per_worker, prefix_tree_depth_p99,
        prefix_root_instability, prefix_hit_rate_per_session,
        sticky_session_collision_rate, warm_pool_utilization, session_migration_count_per_minute,
        cold_prefill_time_p99, cold_prefill_budget, cold_prefill_cost_per_request, async_prefill_wait_time_p99,
        prefix_tree_walk_latency, topology_aware_placement_hit_rate, cross_node_migration_count_per_minute,
        speculative_decoding_acceptance_rate, moe_expert_alignment_rate,
        continuous_batching_affinity_admission_rate, kv_event_staleness, index_staleness)
}


def signals(result: SimResult, since: float, until: float, thresholds: Thresholds) -> dict[str, float | None]:
    """The raw value behind each checklist key over ``[since, until)`` seconds of the run."""
    window = Window(result, since, until, thresholds)
    return {key: recount(window) for key, recount in RECOUNTS.items()}


def cold_prefill_ratio(result: SimResult, since: float, until: float, cold_share: float,
                       baseline_window_s: float) -> float | None:
    """Cold prefill p99 in seconds over ``[since, until)`` against the cold p99 of the baseline
    window that ends where this one begins, per model and prompt-length class; the worst class.

    The catalogue's ``cold_prefill_time_p99`` (``prompt_class:…_p99:ratio_baseline``), with exact
    quantiles where the exporter reads histogram buckets. A class without cold requests in either
    window has no ratio; ``None`` when no class has one.
    """
    now: dict[tuple[str, str], list[float]] = {}
    base: dict[tuple[str, str], list[float]] = {}
    lo, mid, hi = result.start + since - baseline_window_s, result.start + since, result.start + until
    for r in result.records:
        if not lo <= r["ts"] < hi or not is_cold(r, cold_share):
            continue
        into = now if r["ts"] >= mid else base
        into.setdefault((r["model"], prompt_class(r["prompt_tokens"])), []).append(r["prefill_s"])
    ratios = []
    for key, values in now.items():
        p99, baseline = quantile(values, 0.99), quantile(base.get(key, ()), 0.99)
        if p99 is not None and baseline:
            ratios.append(p99 / baseline)
    return max(ratios, default=None)


def unstable_roots(result: SimResult, since: float, until: float) -> int:
    """Root branches stored in ``[since, until)`` that are new (first block not a root within
    ROOT_WINDOW_S before) and repeat a recent root's opening but for its first one or two blocks."""
    lo, hi = result.start + since, result.start + until
    bs = result.topology.block_size
    last_seen: dict[int, float] = {}
    tails: dict[tuple[int, int, tuple[int, ...]], tuple[int, float]] = {}  # (from block, blocks, tokens) -> root, when
    count = 0
    for ts, first, opening in result.roots:
        if ts >= hi:
            break
        blocks = len(opening) // bs
        keys = [(s, blocks, opening[s * bs:]) for s in (1, 2) if blocks - s >= 8]
        prev = last_seen.get(first)
        if lo <= ts and (prev is None or ts - prev > ROOT_WINDOW_S):
            count += any((twin := tails.get(k)) is not None and twin[0] != first and ts - twin[1] <= ROOT_WINDOW_S
                         for k in keys)
        last_seen[first] = ts
        for k in keys:
            tails[k] = (first, ts)
    return count


def signal_table(result: SimResult, scenario: Scenario, thresholds: Thresholds) -> str:
    """Each check's recounted value before and after the fault, marked where it crosses its threshold."""
    before = signals(result, 0.0, scenario.fault_at_s, thresholds)
    after = signals(result, scenario.fault_at_s, min(result.scenario.duration_s, scenario.duration_s), thresholds)
    expected = {CHECKS_BY_ALERT[a].key for a in scenario.expected_alerts}
    lines = [f"{'check':<46} {'op':>2} {'threshold':>10} {'warm-up':>12} {'fault':>12}"]
    for key, after_v in after.items():
        check = CHECKS_BY_KEY.get(key)
        if check is None:
            continue
        t = thresholds.checks[check.threshold].value
        mark = " <- expected" if key in expected else ""
        lines.append(f"{key:<46} {check.op:>2} {t:>10g} {_cell(before[key], check.op, t):>12} "
                     f"{_cell(after_v, check.op, t):>12}{mark}")
    return "\n".join(lines)


def _cell(v: float | None, op: str, threshold: float) -> str:
    if v is None:
        return "n/a"
    crossed = v > threshold if op == ">" else v < threshold
    return f"{v:.4g}{' !' if crossed else '  '}"
