"""A fast parser for the Prometheus text exposition format (0.0.4), for the scrape hot path.

A worker's /metrics page is mostly series prefixscope does not read (histogram buckets, HTTP
and process metrics). The parser therefore works on the whole text with C-level string
operations, takes each line's metric name with two ``partition`` calls and skips it with one
set lookup unless it is wanted; only wanted lines have their label block parsed. Malformed
lines are reported (line number, excerpt and the kind of error) and never stop the rest of the
page from being read.

The label block is read by a left-to-right scanner whose every step consumes input, so its cost
is linear in the line's length whatever the line holds (a single regex over the whole block
backtracks: quadratic time on a long unterminated value). Label values must pass
``exporter.core.labels`` (bounded length, valid UTF-8); a line with one that does not is rejected
with the kind ``label_value``. Lines end at ``\n`` only (a ``\r`` before it is dropped), as the
format says: a label value may hold other Unicode line separators.

``parse`` runs the compiled scanner (``exporter.codecs._promtext_core``) on ASCII pages when the
extension is built, else this module's ``parse_reference``, which defines the result: the two
return equal ``ParseResult`` objects for every text (:data:`CORE` says which one runs). Given a
:class:`SeriesCache`, the scanner parses each distinct series' label block once and later pages
(the same target's next scrape, or another worker's page with the same series) look it up.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import NamedTuple

from exporter.core.labels import MAX_LABEL_VALUE_CHARS, label_value_problem

_NAME_RE = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
# One step of the label scanner each: all anchored at a position, none can backtrack far.
_PAIR_HEAD_RE = re.compile(r'[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"')
_PLAIN_RE = re.compile(r'[^"\\]*')  # a run of value characters without quote or backslash
_BLANK_RE = re.compile(r"[ \t]*")
_UNESCAPE = {"\\": "\\", '"': '"', "n": "\n"}
DEADLINE_EVERY = 2048  # lines between two looks at the clock when parsing against a deadline

EXCERPT_CHARS = 80
# A series cache keeps label blocks of series texts up to this long, at most this many (then it
# starts afresh): a few MB at most, however many or hostile the pages.
CACHE_KEY_CHARS = 256
CACHE_SERIES = 20_000


class Sample(NamedTuple):
    labels: dict[str, str]
    value: float
    timestamp: float | None  # seconds; the format carries milliseconds


class LabelValueError(ValueError):
    """A well-formed label value that may not be used (too long, not valid UTF-8)."""


class ParseTimeout(TimeoutError):
    """``parse`` ran past its deadline (only raised when a deadline is given)."""


@dataclass(frozen=True, slots=True)
class ParseError:
    line: int  # 1-based; 0 when the error is about a sample rather than a line
    excerpt: str
    reason: str
    kind: str = "malformed_line"  # the ingest-error kind it is counted under

    def __str__(self) -> str:
        where = f"line {self.line}: " if self.line else ""
        return f"{where}{self.reason}: {self.excerpt!r}"


@dataclass(slots=True)
class ParseResult:
    samples: dict[str, list[Sample]] = field(default_factory=dict)  # sample name -> samples
    errors: list[ParseError] = field(default_factory=list)
    lines: int = 0  # sample lines seen (wanted or not)
    other_names: set[str] = field(default_factory=set)  # valid sample names that were not wanted
    families: set[str] = field(default_factory=set)  # names declared by "# TYPE" lines (with or without samples)

    def values(self, name: str) -> list[Sample]:
        return self.samples.get(name, [])


def parse_labels(block: str) -> dict[str, str]:
    """Parse the inside of ``{...}`` in one left-to-right pass.

    Raises ``LabelValueError`` for a value ``exporter.core.labels`` refuses and ``ValueError`` when
    the block is not a valid label block. A trailing comma is allowed; of repeated names the
    last wins.
    """
    labels: dict[str, str] = {}
    n = len(block)
    pos = 0
    while True:
        head = _PAIR_HEAD_RE.match(block, pos)
        if head is None:
            if _BLANK_RE.match(block, pos).end() == n and (pos == 0 or block[pos - 1] == ","):
                return labels  # empty block, or a trailing comma
            raise ValueError("malformed label block")
        pos = value_start = head.end()
        parts: list[str] = []
        while True:
            if pos - value_start > 2 * MAX_LABEL_VALUE_CHARS:  # even all escapes would be too long
                raise LabelValueError(f"label value longer than {MAX_LABEL_VALUE_CHARS} characters "
                                      f"for label {head.group(1)}")
            end = _PLAIN_RE.match(block, pos).end()
            parts.append(block[pos:end])
            if end >= n:
                raise ValueError("malformed label block: unterminated label value")
            if block[end] == '"':
                pos = end + 1
                break
            esc = block[end + 1:end + 2]  # after a backslash
            if not esc:
                raise ValueError("malformed label block: unterminated label value")
            parts.append(_UNESCAPE.get(esc, "\\" + esc))
            pos = end + 2
        value = parts[0] if len(parts) == 1 else "".join(parts)
        problem = label_value_problem(value)
        if problem is not None:
            raise LabelValueError(f"{problem} for label {head.group(1)}")
        labels[head.group(1)] = value
        pos = _BLANK_RE.match(block, pos).end()
        if pos == n:
            return labels
        if block[pos] != ",":
            raise ValueError("malformed label block: expected a comma between labels")
        pos += 1


def _excerpt(line: str) -> str:
    return line if len(line) <= EXCERPT_CHARS else line[:EXCERPT_CHARS] + "…"


# Parsed label sets by series text (the sample line up to its last ``}``), kept by a scraper from
# one page to the next (``SeriesCache()`` is a plain dict); bounded by CACHE_SERIES and
# CACHE_KEY_CHARS. Its label dicts are shared by every sample carrying them: read, never changed.
SeriesCache = dict[str, dict[str, str]]


def parse(text: str, wanted: Collection[str] | None = None, deadline: float | None = None,
          cache: SeriesCache | None = None) -> ParseResult:
    """:func:`parse_reference`'s result, from the compiled scanner when it is built and ``text``
    is ASCII (``cache``, optional, keeps the label sets it parsed for the next call)."""
    if _promtext_core is not None and text.isascii():
        return _promtext_core.parse(text, wanted, deadline, cache)
    return parse_reference(text, wanted, deadline)


def parse_reference(text: str, wanted: Collection[str] | None = None, deadline: float | None = None) -> ParseResult:
    """Parse ``text``; keep samples whose sample name is in ``wanted`` (all when ``None``).

    Names are sample names as written on the line (``vllm:prefix_cache_queries_total``,
    ``..._bucket``). Comment, HELP and TYPE lines are skipped. Bad lines become ``errors``;
    nothing raises, except ``ParseTimeout`` once ``time.monotonic()`` passes ``deadline``.
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
    for lineno, line in enumerate(text.split("\n"), 1):
        if deadline is not None and not lineno % DEADLINE_EVERY and time.monotonic() > deadline:
            raise ParseTimeout(f"parsing stopped at line {lineno}: past the deadline")
        if line[-1:] == "\r":
            line = line[:-1]
        if not line or line[0] == "#":
            if line.startswith("# TYPE "):  # a family may be declared before it has any sample
                result.families.add(line[7:].partition(" ")[0])
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
        except LabelValueError as exc:
            errors.append(ParseError(lineno, _excerpt(line), str(exc), "label_value"))
            continue
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


try:
    from exporter.codecs import _promtext_core
except ImportError as exc:  # not built: the Python reference parses
    _promtext_core = None  # type: ignore[assignment]
    logging.getLogger(__name__).warning("/metrics parser: the Python reference (compiled core not used: %s)", exc)
else:
    _promtext_core.bind(ParseResult, ParseError, Sample, parse_labels, parse_reference, ParseTimeout, time.monotonic,
                        DEADLINE_EVERY, CACHE_KEY_CHARS, CACHE_SERIES)
CORE = "reference" if _promtext_core is None else "compiled"
