"""Pure builders of the /api/v1 payloads (groups, tree, hotspots, changes, workers) as docs/api.md documents.

Each builder takes the state and the query parameters and returns the ``data`` part of the
answer; a bad parameter raises :class:`ApiError` (the HTTP edge answers 400). Values without a
source are ``None`` (null), never 0. Tree statistics come from the latest completed background
pass (``ClusterState.refresh_tree_stats``); no builder runs one, except a tree request deeper
than the pass keeps child lists for, which gets a pass of its own outside the state lock.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from exporter.core.breaches import BreachClock
from exporter.core.checks import CheckResult, evaluate
from exporter.core.culprits import Culprits, Namer
from exporter.core.index.prefix_index import ROOT, TreeStats
from exporter.core.index.tiers import GPU, medium_capacity
from exporter.core.prefix_text import Ask, PrefixNames, PrefixTokens, short_text
from exporter.core.state import NO_TREE, TREE_CHILDREN_DEPTH, ClusterState, branch_label
from exporter.core.windows import bucket_counts, histogram_quantile
from exporter.web.server import BadRequest
from prefixscope import catalog, diagnosis

P = catalog.NAMESPACE


# The HTTP edge answers this exception with 400.
ApiError = BadRequest


def _int(query: Mapping[str, str], name: str, default: int, lo: int, hi: int) -> int:
    raw = query.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ApiError(f"{name}: expected an integer, got {raw!r}") from None
    if not lo <= value <= hi:
        raise ApiError(f"{name}: must be between {lo} and {hi}, got {value}")
    return value


def _float(query: Mapping[str, str], name: str) -> float | None:
    raw = query.get(name)
    if raw is None or raw == "":
        return None
    try:
        return float(raw)
    except ValueError:
        raise ApiError(f"{name}: expected Unix seconds, got {raw!r}") from None


def groups(state: ClusterState, query: Mapping[str, str] | None = None, breaches: BreachClock | None = None,
           names: PrefixNames | None = None) -> dict[str, Any]:
    ev = evaluate(state)
    base = state.thresholds.runbook_url_base if hasattr(state.thresholds, "runbook_url_base") else ""
    now = ev.evaluated_at
    since = breaching_since(ev.results, breaches.since() if breaches is not None else {}, now)
    # breaching on the window, yet back within the limit over the last minute for the settle time
    settled = {k for k in (breaches.settled(now) if breaches is not None else ()) if k in since}
    alert_states: dict[str, diagnosis.AlertState] = {}
    fires_in: dict[str, float | None] = {}
    for key, r in ev.results.items():
        for_s = state.thresholds.for_s(r.check)
        start = since.get(key)
        alert_states[key] = diagnosis.alert_state(r.status, None if start is None else now - start, for_s)
        fires_in[key] = max(0.0, start + for_s - now) if start is not None and alert_states[key] == "pending" else None
    breaching = [catalog.CHECKS_BY_KEY[k] for k, r in ev.results.items() if r.status == diagnosis.FIRING]
    culprits = (state.snapshot_for(lambda st: {c.key: Culprits(st, _namer(st, names)).of(c) for c in breaching})
                if breaching else {})
    steps = []
    for step in catalog.STEPS:
        checks = []
        for r in ev.results.values():
            if r.check.group != step.number:
                continue
            c = r.check
            checks.append({
                "key": c.key, "title": c.title, "alert": c.alert, "value": r.value, "op": c.op,
                "threshold": r.threshold, "baseline": r.baseline, "unit": c.unit, "kind": c.kind,
                "severity": r.severity, "status": r.status, "missing_signals": r.missing_signals,
                "runbook": f"runbooks/{c.alert}.md", "runbook_url": f"{base}{c.alert}.md" if base else None,
                "for_s": state.thresholds.for_s(c), "breaching_since": since.get(c.key),
                "alert_state": alert_states[c.key], "fires_in_s": fires_in[c.key], "settled": c.key in settled,
                "culprits": culprits.get(c.key),
            })
        steps.append({"step": step.number, "title": step.title, "question": step.question,
                      "status": ev.step_status[step.number], "checks": checks})
    symptom = ev.results.get("prefix_hit_rate_total")
    return {
        "window_s": ev.window_s,
        "evaluated_at": ev.evaluated_at,
        "signals": ev.signals,
        "steps": steps,
        "verdict": ev.verdict,
        "headline": diagnosis.headline(alert_states, diagnosis.context_checks(state.thresholds.severities),
                                       fires_in, settled).as_dict(),
        "symptom": {"prefix_hit_rate_total": symptom.value if symptom else None,
                    "firing": symptom.status == "firing" if symptom else False},
        "reuse": ev.reuse,
    }


def breaching_since(results: Mapping[str, CheckResult], recorded: Mapping[str, float], now: float) -> dict[str, float]:
    """Check key → breaching since, for the checks this evaluation finds breaching.

    The start is the background record's (``exporter.loops.breach_loop``); a breach the record has not
    seen yet (it began after the loop's latest evaluation) starts now. A recorded start after
    ``now`` (input time went back) also starts now; a recorded check no longer breaching is not one.
    """
    out: dict[str, float] = {}
    for key, r in results.items():
        if r.status == diagnosis.FIRING:
            start = recorded.get(key)
            out[key] = now if start is None or start > now else start
    return out


# Tokens of a branch's run turned into its name: a sentence or two, not one block's worth
# ("Acme billing ass" is 16 byte tokens), and at most this many characters of text.
NAME_TOKENS = 128
NAME_CHARS = 400


def run_tokens(tokens: PrefixTokens, run: Sequence[int], limit: int = NAME_TOKENS) -> tuple[int, ...]:
    """The kept tokens of a branch's run, block after block while each block was kept whole
    (fewer tokens than the keeper's per-block cap: the next block continues the text)."""
    out: list[int] = []
    for block in run:
        toks = tokens.get(block)
        if not toks:
            break
        out.extend(toks)
        if len(out) >= limit or len(toks) >= tokens.max_tokens:
            break
    return tuple(out[:limit])


def _namer(st: ClusterState, names: PrefixNames | None, stats: TreeStats | None = None) -> Namer | None:
    """Branch names: the text of the branch's run when prefix text is on (else None), with the
    tenant and LoRA adapter its first block was stored for (attribution on) either way."""
    if names is None:
        return None
    kv = st.attribution.kv
    models = {w: info.snapshot.model for w, info in st.worker_pool.workers.items() if info.snapshot is not None}
    run_of = (stats or st.tree_stats() or NO_TREE).run

    def name(block: int, holders: list[str]) -> dict[str, Any]:
        adapter, tenant = kv.labels_of(block, holders)
        toks = run_tokens(names.tokens, run_of(block) or (block,))
        if not toks:
            return {"text": None, "token_ids": None, "tenant": tenant, "adapter": adapter}
        # Keyed by the branch and how many tokens it names: a longer run learnt later is asked again.
        key = hash((block, len(toks)))
        text = names.detokenizer.text(key)
        if text is None:
            urls = names.worker_urls
            order = [*holders, *(w for w in urls if w not in holders)]
            names.detokenizer.want(Ask(key, toks, tuple((urls[w], models.get(w)) for w in order if w in urls)[:3]))
        return {"text": None if text is None else short_text(text, NAME_CHARS), "token_ids": list(toks),
                "tenant": tenant, "adapter": adapter}
    return name


def _labels(st: ClusterState, block: int, holders: list[str]) -> dict[str, Any]:
    """The tenant and adapter of a branch when prefix text is off (no text, no tokens)."""
    adapter, tenant = st.attribution.kv.labels_of(block, holders)
    return {"text": None, "token_ids": None, "tenant": tenant, "adapter": adapter}


def culprits(state: ClusterState, query: Mapping[str, str] | None = None,
             names: PrefixNames | None = None) -> dict[str, Any]:
    """Culprits of the checks named in ``checks`` (comma-separated keys), or of every check."""
    raw = (query or {}).get("checks") or ""
    keys = [k for k in (x.strip() for x in raw.split(",")) if k]
    unknown = [k for k in keys if k not in catalog.CHECKS_BY_KEY]
    if unknown:
        raise ApiError(f"checks: unknown check keys {', '.join(unknown)}")
    wanted = [catalog.CHECKS_BY_KEY[k] for k in keys] if keys else list(catalog.CHECKS)
    return state.snapshot_for(lambda st: {"checks": {c.key: Culprits(st, _namer(st, names)).of(c) for c in wanted}})


def _hex(block: int) -> str:
    return f"{block & 0xFFFFFFFFFFFFFFFF:016x}"


def tree(state: ClusterState, query: Mapping[str, str] | None = None,
         names: PrefixNames | None = None) -> dict[str, Any]:
    query = query or {}
    max_depth = _int(query, "depth", TREE_CHILDREN_DEPTH, 1, 16)  # the background pass covers the default
    limit = _int(query, "limit", 200, 1, 10_000)
    by = query.get("by", "hits")
    if by not in ("hits", "blocks"):
        raise ApiError(f"by: expected hits or blocks, got {by!r}")
    stats = state.tree_stats_with_children(max_depth)  # before the lock: it may copy under it
    return state.snapshot_for(lambda st: _tree(st, stats, max_depth, limit, by, _namer(st, names, stats)))


def _tree(st: ClusterState, latest: TreeStats | None, max_depth: int, limit: int, by: str,
          name: Namer | None = None) -> dict[str, Any]:
    index = st.index
    stats = latest or NO_TREE
    kids = stats.children
    budget = [limit]

    run_of = stats.run  # the blocks of one radix node, up to the next branch or leaf

    def node(first: int, depth_blocks: int, edge_depth: int) -> dict[str, Any]:
        run = run_of(first)
        last = run[-1]
        hit = sum(index.hit_tokens(b) for b in run)
        holders = index.holders(first)
        out: dict[str, Any] = {
            "id": _hex(first), "label": f"{_hex(first)[:8]}…({len(run)} blocks)", "blocks": len(run),
            "depth_blocks": depth_blocks + len(run), "hit_tokens": hit,
            "resident_workers": holders,
            **(name(first, holders) if name is not None else _labels(st, first, holders)),
            "children": [],
        }
        budget[0] -= 1
        if edge_depth < max_depth:
            out["children"] = children(kids.get(last, []), depth_blocks + len(run), edge_depth + 1)
        return out

    def children(blocks: list[int], depth_blocks: int, edge_depth: int) -> list[dict[str, Any]]:
        key = (lambda b: -index.hit_tokens(b)) if by == "hits" else (lambda b: -len(run_of(b)))
        out = []
        for b in sorted(blocks, key=lambda b: (key(b), b)):
            if budget[0] <= 0:
                break
            out.append(node(b, depth_blocks, edge_depth))
        return out

    root = {"id": "root", "children": children(kids.get(ROOT, []), 0, 1)}
    if latest is None:  # no statistics pass yet: the tree is missing, not empty
        return {"root": root, "stats": {"nodes": None, "blocks": None, "root_fanout": None,
                                        "depth_p99": None, "block_depth_p99": None}}
    depth_p99 = _p99(catalog.DEPTH_BUCKETS, stats.leaf_depths)
    block_p99 = _p99(catalog.DEPTH_BUCKETS, stats.leaf_block_depths)
    return {"root": root, "stats": {"nodes": stats.nodes, "blocks": stats.blocks, "root_fanout": stats.root_fanout,
                                    "depth_p99": depth_p99, "block_depth_p99": block_p99}}


def _p99(bounds: tuple[float, ...], values: list[int]) -> float | None:
    counts, _ = bucket_counts(bounds, values)
    return histogram_quantile(0.99, bounds, counts)


def _histogram_pairs(values: Any) -> list[list[int]]:
    tally = values if isinstance(values, Counter) else Counter(values)
    return [[int(v), int(n)] for v, n in sorted(tally.items())]


def hotspots(state: ClusterState, query: Mapping[str, str] | None = None,
             names: PrefixNames | None = None) -> dict[str, Any]:
    k = _int(query or {}, "k", state.top_k, 1, 1000)
    return state.snapshot_for(lambda st: _hotspots(st, k, _namer(st, names, st.tree_stats())))


def _hotspots(st: ClusterState, k: int, name: Namer | None = None) -> dict[str, Any]:
    index = st.index
    latest = st.tree_stats()  # its kept runs cover the hot branches (radix depth ≤ 2)
    stats = latest or NO_TREE
    hot = []
    for rank, (b, tok, sessions) in enumerate(st.hot_branches(k, stats), start=1):
        holders = index.holders(b)
        text: Mapping[str, Any] = name(b, holders) if name is not None else _labels(st, b, holders)
        hot.append({"rank": rank, "branch": branch_label(b), "hit_tokens": tok, "blocks": len(stats.run(b)),
                    "workers": holders, "sessions": sessions, **text})
    reps = stats.replicas
    total = sum(reps.values())
    dup: dict[str, Any] = {
        "blocks_on_1": reps.get(1, 0), "blocks_on_2": reps.get(2, 0),
        "blocks_on_3_plus": sum(n for r, n in reps.items() if r >= 3),
        "duplicated_share": (sum(n for r, n in reps.items() if r >= 2) / total) if total else None}
    if latest is None:  # no statistics pass yet: missing, never 0
        dup = dict.fromkeys(dup)
    values = st.scrapes.effective_cache_values()
    ranks = st.scrapes.removal_ranks(values)
    workers = []
    for w in st.workers_seen():
        t = st.worker_pool.topo_of(w)
        workers.append({
            "worker": w, "resident_blocks": index.resident_blocks(w, GPU), "capacity_blocks": st.worker_pool.worker_capacity(w),
            "effective_cache_value_tokens": values.get(w), "removal_rank": ranks.get(w),
            "node": t.node if t else None, "nvlink_domain": t.nvlink_domain if t else None,
            "gpu_class": t.gpu_class if t else None, "warm_pool": t.warm_pool if t else None,
        })
    return {"hot_branches": hot,
            "fanout": {"buckets": _histogram_pairs(stats.fanouts),
                       "root_fanout": stats.root_fanout if latest is not None else None},
            "depth": {"buckets": _histogram_pairs(stats.leaf_depths)},
            "duplication": dup, "workers": workers}


# The KV-stream health of one worker in /api/v1/workers: field -> the Health counter it sums
# (every label set of the worker), counted since the exporter started.
KV_STREAM_COUNTERS = {
    "batches": f"{P}_kv_event_batches", "sequence_gaps": f"{P}_kv_event_sequence_gaps",
    "missed_batches": f"{P}_kv_event_missed_batches", "lost_batches": f"{P}_kv_event_lost_batches",
    "repairs": f"{P}_kv_index_repairs", "restarts": f"{P}_worker_restarts",
    "unknown_parent": f"{P}_kv_event_unknown_parent", "unknown_block_removals": f"{P}_kv_event_unknown_block_removals",
}


def workers(state: ClusterState, query: Mapping[str, str] | None = None) -> dict[str, Any]:
    """One row per worker the exporter follows: liveness, scrape, cache, hits, KV stream health."""
    return state.snapshot_for(_workers)


def _workers(st: ClusterState) -> dict[str, Any]:
    pool = st.worker_pool
    pool.track_down_targets()
    down = pool.explicitly_down()
    names = st.workers_seen()
    liveness = {w: pool.liveness(w, down) for w in names}
    # A worker that left the pool is no candidate for removal: only the others are ranked.
    values = st.scrapes.effective_cache_values()
    ranks = st.scrapes.removal_ranks({w: v for w, v in values.items() if liveness[w] != "left"})
    hits = {w: st.scrapes.worker_hit_tokens(w) for w in names}
    total_hits = sum(h for h in hits.values() if h is not None)
    counters, gauges = st.health.snapshot()
    media = st.index.resident_by_medium()
    rows = []
    for w in names:
        info = st.worker_pool.workers.get(w)
        snap = info.snapshot if info is not None else None
        t = st.worker_pool.topo_of(w)
        since = pool.down_since.get((w, "worker"))
        rows.append({
            "worker": w, "liveness": liveness[w], "down_since": since if liveness[w] != "up" else None,
            "last_seen": (info.last_seen or None) if info else None,
            "last_served": (info.last_served or None) if info else None,
            "last_scrape_at": info.scraped_at if info else None,
            "resident_blocks": st.index.resident_blocks(w, GPU), "resident_blocks_by_medium": media.get(w),
            "capacity_blocks": st.worker_pool.worker_capacity(w),
            "capacity_blocks_by_medium": medium_capacity(st.worker_pool.worker_capacity(w),
                                                         snap.offload_usage_ratio if snap is not None else None,
                                                         media.get(w)) or None,
            "kv_cache_usage_ratio": snap.kv_usage_ratio if snap is not None else None,
            "hit_tokens": hits[w], "hit_share": hits[w] / total_hits if hits[w] is not None and total_hits else None,
            "hit_ratio": st.scrapes.worker_hit_ratio(w), "hit_tokens_by_tier": st.scrapes.worker_tier_hit_tokens(w),
            "external_queried_tokens": st.store.own_sum(("worker_delta", "external_queried_tokens", w)),
            "external_hit_tokens": st.store.own_sum(("worker_delta", "external_hit_tokens", w)),
            # LMCache as the engine's KV connector, in the window: its lookups and its time per operation
            "lmcache_lookup_queried_tokens": st.store.own_sum(("worker_delta", "lmcache_lookup_tokens", w)),
            "lmcache_lookup_hit_tokens": st.store.own_sum(("worker_delta", "lmcache_lookup_hit_tokens", w)),
            "lmcache_seconds_p50": st.scrapes.worker_histogram_quantiles(w, "lmcache_seconds", 0.5),
            "lmcache_seconds_p99": st.scrapes.worker_histogram_quantiles(w, "lmcache_seconds", 0.99),
            # vLLM's sampled block residency (--kv-cache-metrics), medians in the window
            "residency_p50_s": st.scrapes.worker_histogram_quantiles(w, "residency", 0.5),
            "effective_cache_value_tokens": values.get(w), "removal_rank": ranks.get(w),
            "node": t.node if t else None, "nvlink_domain": t.nvlink_domain if t else None,
            "gpu_class": t.gpu_class if t else None, "warm_pool": t.warm_pool if t else None,
            "kv_stream": _kv_stream(w, counters, gauges),
            # sessions that migrated away from this worker in the window, by kind (records report it)
            "migrated_away": {k: n for k in ("hard", "soft")
                              if (n := st.store.own_sum(("migrated_away", w, k))) is not None} or None,
        })
    return {"evaluated_at": st.clock(), "window_s": st.window_s, "pool_size": len(pool.pool), "workers": rows}


def _kv_stream(worker: str, counters: Mapping[str, Mapping[tuple[str, ...], float]],
               gauges: Mapping[str, Mapping[tuple[str, ...], float]]) -> dict[str, Any]:
    """The worker's KV-event stream health; every field null for a worker that sent no KV events."""
    batches = counters.get(KV_STREAM_COUNTERS["batches"], {})
    streams = (worker,) in batches
    out: dict[str, Any] = {
        "last_event_at": gauges.get(f"{P}_kv_event_last_timestamp_seconds", {}).get((worker,)),
        "lag_s": gauges.get(f"{P}_kv_event_lag_seconds", {}).get((worker,)),
    }
    for field, metric in KV_STREAM_COUNTERS.items():
        series = counters.get(metric, {})
        mine = [v for labels, v in series.items() if labels and labels[0] == worker]
        out[field] = float(sum(mine)) if mine or streams else None
    unreliable = gauges.get(f"{P}_kv_view_unreliable", {}).get((worker,))
    out["view_unreliable"] = None if unreliable is None else unreliable == 1.0
    return out


def changes(state: ClusterState, query: Mapping[str, str] | None = None,
            names: PrefixNames | None = None) -> dict[str, Any]:
    query = query or {}
    t_from, t_to = _float(query, "from"), _float(query, "to")
    if t_from is not None and t_to is not None and t_from > t_to:
        raise ApiError("from: must not be after to")
    return state.snapshot_for(lambda st: _changes(st, t_from, t_to, _namer(st, names)))


def _changes(st: ClusterState, t_from: float | None, t_to: float | None,
             name: Namer | None = None) -> dict[str, Any]:
    w = st.window_s
    to = st.time.now if t_to is None else t_to
    frm = to - w if t_from is None else t_from
    stats = st.tree_stats()
    before = st.branch_hits(frm - w, frm, stats)
    after = st.branch_hits(to - w, to, stats)
    lost = []
    for b, (tok, _s) in before.items():
        now_tok = after.get(b, (0.0, set()))[0]
        if now_tok < tok:
            lost.append({"block": b, "branch": branch_label(b), "before_hit_tokens": tok, "after_hit_tokens": now_tok})
    lost.sort(key=lambda x: x["after_hit_tokens"] - x["before_hit_tokens"])
    lost = lost[: st.top_k * 5]
    for row in lost:  # named after the cut: only the branches shown are looked up
        b = row.pop("block")
        holders = st.index.holders(b)
        row.update(name(b, holders) if name is not None else _labels(st, b, holders))
    new_keys: dict[str, int] = {}
    rekeys: dict[str, int] = {}
    for ts, segment, rekeyed in st.hotspots.session_events:
        if to - w < ts <= to:
            new_keys[segment] = new_keys.get(segment, 0) + 1
            rekeys[segment] = rekeys.get(segment, 0) + rekeyed
    segs = [{"segment": s, "rekeys": n, "share": n / new_keys[s]} for s, n in sorted(rekeys.items()) if n]
    pools = [{"ts": c.ts, "before": c.before, "after": c.after, "reshuffled_share": c.reshuffled_share}
             for c in st.worker_pool.changes if frm - w < c.ts <= to]
    return {"from": frm, "to": to, "lost_hits": lost, "rekeyed_segments": segs, "pool_changes": pools}


BUILDERS = {"groups": groups, "tree": tree, "hotspots": hotspots, "changes": changes, "culprits": culprits,
            "workers": workers}


class ApiBuilders:
    """The JSON API over one state: ``routes()`` maps endpoint name → builder(query) for the HTTP edge.

    It reads what outlives one request: the record of when each check began breaching (for
    pending vs firing; advanced by the exporter's ``BreachLoop``, never by a request) and, when
    prefix text is on, the names of branches. Without a record (``breaches=None``) nothing has
    been recorded: a breaching check starts at each request.
    """

    def __init__(self, state: ClusterState, names: PrefixNames | None = None,
                 breaches: BreachClock | None = None, shard: tuple[int, int] | None = None) -> None:
        """``shard``: (index, count) when this exporter is one of several family shards: every
        answer is then its part of the cluster, and ``groups`` and ``workers`` say so."""
        self.state = state
        self.names = names
        self.breaches = breaches if breaches is not None else BreachClock()
        self.shard = None if shard is None or shard[1] <= 1 else {"index": shard[0], "count": shard[1]}

    def routes(self) -> dict[str, Any]:
        st, names, shard = self.state, self.names, self.shard
        return {"groups": lambda q: {**groups(st, q, self.breaches, names), "shard": shard},
                "tree": lambda q: tree(st, q, names),
                "hotspots": lambda q: hotspots(st, q, names),
                "changes": lambda q: changes(st, q, names),
                "workers": lambda q: {**workers(st, q), "shard": shard},
                "culprits": lambda q: culprits(st, q, names)}
