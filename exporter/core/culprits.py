"""Who drives a check's number: the workers, prefixes, sessions and nodes behind it.

Read from what the state already holds, under its lock (``ClusterState.snapshot_for``):

- *workers*: the check's own per-worker series where it has one (KV-event silence, resident
  blocks per capacity, warm-pool use, workers down); otherwise the workers whose recent hit
  ratio is lowest, where a falling hit rate lands. Each names what it was ranked by.
- *prefixes*: the branches that lost the most hit tokens against the previous window, then the
  hottest ones, with the workers holding them and, when text is on, their first words.
- *sessions*: the sessions of the window whose follow-ups reused the least.
- *nodes*: the topology nodes of those workers.
- *near_duplicates* (prefix instability only): the newest pair of root branches of the window
  whose openings are the same but for a short early span, with where they differ and, when text
  is on, their first tokens and words; empty for the other checks.

Only breaching checks get culprits on ``/api/v1/groups``; ``/api/v1/culprits`` answers any.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from exporter.core.hotspots import branch_label
from exporter.core.index.prefix_index import TreeStats
from exporter.core.state import NO_TREE, ClusterState
from prefixscope import catalog

TOP = 3
P = catalog.NAMESPACE
_KV_LAST_TS = f"{P}_kv_event_last_timestamp_seconds"

# block, holders -> {"text", "token_ids"}
Namer = Callable[[int, list[str]], Mapping[str, Any]]


@dataclass(frozen=True)
class WorkerRanking:
    measure: str  # what the value is, for a person
    unit: str  # a catalogue unit (prefixscope.units)
    values: dict[str, float]
    worst_first_high: bool  # True: the highest value drives the check


def _worker_ranking(st: ClusterState, check: catalog.Check) -> WorkerRanking:
    key = check.key
    if key == "kv_event_staleness":
        now = st.clock()
        _, gauges = st.health.snapshot()
        return WorkerRanking("seconds since its last KV event", "seconds",
                             {lab[0]: now - ts for lab, ts in gauges.get(_KV_LAST_TS, {}).items()}, True)
    if key == "prefix_block_count_per_worker":
        values = {}
        for w in st.workers_seen():
            cap = st.worker_capacity(w)
            if cap:
                values[w] = st.index.resident_blocks(w) / cap
        return WorkerRanking("resident blocks per capacity", "ratio", values, True)
    if key == "warm_pool_utilization":
        return WorkerRanking("warm-pool utilisation", "ratio", st.warm_pool_utilization(), True)
    if key == "targets_up":
        return WorkerRanking("down (0) while traffic reaches it", "",
                             {w: 0.0 for w in st.workers_seen() if not st.is_healthy(w)}, False)
    ratios = {w: r for w in st.workers_seen() if (r := st.worker_hit_ratio(w)) is not None}
    return WorkerRanking("recent hit ratio", "ratio", ratios, False)


def _workers(st: ClusterState, check: catalog.Check) -> list[dict[str, Any]]:
    r = _worker_ranking(st, check)
    order = sorted(r.values, key=lambda w: (-r.values[w] if r.worst_first_high else r.values[w], w))
    out = []
    for w in order[:TOP]:
        t = st.topo_of(w)
        out.append({"worker": w, "value": r.values[w], "measure": r.measure, "unit": r.unit,
                    "node": t.node if t else None})
    return out


def _prefixes(st: ClusterState, stats: TreeStats, name: Namer | None) -> list[dict[str, Any]]:
    now, w = st.now, st.window_s
    before = st.branch_hits(now - 2 * w, now - w, stats)
    after = st.branch_hits(now - w, now, stats)
    lost = {b: tok - after.get(b, (0.0, set()))[0] for b, (tok, _s) in before.items()}
    ranked = sorted((b for b, n in lost.items() if n > 0), key=lambda b: (-lost[b], b))
    ranked += [b for b in sorted(after, key=lambda b: (-after[b][0], b)) if b not in ranked]
    out = []
    for b in ranked[:TOP]:
        holders = st.index.holders(b)
        entry: dict[str, Any] = {"branch": branch_label(b), "hit_tokens": after.get(b, (0.0, set()))[0],
                                 "lost_hit_tokens": max(lost.get(b, 0.0), 0.0), "workers": holders,
                                 "text": None, "token_ids": None}
        if name is not None:
            entry.update(name(b, holders))
        out.append(entry)
    return out


def _sessions(st: ClusterState) -> list[dict[str, Any]]:
    cutoff = st.now - st.window_s
    rows = [(s.followup_cached / s.followup_prompt, s) for s in st.sessions.sessions()
            if s.last_ts > cutoff and s.followup_prompt > 0]
    rows.sort(key=lambda rs: (rs[0], rs[1].key))
    return [{"session": s.key, "worker": s.worker, "hit_ratio": ratio, "turns": s.turn} for ratio, s in rows[:TOP]]


INSTABILITY_KEY = "prefix_root_instability"


def _near_duplicates(st: ClusterState, name: Namer | None) -> list[dict[str, Any]]:
    """The newest near-duplicate pair of root branches, if it was seen within the window."""
    pair = st.roots.example
    if pair is None or pair.at < st.now - st.window_s:
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
    """Culprits of several checks from one read of the state (prefixes and sessions are shared)."""

    def __init__(self, st: ClusterState, name: Namer | None = None) -> None:
        self.st = st
        stats = st.tree_stats() or NO_TREE
        self.prefixes = _prefixes(st, stats, name)
        self.sessions = _sessions(st)
        self.near_duplicates = _near_duplicates(st, name)

    def of(self, check: catalog.Check) -> dict[str, Any]:
        workers = _workers(self.st, check)
        return {"workers": workers, "prefixes": self.prefixes, "sessions": self.sessions, "nodes": _nodes(workers),
                "near_duplicates": self.near_duplicates if check.key == INSTABILITY_KEY else []}
