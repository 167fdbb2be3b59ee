"""Generated tables about sources: the router × series matrix of docs/routers.md and the
"which sources feed each check" table of README.md, both from the catalogue."""

from __future__ import annotations

from prefixscope.catalog import (
    CHECKS,
    KV_SESSION_SIGNALS,
    NO_RECORDS_SIGNALS,
    ROUTER_FEEDS,
    ROUTER_KINDS,
    SIGNAL_SOURCES,
    SOURCE_NAMES,
    check_sources,
    lit_without_records,
    router_signals,
)

ROUTERS_BEGIN = "<!-- BEGIN GENERATED: router matrix (prefixscope generate) -->"
ROUTERS_END = "<!-- END GENERATED: router matrix -->"
SOURCES_BEGIN = "<!-- BEGIN GENERATED: check sources (prefixscope generate) -->"
SOURCES_END = "<!-- END GENERATED: check sources -->"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def router_matrix() -> str:
    head = "| prefixscope series | " + " | ".join(ROUTER_KINDS) + " |"
    rows = [head, "|---|" + "---|" * len(ROUTER_KINDS)]
    for series, feeds in ROUTER_FEEDS.items():
        cells = [_cell(feeds[k]) if feeds.get(k) else "—" for k in ROUTER_KINDS]
        rows.append(f"| `{series}` | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def check_sources_table() -> str:
    cols = list(SOURCE_NAMES)
    rows = ["| step | check | signals | " + " | ".join(SOURCE_NAMES[c] for c in cols) + " |",
            "|---|---|---|" + "---|" * len(cols)]
    for c in CHECKS:
        if c.kind != "checklist":
            continue
        fed = set(check_sources(c))
        needs_all = [s for s in c.signals if len(SIGNAL_SOURCES[s]) == 1]
        marks = []
        for col in cols:
            if col not in fed:
                marks.append("")
            else:
                # ● required (the only source of one of the check's signals), ○ one of several
                marks.append("●" if any(SIGNAL_SOURCES[s] == (col,) for s in needs_all) else "○")
        rows.append(f"| {c.group} | `{c.key}` | {', '.join(c.signals)} | " + " | ".join(marks) + " |")
    legend = ("● the only source of one of the check's signals (required); ○ one of the sources that can feed "
              "a signal. A check lights up when each of its signals has a source.")
    return "\n".join(rows) + "\n\n" + legend + "\n\n" + behind_routers_table()


ROUTER_NAMES = {"sglang-router": "SGLang gateway (smg) / sglang-router", "vllm-router": "vllm-router",
                "dynamo": "NVIDIA Dynamo", "llm-d": "llm-d"}


def behind_routers_table() -> str:
    """How many checks light behind each router with no record and no span (engine /metrics, KV events,
    the router's own /metrics), from the catalogue: each check's signals against what the router feeds."""
    checklist = [c for c in CHECKS if c.kind == "checklist"]
    health = [c for c in CHECKS if c.kind == "health"]
    base = {c.key for c in lit_without_records("")}
    rows = ["| router | checklist checks lit, no records | with a topology file | step-0 health checks lit | "
            "what the router's own /metrics adds |", "|---|---|---|---|---|"]
    for kind in ROUTER_KINDS:
        lit = lit_without_records(kind)
        with_topology = lit_without_records(kind, topology=True)
        added = sorted(c.key for c in lit if c.key not in base)
        signals = ", ".join(sorted(router_signals(kind) - {"router_predicted_reuse"})) or "—"
        rows.append(f"| {ROUTER_NAMES[kind]} | {sum(c.kind == 'checklist' for c in lit)} of {len(checklist)} | "
                    f"{sum(c.kind == 'checklist' for c in with_topology)} of {len(checklist)} | "
                    f"{sum(c.kind == 'health' for c in lit)} of {len(health)} | "
                    + (", ".join(f"`{k}`" for k in added) + f" ({signals})" if added else "—") + " |")
    note = ("Behind a router, with no records: the engines' /metrics and KV events (speculative decoding and "
            "vLLM's sampled block residency, `--kv-cache-metrics`, counted where they are on) and the router's own "
            "/metrics, no OTLP span and no request record. The SGLang "
            "gateway's sticky and prefix-hash branches need `--policy manual` or `prefix_hash` (smg ≥ 1.13), its "
            "index health KV-event-fed cache-aware routing over gRPC workers; Dynamo's regret is counted for "
            "prefill picks.")
    fed = NO_RECORDS_SIGNALS | KV_SESSION_SIGNALS
    sessions = [c.key for c in checklist if set(c.signals) <= fed and c.key not in base]
    if sessions:
        note += (f" Where the requests carry a `session_id` (vLLM ≥ 0.30 copies it into its KV events), "
                 f"{len(sessions)} more checklist checks light behind any router: "
                 + ", ".join(f"`{k}`" for k in sessions) + ".")
    return "\n".join(rows) + "\n\n" + note


def splice(text: str, begin: str, end: str, body: str) -> str:
    """``text`` with the block between ``begin`` and ``end`` replaced (ValueError if the markers are missing)."""
    start, stop = text.find(begin), text.find(end)
    if start < 0 or stop < start:
        raise ValueError(f"markers {begin!r} … {end!r} not found")
    return text[:start + len(begin)] + "\n" + body + "\n" + text[stop:]
