"""One way to validate a YAML file: its JSON Schema, then the cross-field checks in code.

Every config file of the repository (thresholds, topology, exporter config, relay config,
scenarios) has a Draft 2020-12 schema in ``prefixscope/schemas/``. :class:`Problems` runs it, turns each
schema error into one readable line and collects the problems the code's own checks add, so a
single run shows everything to fix, each as ``file: path: problem`` — the path dotted and
indexed (``workers[3].prefill_tps``, ``checks.prefix_hit_rate_total.value``), the problem in
words (``expected a number, got "high"``, ``unknown field (allowed: …)``, ``missing``).

Durations use :mod:`prefixscope.durations` through custom formats: ``duration`` (a Prometheus
duration string such as ``1h30m``), ``seconds`` (a number of seconds ≥ 0 or a duration) and
``positive-seconds`` (the same, above zero).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml
from jsonschema import Draft202012Validator, FormatChecker, ValidationError

from prefixscope import SCHEMAS_DIR
from prefixscope.durations import DurationError, is_duration, parse_duration, seconds

TOP_LEVEL = "(top level)"


class InvalidFile(ValueError):
    """A file that does not validate; ``problems`` holds one ``file: path: problem`` line each."""

    def __init__(self, problems: str | Sequence[str]) -> None:
        lines = problems.splitlines() if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(lines))
        self.problems = lines


# --------------------------------------------------------------------------------------
# Formats: what JSON Schema cannot say by itself
# --------------------------------------------------------------------------------------
FORMATS = FormatChecker(formats=())


def _seconds_ok(value: object, positive: bool) -> bool:
    if value is None:  # a nullable field; "type" decides whether null is allowed
        return True
    try:
        seconds(value, positive=positive)
    except DurationError:
        return False
    return not (isinstance(value, int | float) and not positive and value < 0)


@FORMATS.checks("duration")
def _is_duration(value: object) -> bool:
    return not isinstance(value, str) or is_duration(value)


@FORMATS.checks("positive-duration")
def _is_positive_duration(value: object) -> bool:
    return not isinstance(value, str) or (is_duration(value) and parse_duration(value) > 0)


@FORMATS.checks("seconds")
def _is_seconds(value: object) -> bool:
    return _seconds_ok(value, positive=False)


@FORMATS.checks("positive-seconds")
def _is_positive_seconds(value: object) -> bool:
    return _seconds_ok(value, positive=True)


def _url(value: object, schemes: tuple[str, ...]) -> bool:
    if not isinstance(value, str):
        return True
    parts = urlsplit(value)
    return parts.scheme in schemes and bool(parts.netloc)


@FORMATS.checks("http-url")
def _is_http_url(value: object) -> bool:
    return _url(value, ("http", "https"))


@FORMATS.checks("zmq-endpoint")
def _is_zmq_endpoint(value: object) -> bool:
    return _url(value, ("tcp", "ipc", "inproc"))


@FORMATS.checks("kv-endpoint")
def _is_kv_endpoint(value: object) -> bool:
    return _url(value, ("tcp", "ipc", "inproc", "nats", "tls"))


@FORMATS.checks("nats-url")
def _is_nats_url(value: object) -> bool:
    return _url(value, ("nats", "tls"))


@FORMATS.checks("nats-name")
def _is_nats_name(value: object) -> bool:
    """A stream name or a subject's literal part: no space, and no wildcard (* or >)."""
    return not isinstance(value, str) or (bool(value) and not any(c in value for c in " *>"))


@FORMATS.checks("url-prefix")
def _is_url_prefix(value: object) -> bool:
    return not isinstance(value, str) or value.endswith("/")


# What a value of each format looks like, for "expected …, got …".
FORMAT_NOUNS = {
    "duration": "a duration like 5m or 1h30m",
    "positive-duration": "a positive duration like 5m or 1h30m",
    "seconds": "a number of seconds ≥ 0 or a duration like 500ms, 5m or 1h30m",
    "positive-seconds": "a positive number of seconds or a duration like 500ms, 5m or 1h30m",
    "http-url": "an http:// or https:// URL",
    "zmq-endpoint": "a ZMQ endpoint (tcp://, ipc:// or inproc://)",
    "url-prefix": "a URL ending in /",
    "kv-endpoint": "a ZMQ endpoint (tcp://, ipc://, inproc://) or a NATS URL (nats://, tls://)",
    "nats-url": "a NATS URL (nats://HOST:PORT or tls://HOST:PORT)",
    "nats-name": "a name without spaces, * or >",
}


# --------------------------------------------------------------------------------------
# Words for values, paths and expectations
# --------------------------------------------------------------------------------------
def show(value: Any) -> str:
    """A value as the file's author wrote it (YAML spellings, strings quoted)."""
    if isinstance(value, str):
        return f'"{value}"'
    if value is None:
        return "nothing"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list | tuple):
        text = json.dumps(list(value), default=str)
        return text if len(text) <= 60 else f"a list of {len(value)} items"
    return repr(value)


def path_text(parts: Sequence[str | int]) -> str:
    """``("workers", 3, "prefill_tps")`` → ``workers[3].prefill_tps``."""
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def join(where: str, key: str | int) -> str:
    return path_text([where, key]) if where else path_text([key])


def _number_noun(kind: str, s: Mapping[str, Any]) -> str:
    noun, a = ("integer", "an") if kind == "integer" else ("number", "a")
    lo, hi, xlo = s.get("minimum"), s.get("maximum"), s.get("exclusiveMinimum")
    if xlo == 0 or (kind == "integer" and lo == 1 and hi is None):
        return f"a positive {noun}"
    if lo is not None and hi is not None:
        return f"{a} {noun} between {lo:g} and {hi:g}"
    if lo is not None:
        return f"{a} {noun} ≥ {lo:g}"
    return f"{a} {noun}"


def _noun(kind: str, s: Mapping[str, Any]) -> str:
    if kind in ("number", "integer"):
        return _number_noun(kind, s)
    if kind == "string":
        return "a non-empty string" if s.get("minLength") or s.get("pattern") == r"\S" else "a string"
    if kind == "array":
        n, m = s.get("minItems"), s.get("maxItems")
        if n is not None and n == m:
            return f"a list of {n} items"
        return "a non-empty list" if n == 1 else "a list"
    if kind == "object":
        return "a non-empty mapping" if s.get("minProperties") == 1 else "a mapping"
    return {"boolean": "true or false", "null": "nothing"}.get(kind, kind)


def expected(schema: Mapping[str, Any]) -> str:
    """What a (sub)schema accepts, as a noun phrase: ``a positive integer``, ``one of a, b``."""
    if "const" in schema:
        return show(schema["const"])
    if "enum" in schema:
        return "one of " + ", ".join(str(v) for v in schema["enum"] if v is not None)
    if schema.get("format") in FORMAT_NOUNS:
        return FORMAT_NOUNS[schema["format"]]
    kinds = schema.get("type", [])
    kinds = [kinds] if isinstance(kinds, str) else [k for k in kinds if k != "null"]
    return " or ".join(_noun(k, schema) for k in kinds) or "something else"


# Keywords whose failure means "the value is not what this schema accepts".
_VALUE_KEYWORDS = frozenset({
    "type", "const", "enum", "format", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
    "minLength", "maxLength", "pattern", "minItems", "maxItems", "minProperties",
})


def _describe(error: ValidationError) -> Iterator[tuple[str, str]]:
    """One schema error as ``(path, problem)`` pairs."""
    where = path_text(list(error.absolute_path))
    keyword, schema, instance = error.validator, error.schema, error.instance
    if keyword == "required" and isinstance(instance, Mapping):
        for name in error.validator_value:
            if name not in instance:
                yield join(where, name), "missing"
    elif keyword == "additionalProperties" and isinstance(instance, Mapping):
        allowed = list(schema.get("properties", {}))
        for name in instance:
            if name not in allowed:
                yield join(where, str(name)), f"unknown field (allowed: {', '.join(allowed)})"
    elif keyword in _VALUE_KEYWORDS:
        yield where, f"expected {expected(schema)}, got {show(instance)}"
    else:
        yield where, error.message


def _non_finite(data: Any, where: str = "") -> Iterator[tuple[str, str]]:
    """``.nan`` and ``.inf`` are YAML numbers, but never a valid value in these files."""
    if isinstance(data, float) and not math.isfinite(data):
        yield where, f"expected a finite number, got {show(data)}"
    elif isinstance(data, Mapping):
        for k, v in data.items():
            yield from _non_finite(v, join(where, str(k)))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            yield from _non_finite(v, join(where, i))


@cache
def validator(name: str) -> Draft202012Validator:
    """The validator of ``prefixscope/schemas/<name>`` (checked itself against the metaschema)."""
    schema = json.loads((SCHEMAS_DIR / name).read_text(encoding="utf-8"))
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema, format_checker=FORMATS)


def schema_problems(data: Any, schema: str) -> list[tuple[str, str]]:
    """Every way ``data`` breaks the schema, as ``(path, problem)``, in schema order."""
    out: list[tuple[str, str]] = []
    for error in validator(schema).iter_errors(data):
        out.extend(_describe(error))
    out.extend(_non_finite(data))
    return list(dict.fromkeys(out))


class Problems:
    """The problems of one file, in the order found; rendered as ``file: path: problem``."""

    def __init__(self, source: str) -> None:
        self.source = source
        self._found: list[tuple[str, str]] = []

    def add(self, where: str, problem: str) -> None:
        if (where, problem) not in self._found:
            self._found.append((where, problem))

    def check_schema(self, data: Any, schema: str) -> bool:
        """Validate against a schema; True when it found nothing."""
        found = schema_problems(data, schema)
        for where, problem in found:
            self.add(where, problem)
        return not found

    def has(self, where: str) -> bool:
        """Whether ``where`` or anything inside it has a problem already (skip checks built on it)."""
        if not where:
            return bool(self._found)
        return any(w == where or w.startswith((where + ".", where + "[")) for w, _ in self._found)

    @property
    def lines(self) -> list[str]:
        return [f"{self.source}: {where or TOP_LEVEL}: {problem}" for where, problem in self._found]

    def __bool__(self) -> bool:
        return bool(self._found)

    def raise_if_any(self, error: type[InvalidFile]) -> None:
        if self._found:
            raise error(self.lines)


def read_yaml(path: Path, source: str, error: type[InvalidFile]) -> Any:
    """A YAML file's data; a file that cannot be read or parsed is one problem naming it."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise error(f"{source}: cannot read file: {exc.strerror or exc}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark is not None else TOP_LEVEL
        raise error(f"{source}: {where}: not valid YAML ({getattr(exc, 'problem', None) or exc})") from None
