"""What a label value taken from outside may be, checked in one place for every intake.

A label value read from a worker page, a KV event or a request record ends up as a label on
/metrics and as a key in the API's JSON, so it must be encodable as UTF-8 (a lone surrogate,
from ``"\\ud800"`` in a string or the raw bytes ``ED A0 80`` decoded with ``surrogateescape``,
makes the exposition raise ``UnicodeEncodeError`` later, for every scrape) and bounded in length
(one oversized value would be copied into every series and every response that carries it).
Intakes reject such a value with a counted error at the edge; nothing is silently rewritten.
"""

from __future__ import annotations

# Generous for the values seen in practice (model names, URLs, engine numbers, segments)
# while keeping one hostile value from costing more than a few KB per series.
MAX_LABEL_VALUE_CHARS = 1024


def label_value_problem(value: str) -> str | None:
    """Why ``value`` cannot be a label value, or ``None`` when it can."""
    if len(value) > MAX_LABEL_VALUE_CHARS:
        return f"label value of {len(value)} characters (at most {MAX_LABEL_VALUE_CHARS})"
    if value.isascii():
        return None
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return "label value is not valid UTF-8 (a lone surrogate or an undecodable byte)"
    return None


def valid_label_value(value: object) -> bool:
    """True when ``value`` is a string that may be used as a label value as it is."""
    return isinstance(value, str) and label_value_problem(value) is None
