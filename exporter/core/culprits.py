"""Who drives a check's number: the workers, prefixes, sessions and nodes that explain *this* check.

Read from what the state already holds, under its lock (``ClusterState.snapshot_for``). An
entity is listed only when its own value for the check departs from its peers', and says why
(``why``: "86 s since its last KV event; the others ≤ 5 s"):

- *workers*: only for checks with a per-worker series (:data:`WORKER_SERIES`: KV-event silence,
  view repairs, resident blocks per capacity, warm-pool use, workers down, the hit ratio behind
  the hit-rate checks, each worker's hit ratio against the median worker's). A worker is listed when its value is past the check's limit (where the
  series is the check's own number per worker) or departs from the median of the others by more
  than the series' margin, in the bad direction; most departed first. Checks without such a
  series list none: naming the lowest-hit workers would blame healthy ones.
- *prefixes* (hit-rate and cache-pressure checks): the branches whose hit tokens fell against the
  previous window by at least :data:`LOST_SHARE` of what they had. A hot branch whose hits held —
  a shared system prompt on every worker — is no culprit, however hot.
- *sessions* (session checks): keyed sessions of the window whose follow-ups reused markedly less
  than the other sessions' median.
- *nodes*: the topology nodes of the listed workers.
- *near_duplicates* (prefix instability only): the newest pair of root branches of the window
  whose openings are the same but for a short early span, with where they differ and, when text
  is on, their first tokens and words.

Only breaching checks get culprits on ``/api/v1/groups``; ``/api/v1/culprits`` answers any.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from statistics import median
from typing import Any

from exporter.core import worker_outliers
from exporter.core.hotspots import branch_label
from exporter.core.index.prefix_index import TreeStats
from exporter.core.index.tiers import GPU
from exporter.core.state import NO_TREE, ClusterState
from prefixscope import catalog
from prefixscope.units import format_reading

TOP = 3
P = catalog.NAMESPACE
_KV_LAST_TS = f"{P}_kv_event_last_timestamp_seconds"
_KV_REPAIRS = f"{P}_kv_index_repairs"
OUTLIER_KEY = "prefix_hit_rate_worker_outlier"
LOST_SHARE = 0.2  # a branch is a culprit once it lost this share of its previous window's hits
SESSION_MARGIN = 0.25  # a session reusing this much less than the others' median is a culprit

# block, holders -> {"text", "token_ids", "tenant", "adapter"}
Namer = Callable[[int, list[str]], Mapping[str, Any]]

HIT_RATE_CHECKS = frozenset({"prefix_hit_rate_total", "slo_prefix_hit_rate"})
PREFIX_CHECKS = HIT_RATE_CHECKS | {"prefix_block_count_per_worker", "prefix_hit_rate_per_session",
                                   "slo_session_hit_rate"}
SESSION_CHECKS = frozenset({"prefix_hit_rate_per_session", "sticky_session_collision_rate",
                            "slo_session_hit_rate", "session_migration_count_per_minute"})


@dataclass(frozen=True)
class WorkerSeries:
    """One check's per-worker series: what each worker's value is and when it departs."""

    measure: str  # what the value is, for a person
    unit: str  # a catalogue unit (prefixscope.units)
    values: dict[str, float]
    high_is_bad: bool  # True: a value above the others' drives the check
    margin: float  # the least departure from the others' median that names a worker
    own_limit: bool = False  # the series is the check's own number per worker: past the limit names it


def _series(st: ClusterState, check: catalog.Check) -> WorkerSeries | None:
    key = check.key
    if key in ("kv_event_staleness", "kv_event_blind_share"):
        now = st.clock()
        _, gauges = st.health.snapshot()
        return WorkerSeries("since its last KV event", "seconds",
                            {lab[0]: max(now - ts, 0.0) for lab, ts in gauges.get(_KV_LAST_TS, {}).items()},
                            True, 15.0, own_limit=key == "kv_event_staleness")
    if key == "kv_event_gaps":
        counters, _ = st.health.snapshot()
        values: dict[str, float] = {}
        for labels, n in counters.get(_KV_REPAIRS, {}).items():
            if labels:
                values[labels[0]] = values.get(labels[0], 0.0) + n
        return WorkerSeries("view repairs since the exporter started", "repairs", values, True, 1.0)
    if key == "prefix_block_count_per_worker":
        values = {}
        for w in st.workers_seen():
            cap = st.worker_pool.worker_capacity(w)
            if cap:
                values[w] = (st.index.resident_blocks(w, GPU) or 0) / cap  # GPU blocks against GPU capacity
        return WorkerSeries("of its capacity resident", "ratio", values, True, 0.15)
    if key == "warm_pool_utilization":
        return WorkerSeries("warm-pool utilisation", "ratio", st.worker_pool.warm_pool_utilization(), True, 0.15)
    if key == "targets_up":
        return WorkerSeries("down while traffic reaches it", "", {w: 0.0 if st.worker_pool.is_healthy(w) else 1.0
                                                                  for w in st.workers_seen()}, True, 1.0)
    if key == OUTLIER_KEY:  # the check's own number per worker: its hit ratio over the median worker's
        return WorkerSeries("its peers' median hit ratio", "ratio_to_peers",
                            worker_outliers.peer_ratios(st.store, st.thresholds), False, 0.15, own_limit=True)
    if key in HIT_RATE_CHECKS:
        ratios = {w: r for w in st.workers_seen() if (r := st.scrapes.worker_hit_ratio(w)) is not None}
        return WorkerSeries("prefix-cache hit ratio", "ratio", ratios, False, 0.15)
    return None


def _reads(value: float, s: WorkerSeries) -> str:
    if s.unit == "":
        return s.measure
    return f"{format_reading(value, s.unit)} {s.measure}"


def _past(value: float, op: str, limit: float | None) -> bool:
    return limit is not None and (value > limit if op == ">" else value < limit)


def _workers(st: ClusterState, check: catalog.Check, limit: float | None) -> list[dict[str, Any]]:
    s = _series(st, check)
    if s is None or not s.values:
        return []
    picked: list[tuple[float, str, float | None]] = []
    for w, v in s.values.items():
        others = [o for name, o in s.values.items() if name != w]
        ref = median(others) if others else None
        departs = ref is not None and ((v - ref) if s.high_is_bad else (ref - v)) >= s.margin
        if departs or (s.own_limit and _past(v, check.op, limit)):
            away = abs(v - ref) if ref is not None else abs(v)
            picked.append((away, w, ref))
    picked.sort(key=lambda p: (-p[0], p[1]))
    names = {w for _, w, _ in picked[:TOP]}
    out = []
    for _, w, ref in picked[:TOP]:
        v = s.values[w]
        rest = [o for name, o in s.values.items() if name not in names]
        t = st.worker_pool.topo_of(w)
        out.append({"worker": w, "value": v, "measure": s.measure, "unit": s.unit, "node": t.node if t else None,
                    "peers": ref, "why": _why(w, v, rest, s)})
    return out


def _why(worker: str, value: float, rest: list[float], s: WorkerSeries) -> str:
    """``w1: 86 s since its last KV event; the others ≤ 5 s`` (the bound of the workers not listed)."""
    mine = f"{worker}: {_reads(value, s)}"
    if not rest:
        return mine
    if s.unit == "":
        return f"{mine}; the {len(rest)} others are up"
    bound = max(rest) if s.high_is_bad else min(rest)
    sign = "≤" if s.high_is_bad else "≥"
    return f"{mine}; the others {sign} {format_reading(bound, s.unit)}"


def _prefixes(st: ClusterState, stats: TreeStats, name: Namer | None) -> list[dict[str, Any]]:
    now, w = st.time.now, st.window_s
    before = st.branch_hits(now - 2 * w, now - w, stats)
    after = st.branch_hits(now - w, now, stats)
    lost = {b: tok - after.get(b, (0.0, set()))[0] for b, (tok, _s) in before.items()}
    ranked = sorted((b for b, n in lost.items() if n > 0 and n >= LOST_SHARE * before[b][0]),
                    key=lambda b: (-lost[b], b))
    kv = st.attribution.kv
    out = []
    for b in ranked[:TOP]:
        holders = st.index.holders(b)
        had, has = before[b][0], after.get(b, (0.0, set()))[0]
        adapter, tenant = kv.labels_of(b, holders)
        entry: dict[str, Any] = {"branch": branch_label(b), "hit_tokens": has, "lost_hit_tokens": lost[b],
                                 "workers": holders, "text": None, "token_ids": None, "tenant": tenant,
                                 "adapter": adapter,
                                 "why": f"cached tokens fell from {format_reading(had, 'tokens')} to "
                                        f"{format_reading(has, 'tokens')} against the previous window"}
        if name is not None:
            entry.update(name(b, holders))
        out.append(entry)
    return out


def _sessions(st: ClusterState) -> list[dict[str, Any]]:
    cutoff = st.time.now - st.window_s
    rows = [(s.followup_cached / s.followup_prompt, s) for s in st.sessions.sessions()
            if s.last_ts > cutoff and s.followup_prompt > 0]
    if len(rows) < 2:
        return []
    out = []
    for ratio, s in sorted(rows, key=lambda rs: (rs[0], rs[1].key)):
        ref = median(r for r, o in rows if o is not s)
        if ref - ratio < SESSION_MARGIN or len(out) >= TOP:
            break
        out.append({"session": s.key, "worker": s.worker, "hit_ratio": ratio, "turns": s.turn, "peers": ref,
                    "why": f"{s.key}: {format_reading(ratio, 'ratio')} of its follow-up tokens cached; the other "
                           f"sessions' median {format_reading(ref, 'ratio')}"})
    return out


INSTABILITY_KEY = "prefix_root_instability"


def _near_duplicates(st: ClusterState, name: Namer | None) -> list[dict[str, Any]]:
    """The newest near-duplicate pair of root branches, if it was seen within the window."""
    pair = st.kv.roots.example
    if pair is None or pair.at < st.time.now - st.window_s:
        return []
    entry: dict[str, Any] = {
        "new_root": branch_label(pair.new_root), "recent_root": branch_label(pair.recent_root),
        "worker": pair.worker, "at": pair.at, "span_offset": pair.span_offset, "span_length": pair.span_length,
        "new_token_ids": None, "recent_token_ids": None, "new_text": None, "recent_text": None}
    if name is not None:  # prompt content leaves the exporter only when prefix text is on
        entry["new_token_ids"], entry["recent_token_ids"] = list(pair.new_tokens), list(pair.recent_tokens)
        entry["new_text"] = name(pair.new_root, st.index.holders(pair.new_root)).get("text")
        entry["recent_text"] = name(pair.recent_root, st.index.holders(pair.recent_root)).get("text")
    return [entry]


def _nodes(workers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    nodes: dict[str, list[str]] = {}
    for w in workers:
        if w["node"] is not None:
            nodes.setdefault(str(w["node"]), []).append(str(w["worker"]))
    return [{"node": n, "workers": ws} for n, ws in nodes.items()]


class Culprits:
    """Culprits of several checks from one read of the state (prefixes and sessions are read once)."""

    def __init__(self, st: ClusterState, name: Namer | None = None) -> None:
        self.st = st
        self.name = name
        self._prefixes: list[dict[str, Any]] | None = None
        self._sessions: list[dict[str, Any]] | None = None

    def prefixes(self) -> list[dict[str, Any]]:
        if self._prefixes is None:
            self._prefixes = _prefixes(self.st, self.st.tree_stats() or NO_TREE, self.name)
        return self._prefixes

    def sessions(self) -> list[dict[str, Any]]:
        if self._sessions is None:
            self._sessions = _sessions(self.st)
        return self._sessions

    def of(self, check: catalog.Check) -> dict[str, Any]:
        workers = _workers(self.st, check, None if check.baseline else self.st.thresholds.value(check))
        return {"workers": workers,
                "prefixes": self.prefixes() if check.key in PREFIX_CHECKS else [],
                "sessions": self.sessions() if check.key in SESSION_CHECKS else [],
                "nodes": _nodes(workers),
                "near_duplicates": _near_duplicates(self.st, self.name) if check.key == INSTABILITY_KEY else []}
