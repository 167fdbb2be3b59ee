"""The first thing to do: the first step under a runbook's mitigation heading (pure).

Runbooks (``runbooks/<Alert>.md``) have a ``## Mitigation`` section whose steps are a numbered
(or bulleted) list, most urgent first. The headline shows the first step, its wrapped lines
joined, so the reader knows what to try before opening the runbook. A section written as prose
gives its first paragraph instead.
"""

from __future__ import annotations

import re

_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
_ITEM = re.compile(r"^\s{0,3}(?:\d+[.)]|[-*+])\s+(.*)$")


def first_mitigation(markdown: str) -> str | None:
    """The first list item (or paragraph) under the first heading that mentions mitigation."""
    in_section = False
    got: list[str] = []
    for line in markdown.splitlines():
        heading = _HEADING.match(line)
        if heading:
            if got:
                break
            in_section = "mitigat" in heading.group(1).lower()
            continue
        if not in_section:
            continue
        item = _ITEM.match(line)
        if not got:
            if item:
                got = [item.group(1).strip()]
            elif line.strip():
                got = [line.strip()]
            continue
        if not line.strip() or item:
            break
        got.append(line.strip())
    return " ".join(got) if got else None
