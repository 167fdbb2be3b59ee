"""A fast parser for the Prometheus text exposition format (0.0.4), for the scrape hot path.

A worker's /metrics page is mostly series prefixscope does not read (histogram buckets, HTTP
and process metrics). The parser therefore works on the whole text with C-level string
operations, takes each line's metric name with two ``partition`` calls and skips it with one
set lookup unless it is wanted; only wanted lines have their label block parsed, by a
precompiled regex. Malformed lines are reported (line number and excerpt) and never stop the
rest of the page from being read.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import NamedTuple

_NAME_RE = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
# One label pair; the value may contain escaped characters (\\, \", \n).
_PAIR = r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*'
_PAIR_RE = re.compile(_PAIR)
_LABELS_RE = re.compile(rf"(?:{_PAIR},)*(?:{_PAIR})?,?\s*")
_UNESCAPE_RE = re.compile(r"\\(.)")
_UNESCAPE = {"\\": "\\", '"': '"', "n": "\n"}

EXCERPT_CHARS = 80


class Sample(NamedTuple):
    labels: dict[str, str]
    value: float
    timestamp: float | None  # seconds; the format carries milliseconds


@dataclass(frozen=True, slots=True)
class ParseError:
    line: int  # 1-based
    excerpt: str
    reason: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.reason}: {self.excerpt!r}"


@dataclass(slots=True)
class ParseResult:
    samples: dict[str, list[Sample]] = field(default_factory=dict)  # sample name -> samples
    errors: list[ParseError] = field(default_factory=list)
    lines: int = 0  # sample lines seen (wanted or not)
    other_names: set[str] = field(default_factory=set)  # valid sample names that were not wanted

    def values(self, name: str) -> list[Sample]:
        return self.samples.get(name, [])


def _unescape_value(raw: str) -> str:
    return _UNESCAPE_RE.sub(lambda m: _UNESCAPE.get(m.group(1), "\\" + m.group(1)), raw)


def parse_labels(block: str) -> dict[str, str]:
    """Parse the inside of ``{...}``; raises ValueError when it is not a valid label block."""
    if not _LABELS_RE.fullmatch(block):
        raise ValueError("malformed label block")
    pairs = _PAIR_RE.findall(block)
    if "\\" in block:
        return {k: _unescape_value(v) if "\\" in v else v for k, v in pairs}
    return dict(pairs)


def _excerpt(line: str) -> str:
    return line if len(line) <= EXCERPT_CHARS else line[:EXCERPT_CHARS] + "…"


def parse(text: str, wanted: Collection[str] | None = None) -> ParseResult:
    """Parse ``text``; keep samples whose sample name is in ``wanted`` (all when ``None``).

    Names are sample names as written on the line (``vllm:prefix_cache_queries_total``,
    ``..._bucket``). Comment, HELP and TYPE lines are skipped.
    """
    result = ParseResult()
    samples = result.samples
    errors = result.errors
    keep_all = wanted is None
    want = frozenset(() if wanted is None else wanted)
    # Names already known to be valid but unwanted: after the first line of a family, every
    # further line of it costs two set lookups.
    skipped = result.other_names
    n_lines = 0
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line or line[0] == "#":
            continue
        # The name ends at the first "{" or whitespace; a space inside a label value only
        # ever comes after the "{", so partitioning on " " first is safe.
        head = line.partition(" ")[0]
        name = head.partition("{")[0]
        n_lines += 1
        if not keep_all and name not in want:
            if name in skipped:
                continue
            if _NAME_RE.fullmatch(name):
                skipped.add(name)
                continue
            if not line.strip() or line.lstrip()[0] == "#":
                n_lines -= 1
                continue
            errors.append(ParseError(lineno, _excerpt(line), "invalid metric name"))
            continue
        try:
            rest = line[len(name):]
            if rest[:1] == "{":
                block, brace, rest = rest[1:].rpartition("}")
                if not brace:
                    raise ValueError("unclosed label block")
                labels = parse_labels(block) if block else {}
            else:
                labels = {}
            parts = rest.split()
            if not parts or len(parts) > 2:
                raise ValueError("expected a value and an optional timestamp")
            value = float(parts[0])
            ts = float(parts[1]) / 1000.0 if len(parts) == 2 else None
            if keep_all and not _NAME_RE.fullmatch(name):
                raise ValueError("invalid metric name")
        except (ValueError, IndexError) as exc:
            if keep_all and not line.strip():
                n_lines -= 1
                continue
            errors.append(ParseError(lineno, _excerpt(line), str(exc) or type(exc).__name__))
            continue
        bucket = samples.get(name)
        if bucket is None:
            samples[name] = [Sample(labels, value, ts)]
        else:
            bucket.append(Sample(labels, value, ts))
    result.lines = n_lines
    return result
