"""Every key the console reads from /api/v1/* is in the real exporter's answers and in docs/api.md.

The list below is what console/chain.py, console/tree_view.py, console/liveness.py and the Prefix
tree and Workers pages read; a key the exporter renames, or the document forgets, fails here rather than as an
empty table on a page. ``a[].b`` means key ``b`` of every element of list ``a`` (which must not
be empty, or nothing would be checked).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from console.exporter_api import ExporterClient

API_DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"

CONSOLE_READS: dict[str, tuple[str, ...]] = {
    "groups": (
        "steps[].checks[].key", "steps[].checks[].value", "steps[].checks[].baseline", "steps[].checks[].status",
        "steps[].checks[].missing_signals", "steps[].checks[].threshold", "steps[].checks[].alert_state",
        "steps[].checks[].fires_in_s", "steps[].checks[].culprits",
        "reuse.prompt_tokens", "reuse.available_tokens", "reuse.predicted_tokens", "reuse.achieved_tokens",
        "reuse.index_staleness_tokens", "shard"),
    "tree": (
        "stats.nodes", "stats.blocks", "stats.root_fanout", "stats.depth_p99",
        "root.children[].id", "root.children[].label", "root.children[].hit_tokens", "root.children[].blocks",
        "root.children[].resident_workers", "root.children[].children", "root.children[].text",
        "root.children[].tenant", "root.children[].adapter"),
    "hotspots": (
        "hot_branches[].rank", "hot_branches[].branch", "hot_branches[].hit_tokens", "hot_branches[].blocks",
        "hot_branches[].workers", "hot_branches[].sessions", "hot_branches[].text", "hot_branches[].token_ids",
        "hot_branches[].tenant", "hot_branches[].adapter",
        "fanout.buckets", "depth.buckets",
        "duplication.blocks_on_1", "duplication.blocks_on_2", "duplication.blocks_on_3_plus",
        "duplication.duplicated_share",
        *(f"workers[].{k}" for k in ("worker", "resident_blocks", "capacity_blocks", "effective_cache_value_tokens",
                                     "removal_rank", "node", "nvlink_domain", "gpu_class", "warm_pool"))),
    "workers": ("evaluated_at", "pool_size", "workers[].kv_stream.last_event_at",
                "workers[].kv_stream.sequence_gaps", "workers[].kv_stream.lost_batches",
                *(f"workers[].{k}" for k in ("worker", "liveness", "last_scrape_at", "resident_blocks",
                                             "capacity_blocks", "hit_share", "effective_cache_value_tokens",
                                             "removal_rank", "node", "nvlink_domain", "gpu_class", "warm_pool"))),
    "culprits": tuple(f"checks.sticky_session_collision_rate.{k}" for k in ("workers", "prefixes", "sessions",
                                                                            "nodes", "near_duplicates")),
    "changes": (
        "lost_hits[].branch", "lost_hits[].before_hit_tokens", "lost_hits[].after_hit_tokens", "lost_hits[].text",
        "lost_hits[].tenant", "lost_hits[].adapter",
        "rekeyed_segments[].segment", "rekeyed_segments[].rekeys", "rekeyed_segments[].share",
        "pool_changes[].ts", "pool_changes[].before", "pool_changes[].after", "pool_changes[].reshuffled_share"),
}


def absent(payload: Any, path: str) -> Iterator[str]:
    """The parts of ``path`` that ``payload`` lacks (nothing when every element has the key)."""
    head, _, rest = path.partition(".")
    is_list = head.endswith("[]")
    key = head.removesuffix("[]")
    if not isinstance(payload, dict) or key not in payload:
        yield path
        return
    value = payload[key]
    if is_list:
        if not isinstance(value, list) or not value:
            yield f"{head} (not a non-empty list)"
            return
        for item in value:
            yield from (f"{head}.{p}" for p in absent(item, rest))
    elif rest:
        yield from (f"{key}.{p}" for p in absent(value, rest))


def documented_examples() -> dict[str, dict]:
    """The ``data`` of each GET endpoint's example in docs/api.md (``[...]`` read as an empty list)."""
    text = API_DOC.read_text(encoding="utf-8")
    out = {}
    for name, body in re.findall(r"## `GET /api/v1/(\w+)[^`]*`.*?```json\n(.*?)```", text, re.S):
        out[name] = json.loads(body.replace("[...]", "[]"))["data"]
    return out


def test_absent_names_the_missing_key() -> None:
    payload = {"a": [{"b": 1}, {"c": 2}], "d": {"e": None}}
    assert list(absent(payload, "a[].b")) == ["a[].b"]
    assert list(absent(payload, "d.e")) == [] and list(absent(payload, "d.f")) == ["d.f"]
    assert list(absent({"a": []}, "a[].b")) == ["a[] (not a non-empty list)"]


@pytest.mark.parametrize("endpoint", sorted(CONSOLE_READS))
def test_the_real_exporter_answers_every_key_the_console_reads(topology_exporter_url: str, endpoint: str) -> None:
    client = ExporterClient(topology_exporter_url)
    payload = client.culprits(("sticky_session_collision_rate",)) if endpoint == "culprits" else \
        getattr(client, endpoint)()
    assert [p for path in CONSOLE_READS[endpoint] for p in absent(payload, path)] == []


@pytest.mark.parametrize("endpoint", sorted(CONSOLE_READS))
def test_docs_api_examples_show_every_key_the_console_reads(endpoint: str) -> None:
    examples = documented_examples()
    assert endpoint in examples, f"docs/api.md has no example for GET /api/v1/{endpoint}"
    # The tree example elides the grandchildren, so its first level is what is checked.
    assert [p for path in CONSOLE_READS[endpoint] for p in absent(examples[endpoint], path)] == []


def test_the_console_knows_every_liveness_the_exporter_states() -> None:
    from typing import get_args

    from console.liveness import API_LIVENESS
    from exporter.core.worker_pool import Liveness

    assert set(get_args(Liveness)) == set(API_LIVENESS)
