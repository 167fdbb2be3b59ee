"""Generated tables about sources: the router × series matrix of docs/routers.md and the
"which sources feed each check" table of README.md, both from the catalogue."""

from __future__ import annotations

from prefixscope.catalog import (
    CHECKS,
    ROUTER_FEEDS,
    ROUTER_KINDS,
    SIGNAL_SOURCES,
    SOURCE_NAMES,
    check_sources,
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
    return "\n".join(rows) + "\n\n" + legend


def splice(text: str, begin: str, end: str, body: str) -> str:
    """``text`` with the block between ``begin`` and ``end`` replaced (ValueError if the markers are missing)."""
    start, stop = text.find(begin), text.find(end)
    if start < 0 or stop < start:
        raise ValueError(f"markers {begin!r} … {end!r} not found")
    return text[:start + len(begin)] + "\n" + body + "\n" + text[stop:]
