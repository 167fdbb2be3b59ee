"""Shapes the exporter's tree and hotspot answers into plot-ready columns (pure)."""

from __future__ import annotations

from collections.abc import Mapping

from console.liveness import Liveness, in_pool

METRIC_FIELD = {"hits": "hit_tokens", "blocks": "blocks"}


def icicle_columns(root: Mapping, by: str, min_share: float = 0.0) -> dict[str, list]:
    """ids/labels/parents/values for plotly's icicle or sunburst.

    Ids are paths (``root/3f2a/9c01``) so a node is unique even if a label repeats. Each value
    is the node's own hits or blocks; plotly adds the children ("remainder" branch values).
    ``min_share`` floors each node's own value at that share of the total, so a branch that is
    shown at all is wide enough to read its label.
    """
    field = METRIC_FIELD[by]
    cols: dict[str, list] = {"ids": [], "labels": [], "parents": [], "values": [], "workers": []}
    stack: list[tuple[Mapping, str, str]] = [(root, "root", "")]
    while stack:
        node, path, parent = stack.pop()
        cols["ids"].append(path)
        cols["labels"].append("all prefixes" if not parent else str(node.get("label") or node.get("id")))
        cols["parents"].append(parent)
        value = node.get(field)
        cols["values"].append(float(value) if isinstance(value, int | float) else 0.0)
        cols["workers"].append(", ".join(node.get("resident_workers") or []))
        for child in reversed(node.get("children") or []):
            stack.append((child, f"{path}/{child.get('id', '?')}", path))
    floor = sum(cols["values"]) * min_share
    cols["values"] = [v if i == 0 else max(v, floor) for i, v in enumerate(cols["values"])]
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
    """A branch's first words (the exporter's ``text``), else its first token ids, else "—"."""
    text, tokens = branch.get("text"), branch.get("token_ids")
    if isinstance(text, str) and text:
        return f"“{text}”"
    if isinstance(tokens, list) and tokens:
        shown = " ".join(str(t) for t in tokens[:8])
        return f"tokens {shown}{' …' if len(tokens) > 8 else ''}"
    return "—"


def hot_branch_rows(branches: list[Mapping], liveness: Mapping[str, Liveness]) -> list[dict]:
    """Hot branches with their first words next to the hash, and the workers holding them minus
    workers that have left the pool."""
    rows = []
    for b in branches:
        holders = [str(w) for w in b.get("workers") or [] if in_pool(liveness, str(w))]
        row = {k: v for k, v in b.items() if k not in ("text", "token_ids")}
        named = {}
        for k, v in row.items():
            named[k] = v
            if k == "branch":
                named["prefix"] = prefix_name(b)
        rows.append(named | {"workers": ", ".join(holders)})
    return rows


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
