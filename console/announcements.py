"""What a running fleet announces (``prefixscope sim --announce FILE``; the demo sets it): each
storyline step, when its fault begins, workers killed and restored — read here for the banner.

The file holds one JSON object a line, ``{"ts": <unix s>, "text": "..."}``, newest last. Only its
tail is read (``TAIL_BYTES``); a line that is not such an object is skipped. No Streamlit here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

TAIL_BYTES = 16_384


@dataclass(frozen=True)
class Announcement:
    ts: float
    text: str


def parse(text: str) -> list[Announcement]:
    out = []
    for line in text.splitlines():
        try:
            raw = json.loads(line)
        except ValueError:
            continue  # a partial first line of the tail, or a line being written
        if isinstance(raw, dict) and isinstance(raw.get("text"), str) and isinstance(raw.get("ts"), int | float) \
                and not isinstance(raw.get("ts"), bool):
            out.append(Announcement(float(raw["ts"]), raw["text"]))
    return out


def latest(path: Path, n: int = 5) -> list[Announcement]:
    """The newest ``n`` announcements, newest first; none when the file is missing or unreadable."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - TAIL_BYTES))
            tail = f.read().decode("utf-8", errors="replace")
    except OSError:
        return []
    return parse(tail)[-n:][::-1]
