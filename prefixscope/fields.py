"""The fields people see in tables: what each is called and how its value reads.

The JSON API (docs/api.md) and the console's own rows name values in snake_case
(``resident_blocks``, ``last_kv_event_s_ago``); a table shows the title here instead
(``Resident blocks``, ``Last KV event``) and each cell read through :mod:`prefixscope.units`
in the field's unit. A field's *kind* says what its number is:

- ``value``: a measurement in ``unit`` (a catalogue unit, or "" for a bare count);
- ``moment``: Unix seconds, read relative to now and in the configured time zone;
- ``age``: seconds before now (``1 m 40 s ago``);
- ``text``: shown as it is.

A field not listed reads as its name in words (``some_field`` → ``Some field``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

FieldKind = Literal["value", "moment", "age", "text"]


@dataclass(frozen=True)
class Field:
    title: str
    unit: str = ""
    kind: FieldKind = "value"


def _text(title: str) -> Field:
    return Field(title, kind="text")


FIELDS: dict[str, Field] = {
    # who and where
    "worker": _text("Worker"), "node": _text("Node"), "nvlink_domain": _text("NVLink domain"),
    "gpu_class": _text("GPU class"), "warm_pool": _text("Warm pool"), "liveness": _text("Liveness"),
    "workers": _text("Workers"), "kind": _text("Kind"), "verdict": _text("Verdict"),
    # the prefix tree
    "rank": Field("Rank"), "branch": _text("Branch"), "prefix": _text("Prefix"), "tenant": _text("Tenant"),
    "adapter": _text("LoRA adapter"), "hit_tokens": Field("Cached tokens (window)", "tokens"),
    "blocks": Field("Blocks", "blocks"), "sessions": Field("Sessions", "sessions"),
    "before_hit_tokens": Field("Cached tokens before", "tokens"),
    "after_hit_tokens": Field("Cached tokens after", "tokens"),
    "lost_hit_tokens": Field("Cached tokens lost", "tokens"),
    "segment": _text("Segment"), "rekeys": Field("Re-keyed sessions", "sessions"),
    "share": Field("Share of new keys", "ratio"),
    "ts": Field("When", kind="moment"), "before": Field("Pool before", "workers"),
    "after": Field("Pool after", "workers"), "reshuffled_share": Field("Keys reshuffled", "ratio"),
    # workers and capacity
    "resident_blocks": Field("Resident blocks", "blocks"), "capacity_blocks": Field("Capacity", "blocks"),
    "used": Field("Used", "ratio"), "effective_cache_value_tokens": Field("Effective cache value", "tokens"),
    "removal_rank": Field("Safe-to-remove rank"), "hit_share": Field("Share of cluster hits", "ratio"),
    "hit_ratio": Field("Hit ratio", "ratio"),
    "last_scrape_s_ago": Field("Last scrape", kind="age"), "last_kv_event_s_ago": Field("Last KV event", kind="age"),
    "kv_sequence_gaps": Field("KV sequence gaps"), "kv_lost_batches": Field("KV batches lost", "batches"),
    "session_migrations_per_min": Field("Session migrations", "per_minute"),
    "cross_node_per_min": Field("Cross-node migrations", "per_minute"),
    "hard_migrations": Field("Sessions moved away (hard)", "sessions"),
    "soft_migrations": Field("Sessions moved away (soft)", "sessions"),
    # cache tiers
    "offload_blocks": Field("Offload blocks held", "blocks"),
    "offload_capacity_blocks": Field("Offload capacity", "blocks"), "offload_fill": Field("Offload fill", "ratio"),
    "offload_hit_tokens": Field("Cached tokens from offload", "tokens"),
    "offload_share_of_cached": Field("Offload share of cached", "ratio"),
    "external_hit_ratio": Field("External hit ratio", "ratio"),
    "hit_tokens_per_s_per_1k_blocks": Field("Cached tokens/s per 1 k blocks"),
    "lmcache_lookup_hit_ratio": Field("LMCache lookup hit ratio", "ratio"),
    "lmcache_retrieve_p50_s": Field("LMCache retrieve p50", "seconds"),
    "lmcache_retrieve_p99_s": Field("LMCache retrieve p99", "seconds"),
    "lmcache_store_p99_s": Field("LMCache store p99", "seconds"),
    "lmcache_lookup_p99_s": Field("LMCache lookup p99", "seconds"),
    # alerts
    "alert": _text("Alert"), "step": _text("Step"), "state": _text("State"), "since": _text("Since"),
    "value": _text("Value"), "summary": _text("Summary"), "labels": _text("Labels"),
}


def field(name: str) -> Field:
    """The field's title, unit and kind; an unlisted one reads as its name in words."""
    known = FIELDS.get(name)
    if known is not None:
        return known
    words = name.replace("_", " ").strip()
    return Field(words[:1].upper() + words[1:] if words else name, kind="text")
