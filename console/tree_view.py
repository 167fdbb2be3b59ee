"""Shapes the exporter's tree and hotspot answers into plot-ready columns (pure)."""

from __future__ import annotations

from collections.abc import Mapping

METRIC_FIELD = {"hits": "hit_tokens", "blocks": "blocks"}


def icicle_columns(root: Mapping, by: str) -> dict[str, list]:
    """ids/labels/parents/values for plotly's icicle or sunburst.

    Ids are paths (``root/3f2a/9c01``) so a node is unique even if a label repeats. Each value
    is the node's own hits or blocks; plotly adds the children ("remainder" branch values).
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
    return cols


def bucket_rows(buckets: list, x: str, y: str = "count") -> list[dict]:
    """``[[1, 10], [2, 4]]`` → ``[{x: 1, y: 10}, ...]``, skipping malformed pairs."""
    return [{x: b[0], y: b[1]} for b in buckets or [] if isinstance(b, list | tuple) and len(b) == 2]


def capacity_rows(workers: list[Mapping]) -> list[dict]:
    """Per worker: resident blocks against capacity (None when a side is not instrumented)."""
    rows = []
    for w in workers:
        resident, capacity = w.get("resident_blocks"), w.get("capacity_blocks")
        used = resident / capacity if isinstance(resident, int | float) and isinstance(capacity, int | float) and capacity else None
        rows.append({"worker": w.get("worker"), "resident_blocks": resident, "capacity_blocks": capacity,
                     "used": used, "effective_cache_value_tokens": w.get("effective_cache_value_tokens"),
                     "removal_rank": w.get("removal_rank"), "node": w.get("node"),
                     "nvlink_domain": w.get("nvlink_domain"), "gpu_class": w.get("gpu_class"),
                     "warm_pool": w.get("warm_pool")})
    return rows


def removal_ranking(workers: list[Mapping]) -> list[dict]:
    """Safest to remove first: ranked workers by rank, unranked (not instrumented) last."""
    rows = capacity_rows(workers)
    return sorted(rows, key=lambda r: (r["removal_rank"] is None, r["removal_rank"] or 0, str(r["worker"])))


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
