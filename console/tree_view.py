"""Shapes the exporter's tree and hotspot answers into plot-ready columns (pure)."""

from __future__ import annotations

from collections.abc import Mapping

from console import prefixes
from console.liveness import Liveness, in_pool
from prefixscope.units import format_reading

METRIC_FIELD = {"hits": "hit_tokens", "blocks": "blocks"}


def _own(node: Mapping, field: str) -> float:
    value = node.get(field)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0


def _total(node: Mapping, field: str, memo: dict[int, float]) -> float:
    got = memo.get(id(node))
    if got is None:
        got = _own(node, field) + sum(_total(c, field, memo) for c in node.get("children") or [])
        memo[id(node)] = got
    return got


def node_label(node: Mapping, limit: int = 32) -> str:
    """A tree node as a person reads it: its first words, else its hash and length."""
    text = node.get("text")
    if isinstance(text, str) and text.strip():
        return prefixes.short(text, limit)
    blocks = node.get("blocks")
    size = f" ({blocks} blocks)" if isinstance(blocks, int) else ""
    return f"{str(node.get('id', '?'))[:8]}{size}"


def icicle_columns(root: Mapping, by: str, min_share: float = 0.02) -> dict[str, list]:
    """ids/labels/parents/values/hover for plotly's icicle (``branchvalues="total"``).

    Ids are paths (``root/3f2a/9c01``) so a node is unique even if a label repeats. Each value is
    the node's subtree total of hits or blocks. Labels are the prefixes' first words (hash and
    length when the exporter serves no text). Siblings whose subtree is under ``min_share`` of the
    whole would be unreadable slivers: two or more of them collapse into one "n more" node.
    """
    field = METRIC_FIELD[by]
    memo: dict[int, float] = {}
    grand = _total(root, field, memo)
    floor = grand * min_share
    cols: dict[str, list] = {"ids": [], "labels": [], "parents": [], "values": [], "hover": []}

    def add(id_: str, label: str, parent: str, value: float, hover: str) -> None:
        cols["ids"].append(id_)
        cols["labels"].append(label)
        cols["parents"].append(parent)
        cols["values"].append(value)
        cols["hover"].append(hover)

    def hover(node: Mapping, value: float) -> str:
        parts = [prefixes.of(node, limit=200) or f"branch {node.get('id', '?')}",
                 f"{format_reading(value, 'tokens' if by == 'hits' else 'blocks')}"
                 f"{' cached in the window' if by == 'hits' else ' in this branch'}"]
        holders = node.get("resident_workers") or []
        if holders:
            parts.append(f"held by {', '.join(str(w) for w in holders)}")
        return "<br>".join(parts)

    add("root", "all prefixes", "", grand, f"all prefixes<br>{format_reading(grand, 'tokens' if by == 'hits' else 'blocks')}")
    stack: list[tuple[Mapping, str]] = [(root, "root")]
    while stack:
        node, path = stack.pop()
        kids = sorted(node.get("children") or [], key=lambda c: -_total(c, field, memo))
        shown = [c for c in kids if _total(c, field, memo) >= floor]
        small = [c for c in kids if _total(c, field, memo) < floor]
        if len(small) == 1:
            shown, small = shown + small, []
        for child in shown:
            child_path = f"{path}/{child.get('id', '?')}"
            value = _total(child, field, memo)
            add(child_path, node_label(child), path, value, hover(child, value))
            stack.append((child, child_path))
        if small:
            value = sum(_total(c, field, memo) for c in small)
            names = "<br>".join(node_label(c) for c in small[:8]) + ("<br>…" if len(small) > 8 else "")
            add(f"{path}/more", f"{len(small)} more", path, value, f"{len(small)} smaller branches<br>{names}")
    return cols


def bucket_rows(buckets: list, x: str, y: str = "count") -> list[dict]:
    """``[[1, 10], [2, 4]]`` → ``[{x: 1, y: 10}, ...]``, skipping malformed pairs."""
    return [{x: b[0], y: b[1]} for b in buckets or [] if isinstance(b, list | tuple) and len(b) == 2]


def capacity_rows(workers: list[Mapping], liveness: Mapping[str, Liveness] | None = None) -> list[dict]:
    """Per worker: liveness, resident blocks against capacity (None when a side is not instrumented)."""
    rows = []
    for w in workers:
        resident, capacity = w.get("resident_blocks"), w.get("capacity_blocks")
        used = resident / capacity if isinstance(resident, int | float) and isinstance(capacity, int | float) and capacity else None
        rows.append({"worker": w.get("worker"), "liveness": (liveness or {}).get(str(w.get("worker")), "unknown"),
                     "resident_blocks": resident, "capacity_blocks": capacity,
                     "used": used, "effective_cache_value_tokens": w.get("effective_cache_value_tokens"),
                     "removal_rank": w.get("removal_rank"), "node": w.get("node"),
                     "nvlink_domain": w.get("nvlink_domain"), "gpu_class": w.get("gpu_class"),
                     "warm_pool": w.get("warm_pool")})
    return rows


def stream_rows(workers: list[Mapping], liveness: Mapping[str, Liveness], now: float | None) -> list[dict]:
    """Per worker of ``/api/v1/workers``: liveness, how long since its last scrape and KV event
    (seconds before ``now``), its share of the window's hit tokens, and its KV stream's gaps."""
    def age(at: object) -> float | None:
        return now - at if isinstance(at, int | float) and isinstance(now, int | float) else None

    rows = []
    for w in workers:
        kv = w.get("kv_stream") or {}
        rows.append({"worker": w.get("worker"), "liveness": liveness.get(str(w.get("worker")), "unknown"),
                     "node": w.get("node"), "resident_blocks": w.get("resident_blocks"),
                     "hit_share": w.get("hit_share"), "last_scrape_s_ago": age(w.get("last_scrape_at")),
                     "last_kv_event_s_ago": age(kv.get("last_event_at")), "kv_sequence_gaps": kv.get("sequence_gaps"),
                     "kv_lost_batches": kv.get("lost_batches")})
    return rows


def removal_ranking(workers: list[Mapping], liveness: Mapping[str, Liveness] | None = None) -> list[dict]:
    """Safest to remove first: ranked workers by rank, unranked (not instrumented) last.

    A worker that has left the pool is not a candidate: it is left out, and the ranks of the
    others are renumbered 1, 2, … in the exporter's order.
    """
    live = liveness or {}
    rows = [r for r in capacity_rows(workers, live) if in_pool(live, str(r["worker"]))]
    rows.sort(key=lambda r: (r["removal_rank"] is None, r["removal_rank"] or 0, str(r["worker"])))
    rank = 0
    for r in rows:
        if r["removal_rank"] is not None:
            rank += 1
            r["removal_rank"] = rank
    return rows


def left_pool(workers: list[Mapping], liveness: Mapping[str, Liveness]) -> list[dict]:
    """Workers that have left the pool, with the cache the exporter still attributes to them."""
    return [{"worker": r["worker"], "resident_blocks": r["resident_blocks"], "node": r["node"]}
            for r in capacity_rows(workers, liveness) if not in_pool(liveness, str(r["worker"]))]


def prefix_name(branch: Mapping) -> str:
    """A branch's words (the exporter's ``text``) with its tenant and adapter, else its first
    token ids, else "—"."""
    return prefixes.of(branch) or "—"


def hot_branch_rows(branches: list[Mapping], liveness: Mapping[str, Liveness]) -> list[dict]:
    """Hot branches with their words next to the hash, and the workers holding them minus
    workers that have left the pool."""
    rows = []
    for b in branches:
        holders = [str(w) for w in b.get("workers") or [] if in_pool(liveness, str(w))]
        text = b.get("text")
        rows.append({"rank": b.get("rank"), "prefix": prefixes.of(b, limit=None) or "—",
                     "tenant": b.get("tenant"), "adapter": b.get("adapter"), "hit_tokens": b.get("hit_tokens"),
                     "sessions": b.get("sessions"), "blocks": b.get("blocks"), "workers": ", ".join(holders),
                     "branch": b.get("branch"), "text": text if isinstance(text, str) else None})
    return rows


def lost_rows(lost: list[Mapping]) -> list[dict]:
    """Branches that lost hits, named by their words (their hash last)."""
    return [{"prefix": prefixes.of(b, limit=None) or "—", "before_hit_tokens": b.get("before_hit_tokens"),
             "after_hit_tokens": b.get("after_hit_tokens"), "branch": b.get("branch")} for b in lost]


def domain_rows(workers: list[Mapping]) -> list[dict]:
    """Workers per NVLink domain with their resident blocks (placement context)."""
    domains: dict[str, dict] = {}
    for r in capacity_rows(workers):
        d = domains.setdefault(str(r["nvlink_domain"] or "unknown"),
                               {"nvlink_domain": str(r["nvlink_domain"] or "unknown"), "node": r["node"],
                                "workers": [], "resident_blocks": 0.0})
        d["workers"].append(str(r["worker"]))
        if isinstance(r["resident_blocks"], int | float):
            d["resident_blocks"] += r["resident_blocks"]
    return [d | {"workers": ", ".join(d["workers"])} for d in sorted(domains.values(), key=lambda d: d["nvlink_domain"])]


def migration_rows(workers: list[Mapping], liveness: Mapping[str, Liveness]) -> list[dict]:
    """Workers whose sessions migrated away in the window (``migrated_away``), most first."""
    rows = []
    for w in workers:
        away = w.get("migrated_away") or {}
        hard, soft = away.get("hard"), away.get("soft")
        if not hard and not soft:
            continue
        rows.append({"worker": w.get("worker"), "liveness": liveness.get(str(w.get("worker")), "unknown"),
                     "hard_migrations": hard, "soft_migrations": soft})
    rows.sort(key=lambda r: -((r["hard_migrations"] or 0) + (r["soft_migrations"] or 0)))
    return rows
