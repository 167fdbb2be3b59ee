"""A threshold file that differs from the packaged one in values, ``for`` and severities.

A deployment's own limits: whatever reads limits must show these, never alerts/thresholds.yaml's.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from prefixscope import thresholds

# threshold key -> fields laid over the packaged entry
CHANGES: dict[str, dict] = {
    "prefix_hit_rate_total": {"value": 0.5, "for": "45s", "severity": "critical"},
    "sticky_session_collision_rate": {"value": 0.2, "for": "45s"},  # 20 %, packaged 5 %
    "kv_event_staleness": {"value": 45, "for": "15s"},  # packaged 120 s for 2 m
    "prefix_tree_depth_p99": {"value": 48, "severity": "warning"},  # packaged info: context
    "index_staleness": {"value": 0.25},
    "session_migration_count_per_minute": {"value": 60, "for": "90s"},
    "async_prefill_wait_time_p99": {"value": 2.5},
    "prefix_tree_walk_latency": {"value": 0.01},
    "topology_aware_placement_hit_rate": {"value": 0.8, "severity": "critical"},
}


def write(directory: Path) -> Path:
    """The packaged file with :data:`CHANGES` laid over it, as ``directory/site-thresholds.yaml``."""
    doc = yaml.safe_load(thresholds.DEFAULT_PATH.read_text(encoding="utf-8"))
    for key, fields in CHANGES.items():
        doc["checks"][key].update(fields)
    path = directory / "site-thresholds.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    return path
