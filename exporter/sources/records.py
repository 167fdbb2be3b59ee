"""Request records (``prefixscope.request/v1``): NDJSON parsing, validation and a file tailer.

``parse_ndjson`` is pure: bytes in, valid records and per-line errors out. The schema is
compiled once, by fastjsonschema. Most records are valid, so a line is first offered to the typed
decoder (a msgspec struct written from the strict schema: decode, check and convert in one C
pass), then to a fast path (the schema narrowed to what the exporter holds, then one conversion
pass); only a record neither accepts takes the careful steps — the schema, the exporter's own
value checks, the conversion — and a rejected one is worded by the full ``jsonschema`` validator.
Both accept only what the careful steps accept, so the answer is theirs either way. Each accepted object becomes
a :class:`prefixscope.records.RequestRecord`; that typed value is what the sink receives.

Records that cannot be true are rejected, each under its own error kind: a number JSON can
spell but a float cannot hold (``1e400`` parses to infinity: ``non_finite``), and — when the
caller passes the exporter's clock as ``now`` (both intakes do) — a ``ts`` further than the
tolerance from the time the record was received (``timestamp``: milliseconds instead of seconds,
a skewed clock, a replayed old file). The schema already refuses negative durations and token
counts. Every window runs on the exporter's clock: an impossible ts would otherwise sit outside
every window (or in the future of all of them), and inf would poison every sum it entered.

The HTTP edge maps :class:`BodyTooLarge` to 413 and "nothing valid" (``records == []`` and
``errors``) to 400; :func:`deliver` hands the result to the sink and counts it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Annotated, Any, BinaryIO, Literal

import fastjsonschema
import msgspec

from exporter.core.health import Health
from exporter.core.labels import MAX_LABEL_VALUE_CHARS, label_value_problem
from exporter.model import StateSink
from prefixscope import REQUEST_SCHEMA_PATH
from prefixscope.records import (
    DEFAULT_TS_TOLERANCE_S,
    SCHEMA,
    VALIDATOR,
    InvalidRecord,
    RequestRecord,
    implausible_ts,
    schema_error,
)

log = logging.getLogger("prefixscope.records")

SOURCE = "records"
SCHEMA_PATH = REQUEST_SCHEMA_PATH
__all__ = ["SCHEMA", "SCHEMA_PATH", "VALIDATOR", "BodyTooLarge", "RecordError", "RecordFileTail", "deliver",
           "parse_lines", "parse_ndjson", "record_problem", "validate"]
STATUS_TOO_LARGE = 413
STATUS_NOTHING_VALID = 400
MAX_ERRORS_REPORTED = 50  # per body: a sender gets the first ones, all are counted
SLICE_RECORDS = 500  # records applied per hold of the state lock (~5 ms of state work at ~10 µs a record)


class BodyTooLarge(ValueError):
    """The body exceeds the configured limit (HTTP 413)."""

    status = STATUS_TOO_LARGE


@dataclass(frozen=True, slots=True)
class RecordError:
    line: int  # 1-based line of the body
    kind: str  # json, not_object, schema, value (schema-valid but not applicable: see strict_problem)
    error: str

    def as_dict(self) -> dict[str, Any]:
        return {"line": self.line, "error": self.error}


# ---- the schema check: the contract schema compiled by fastjsonschema ---------------------
_VALID = fastjsonschema.compile(SCHEMA, use_default=False, use_formats=False)


def _fast_ok(rec: Any) -> bool:
    """The schema's answer, quickly (the validator is asked only to word a rejection)."""
    try:
        _VALID(rec)
    except fastjsonschema.JsonSchemaException:
        return False
    return True


FAST_OK: Callable[[Any], bool] = _fast_ok


# ---- what the schema allows but the exporter cannot hold --------------------------------------
# JSON Schema calls 16.0 an integer, lets a number be 1e400 (infinity once parsed) or a
# 300-digit integer, and lets strings carry lone surrogates. Each would fail later, half-way
# through applying the record (a float block count, an int too large for a float, a label the
# exposition cannot encode), so a line is checked whole here and rejected with its reason.
MAX_NESTING = 16  # containers inside one record (the schema's own fields need 2)
MAX_INTEGER = 2**53  # a count beyond this is not a count of tokens, and loses exactness as a float
MAX_NUMBER = 1e15  # seconds: beyond any timestamp or duration, and far from overflowing a float
StrictCheck = Callable[[Any], str | None]


def _integer_problem(v: Any) -> str | None:
    if type(v) is not int:
        return f"expected an integer, got {json.dumps(v) if isinstance(v, float) else type(v).__name__}"
    return None if v <= MAX_INTEGER else f"an integer of {len(str(v))} digits exceeds {MAX_INTEGER}"


def _number_problem(v: Any) -> str | None:
    if type(v) is int:
        return None if abs(v) <= MAX_NUMBER else f"a number of {len(str(v))} digits exceeds {MAX_NUMBER:g}"
    if not math.isfinite(v) or abs(v) > MAX_NUMBER:
        return f"number {v!r} is not finite or exceeds {MAX_NUMBER:g}"
    return None


def _hashes_problem(v: Any) -> str | None:
    if all(type(h) is int for h in v):  # bounds: the schema's items (0 ≤ h < 2**64)
        return None
    bad = next(h for h in v if type(h) is not int)
    return f"expected integer block hashes, got {json.dumps(bad)}"


def _string_problem(v: Any) -> str | None:
    return label_value_problem(v)


def _strict_check(spec: dict[str, Any]) -> StrictCheck | None:
    raw = spec.get("type")
    types = set((raw,) if isinstance(raw, str) else raw or ())
    if "integer" in types and "number" not in types:
        return _integer_problem
    if "number" in types:
        return _number_problem
    if "array" in types and spec.get("items", {}).get("type") == "integer":
        return _hashes_problem
    if "string" in types or "const" in spec or "enum" in spec:
        return _string_problem
    return None


_STRICT: dict[str, StrictCheck] = {
    name: check for name, spec in SCHEMA["properties"].items() if (check := _strict_check(spec)) is not None}


def _nesting(value: Any) -> int:
    """Levels of nested containers in ``value`` (0 for a scalar), breadth first, stopping past the limit."""
    depth, level = 0, [value] if isinstance(value, dict | list) else []
    while level and depth <= MAX_NESTING:
        depth += 1
        level = [c for v in level for c in (v.values() if isinstance(v, dict) else v) if isinstance(c, dict | list)]
    return depth


def strict_problem(rec: dict[str, Any]) -> str | None:
    """Why a schema-valid object cannot be applied as it is, or None (see the notes above)."""
    for name, value in rec.items():
        check = _STRICT.get(name)
        if check is not None:
            if value is not None:
                problem = check(value)
                if problem is not None:
                    return f"{name}: {problem}"
        elif isinstance(value, dict | list) and _nesting(value) >= MAX_NESTING:  # the object itself is one level
            return f"{name}: nested more than {MAX_NESTING} levels deep"
    return None


# ---- the whole-record fast path: check and convert in one pass -----------------------------
# Most lines are plain records: ASCII strings, integer token counts and hashes, finite numbers.
# For those, the schema narrowed to what the exporter holds as it is (``_strict_schema``: counts
# within 2**53, numbers within ±1e15, strings no longer than a label value), compiled by
# fastjsonschema, and one pass of conversion per field do what the schema check,
# ``strict_problem`` and ``RequestRecord.from_json`` do in three. Anything else (a float where
# a count belongs, a non-ASCII string, a nested or non-finite value under an unknown key) makes it
# answer None, and the line takes the three steps, which then decide and word the error. It
# accepts only what those steps accept, with the same value (tests/exporter/sources/test_records_source.py).
_INT, _NUM, _STR, _HASHES, _ANY, _UNKNOWN = range(6)  # how a field's value is checked and converted
_INT_ONLY = {int}
_RECORD_FIELDS = tuple(f.name for f in fields(RequestRecord))  # the constructor's positional order
# The slots of RequestRecord, set one by one: what its generated __init__ does (through
# object.__setattr__, it being frozen), less the call. Only while __init__ does nothing more.
_SETTERS: tuple[Callable[[Any, Any], None], ...] | None = (
    tuple(getattr(RequestRecord, name).__set__ for name in _RECORD_FIELDS)
    if not hasattr(RequestRecord, "__post_init__") and getattr(RequestRecord, "__slots__", ()) == _RECORD_FIELDS
    else None)
Build = Callable[[dict[str, Any]], RequestRecord | None]  # one record shape's conversion
MAX_SHAPES = 256  # record shapes (key sequences) remembered


def _types(spec: dict[str, Any]) -> set[str]:
    raw = spec.get("type")
    return set((raw,) if isinstance(raw, str) else raw or ())


def _strict_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with the exporter's own bounds added (what ``strict_problem`` checks that a
    schema can say): integer counts within 2**53, numbers within ±1e15, strings and hash lists as
    the exporter holds them. It only narrows: what it accepts, the schema accepts."""
    props: dict[str, dict[str, Any]] = {}
    for name, spec in schema.get("properties", {}).items():
        spec, types = dict(spec), _types(spec)
        bound = MAX_INTEGER if "integer" in types and "number" not in types else MAX_NUMBER if "number" in types else None
        if bound is not None:
            spec["minimum"] = max(spec.get("minimum", -bound), -bound)
            spec["maximum"] = min(spec.get("maximum", bound), bound)
        if "string" in types:
            spec["maxLength"] = min(spec.get("maxLength", MAX_LABEL_VALUE_CHARS), MAX_LABEL_VALUE_CHARS)
        props[name] = spec
    return {**schema, "properties": props}


def _kind(spec: dict[str, Any]) -> int | None:
    """How the fast path converts a property's value; None if it cannot decide the property."""
    types = _types(spec) - {"null"}
    if "const" in spec or "enum" in spec:
        return _STR if types <= {"string"} else None
    if types == {"integer"}:
        return _INT
    if types == {"number"}:
        return _NUM
    if types == {"string"}:
        return _STR
    if types == {"boolean"}:
        return _ANY
    if types == {"array"} and spec.get("items", {}).get("type") == "integer":
        return _HASHES
    return None


def _compile_fast_record(schema: dict[str, Any]) -> Callable[[Any], RequestRecord | None]:
    """The whole-record fast path: the strict schema's check, then each field's conversion."""
    props: dict[str, dict[str, Any]] = schema.get("properties", {})
    kinds = {name: _kind(spec) for name, spec in props.items()}
    required = tuple(schema.get("required", ()))
    if (any(k is None for k in kinds.values()) or schema.get("additionalProperties", True) is not True
            or required != _RECORD_FIELDS[:4] or _RECORD_FIELDS[-1] != "carried" or set(kinds) != set(_RECORD_FIELDS[:-1])):
        return lambda _obj: None  # the schema outgrew the fast path: every line takes the steps
    strict = fastjsonschema.compile(_strict_schema(schema), use_default=False, use_formats=False)
    failed = fastjsonschema.JsonSchemaException
    position = {name: i for i, name in enumerate(_RECORD_FIELDS)}
    # A producer writes the same keys in the same order record after record: per such shape, the
    # fields' positions and conversions, worked out once.
    shapes: dict[tuple[str, ...], tuple[tuple[tuple[int, int], ...], list[Any]]] = {}
    new = object.__new__

    def shape_of(keys: tuple[str, ...]) -> tuple[tuple[tuple[int, int], ...], list[Any]]:
        steps = tuple((position[k], kinds[k]) if k in kinds else (-1, _UNKNOWN) for k in keys)  # type: ignore[misc]
        template: list[Any] = [None] * len(_RECORD_FIELDS)
        template[-1] = frozenset(k for k in keys if k in kinds and k not in required)  # carried
        if len(shapes) < MAX_SHAPES:
            shapes[keys] = steps, template
        return steps, template

    def fast_record(obj: Any) -> RequestRecord | None:
        if type(obj) is not dict:
            return None
        try:
            strict(obj)
        except failed:
            return None
        keys = tuple(obj)
        steps, template = shapes.get(keys) or shape_of(keys)
        args = template.copy()
        for (at, kind), v in zip(steps, obj.values(), strict=True):
            if v is None:
                if kind == _UNKNOWN:
                    continue
            elif kind == _NUM:
                v = float(v)
                if v != v:  # NaN passes every bound; JSON cannot spell it, a caller's object can
                    return None
            elif kind == _INT:
                if type(v) is not int:  # 512.0: an integer to the schema, not to the exporter
                    return None
            elif kind == _STR:
                if not v.isascii():  # the three steps word what a label cannot hold
                    return None
            elif kind == _HASHES:
                if v and set(map(type, v)) != _INT_ONLY:
                    return None
                v = tuple(v)
            elif kind == _UNKNOWN:  # a key the schema does not name: allowed, if flat and finite
                t = type(v)
                if t is dict or t is list or (t is float and v - v != 0.0):
                    return None
                continue
            args[at] = v
        if _SETTERS is None:
            return RequestRecord(*args)
        o = new(RequestRecord)  # the frozen dataclass's __init__ without its call: each slot set directly
        for setter, arg in zip(_SETTERS, args, strict=True):
            setter(o, arg)
        return o  # type: ignore[no-any-return]

    return fast_record


FAST_RECORD = _compile_fast_record(SCHEMA)


# ---- the typed decoder: msgspec, before the fast path ---------------------------------------
_ASCII_ONLY: Callable[[Any, tuple[str, ...]], bool]
try:
    from exporter.core._records_core import RecordBuilder as _BUILDER
    from exporter.core._records_core import ascii_only as _ASCII_ONLY
except ImportError:  # not built: the conversion in Python below
    _BUILDER = None
    _ASCII_ONLY = lambda record, names: _ascii_only_py(record, names)  # noqa: E731 - defined further down
# The strict schema (``_strict_schema``) written as a msgspec struct: one C pass decodes, checks
# and converts a line. It takes only lines the fast path would take with the same values — ASCII
# lines without ``\u`` escapes (a label value's characters are the careful steps' to word),
# no key the schema does not name (``forbid_unknown_fields``: an unknown key's nesting and
# finiteness are the careful steps' to judge), integers that are JSON integers, numbers within
# the bounds — and anything it refuses goes on to the fast path and the careful steps, which
# word the error; so every answer, accepted or rejected, is theirs (tests/exporter/sources/
# test_records_typed.py compares the two over randomized lines). An optional field's absence
# is ``UNSET``, its null ``None``: what ``carried`` is made of.
def _typed_field(name: str, spec: dict[str, Any], required: bool,
                 none_is_absent: bool = False) -> tuple[str, Any, Any] | None:
    """``(name, type, default)`` of one property for ``msgspec.defstruct``; None if it cannot say.
    ``none_is_absent``: an optional field may be None whatever the schema says of null (a
    record's None is a field it does not carry)."""
    types = _types(spec)
    nullable = "null" in types or None in spec.get("enum", ())
    kind = _kind(spec)
    meta: dict[str, Any] = {}
    if kind in (_INT, _NUM):
        lo, hi = spec.get("minimum"), spec.get("maximum")
        if lo is not None:
            meta["ge"] = lo
        if hi is not None:
            meta["le"] = hi
        if "exclusiveMinimum" in spec or "exclusiveMaximum" in spec or "multipleOf" in spec:
            return None
        base: Any = int if kind == _INT else float
    elif kind == _STR:
        if "const" in spec:
            base = Literal[spec["const"]]  # type: ignore[valid-type]
        elif "enum" in spec:
            values = tuple(v for v in spec["enum"] if v is not None)
            if not all(isinstance(v, str) for v in values):
                return None
            base = Literal[values] if values else None  # type: ignore[valid-type]
        else:
            if "pattern" in spec or "format" in spec:
                return None
            base = str
            if "minLength" in spec:
                meta["min_length"] = spec["minLength"]
            if "maxLength" in spec:
                meta["max_length"] = spec["maxLength"]
    elif kind == _ANY and _types(spec) - {"null"} == {"boolean"}:
        base = bool
    elif kind == _HASHES:
        items = spec.get("items", {})
        if set(items) - {"type", "minimum", "maximum"} or set(spec) - {"type", "items", "description"}:
            return None
        # msgspec holds integer bounds in an int64: the upper one (2**64 - 1) is checked after decoding
        item_meta = {"ge": items["minimum"]} if "minimum" in items else {}
        base = tuple[Annotated[int, msgspec.Meta(**item_meta)] if item_meta else int, ...]  # type: ignore[misc]
    else:
        return None
    known = {"type", "minimum", "maximum", "minLength", "maxLength", "const", "enum", "items", "description"}
    if set(spec) - known:
        return None
    typ: Any = Annotated[base, msgspec.Meta(**meta)] if meta else base
    if nullable:
        typ = typ | None
    if required:
        return (name, typ, msgspec.NODEFAULT)
    if none_is_absent:
        return (name, typ if nullable else typ | None, None)
    return (name, typ | msgspec.UnsetType, msgspec.UNSET)


def _compile_typed(schema: dict[str, Any], builder: Any = _BUILDER) -> Callable[[bytes], RequestRecord | None] | None:
    """The typed decoder of a line, or None when the schema has something it cannot say; with
    ``builder`` None, its conversion in Python."""
    strict = _strict_schema(schema)
    props: dict[str, dict[str, Any]] = strict.get("properties", {})
    required = tuple(strict.get("required", ()))
    if (required != _RECORD_FIELDS[:4] or set(props) != set(_RECORD_FIELDS[:-1])
            or strict.get("additionalProperties", True) is not True or _SETTERS is None):
        return None
    spec_fields = []
    for name in _RECORD_FIELDS[:-1]:  # the record's order: the struct's values line up with its slots
        got = _typed_field(name, props[name], name in required)
        if got is None:
            return None
        spec_fields.append(got)
    hashes_at = _RECORD_FIELDS.index("block_hashes")
    hashes_max = props["block_hashes"].get("items", {}).get("maximum")
    line_type = msgspec.defstruct("RecordLine", spec_fields, forbid_unknown_fields=True, gc=False)
    decode = msgspec.json.Decoder(line_type).decode
    astuple = msgspec.structs.astuple
    unset = msgspec.UNSET
    optional = _RECORD_FIELDS[4:-1]
    setters = _SETTERS
    failed = (msgspec.ValidationError, msgspec.DecodeError)
    new = object.__new__
    if builder is not None:  # the conversion compiled (exporter.core._records_core)
        build = builder(RequestRecord, _RECORD_FIELDS[:-1], len(required), unset, hashes_at, hashes_max,
                         _RECORD_FIELDS[-1], MAX_SHAPES).build

        def typed_compiled(line: bytes) -> RequestRecord | None:
            try:
                return build(astuple(decode(line)))  # type: ignore[no-any-return]
            except failed:
                return None

        return typed_compiled
    # which optional fields a line carried -> that frozenset (producers repeat their shape)
    carried_of: dict[tuple[bool, ...], frozenset[str]] = {}

    def typed(line: bytes) -> RequestRecord | None:
        try:
            values = astuple(decode(line))
        except failed:
            return None
        hashes = values[hashes_at]
        if hashes and hashes_max is not None and hashes is not unset and max(hashes) > hashes_max:
            return None
        absent = tuple([v is unset for v in values])
        carried = carried_of.get(absent)
        if carried is None:
            carried = frozenset(name for name, gone in zip(optional, absent[4:], strict=True) if not gone)
            if len(carried_of) < MAX_SHAPES:
                carried_of[absent] = carried
        o = new(RequestRecord)
        for setter, v in zip(setters, values, strict=False):  # the last setter (carried) is set below
            setter(o, None if v is unset else v)
        setters[-1](o, carried)
        return o  # type: ignore[no-any-return]

    return typed


def _compile_record_check(schema: dict[str, Any]) -> Callable[[RequestRecord], bool] | None:
    """Whether a record built by another intake passes the strict schema with the fields it has
    (its None fields absent), at once: True when it does, False when the careful steps must say
    (they decide and word it). None when the schema has something the struct cannot say."""
    strict = _strict_schema(schema)
    props: dict[str, dict[str, Any]] = strict.get("properties", {})
    required = tuple(strict.get("required", ()))
    if required != _RECORD_FIELDS[:4] or set(props) != set(_RECORD_FIELDS[:-1]):
        return None
    spec_fields = []
    for name in _RECORD_FIELDS[:-1]:
        got = _typed_field(name, props[name], name in required, none_is_absent=True)
        if got is None:
            return None
        spec_fields.append(got)
    fields_type = msgspec.defstruct("RecordFields", spec_fields, gc=False)
    convert = msgspec.convert
    failed = msgspec.ValidationError
    hashes_max = props["block_hashes"].get("items", {}).get("maximum")
    # label values: the struct bounds their length; a lone surrogate (JSON can spell one) is the careful steps' to find
    strings = tuple(name for name in _RECORD_FIELDS[:-1] if _kind(props[name]) == _STR)
    ascii_only = _ASCII_ONLY

    def record_ok(record: RequestRecord) -> bool:
        if not ascii_only(record, strings):  # first: the struct would choke on a lone surrogate
            return False
        try:
            convert(record, fields_type, from_attributes=True)
        except (failed, ValueError, TypeError):
            return False
        hashes = record.block_hashes
        return not (hashes and hashes_max is not None and max(hashes) > hashes_max)

    return record_ok


def _ascii_only_py(record: Any, names: tuple[str, ...]) -> bool:
    for name in names:
        v = getattr(record, name)
        if v is not None and (type(v) is not str or not v.isascii()):
            return False
    return True


TYPED_RECORD = _compile_typed(SCHEMA)
TYPED_CONVERSION = "reference" if _BUILDER is None else "compiled"
RECORD_OK = _compile_record_check(SCHEMA)
# The decoder of the fast path: the JSON scanner itself (``JSONDecoder.decode`` less its wrapper:
# the caller checks that only JSON whitespace follows the value). Floats parse in C; one too large
# for a float (inf) fails the fast checks, and the line is parsed again by the strict decoder,
# which names it.
_FAST_SCAN = json.JSONDecoder(parse_constant=lambda name: _no_constant(name)).scan_once
_JSON_WS = " \t\n\r"


def validate(record: Any) -> str | None:
    """None if the record is valid, else the validator's message (with the field's path)."""
    return None if FAST_OK(record) else schema_error(record)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")  # NaN/Infinity would poison every sum downstream


class NonFinite(ValueError):
    """A JSON number too large for a float (``1e400``): it would parse to infinity."""


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (_INF, -_INF):
        raise NonFinite(f"number {text} is out of range (not a finite float)")
    return value


_INF = float("inf")


def parse_lines(lines: list[bytes], first_line: int = 1, *, now: float | None = None,
                ts_tolerance_s: float = DEFAULT_TS_TOLERANCE_S) -> tuple[list[RequestRecord], list[RecordError]]:
    """Valid records (as :class:`RequestRecord`) and per-line errors of NDJSON lines.

    With ``now`` (the exporter's clock as the lines arrive), a record whose ``ts`` is further
    than ``ts_tolerance_s`` from it is a ``timestamp`` error; without, times are not checked
    (a replay of recorded traffic feeds the state directly).
    """
    records: list[RequestRecord] = []
    errors: list[RecordError] = []
    loads, build = json.loads, RequestRecord.from_json
    scan, fast_record, typed = _FAST_SCAN, FAST_RECORD, TYPED_RECORD
    for i, line in enumerate(lines, first_line):
        record = None
        if typed is not None and line and line.isascii() and b"\\u" not in line:
            record = typed(line)
        # The fast path, for a line that opens an object in UTF-8 (what json.loads would detect)
        if record is None and line[:1] == b"{" and line[1:2] != b"\x00":
            try:
                text = line.decode("utf-8", "surrogatepass")
                obj, end = scan(text, 0)
                record = fast_record(obj) if end == len(text) or not text[end:].strip(_JSON_WS) else None
            except (ValueError, RecursionError, StopIteration):
                record = None
        if record is not None:
            if now is not None and not -ts_tolerance_s <= record.ts - now <= ts_tolerance_s \
                    and (why := implausible_ts(record.ts, now, ts_tolerance_s)) is not None:
                errors.append(RecordError(i, "timestamp", why))
            else:
                records.append(record)
            continue
        if not line.strip():
            continue
        try:
            rec = loads(line, parse_constant=_no_constant, parse_float=_finite_float)
        except NonFinite as exc:
            errors.append(RecordError(i, "non_finite", str(exc)))
            continue
        except (ValueError, UnicodeDecodeError) as exc:
            errors.append(RecordError(i, "json", f"invalid JSON: {exc}"))
            continue
        except RecursionError:
            errors.append(RecordError(i, "json", f"invalid JSON: nested more than {MAX_NESTING} levels deep"))
            continue
        if type(rec) is not dict:
            errors.append(RecordError(i, "not_object", f"expected a JSON object, got {type(rec).__name__}"))
            continue
        try:
            message = None if FAST_OK(rec) else schema_error(rec)
        except RecursionError:  # the validator walks what it is given
            message = f"nested more than {MAX_NESTING} levels deep"
        if message is not None:
            errors.append(RecordError(i, "schema", message))
            continue
        message = strict_problem(rec)
        if message is not None:
            errors.append(RecordError(i, "value", message))
            continue
        try:
            record = build(rec)
        except InvalidRecord as exc:  # schema-valid objects convert; this guards the two drifting apart
            errors.append(RecordError(i, "schema", str(exc)))
            continue
        if now is not None and (why := implausible_ts(record.ts, now, ts_tolerance_s)) is not None:
            errors.append(RecordError(i, "timestamp", why))
            continue
        records.append(record)
    return records, errors


_CHECKED_FIELDS = tuple(f.name for f in fields(RequestRecord) if f.name != "carried")


def record_problem(record: RequestRecord, now: float | None = None,
                   ts_tolerance_s: float = DEFAULT_TS_TOLERANCE_S) -> RecordError | None:
    """Why a record built by another intake (an OTLP span) could not have come in as a line, or
    None: the same schema, value and timestamp checks, under the same error kinds (line 0).
    A record the strict schema's struct takes (``RECORD_OK``) has neither a schema nor a value
    problem; any other is looked at by the careful steps, which find and word it."""
    if RECORD_OK is not None and RECORD_OK(record):
        if now is not None and (why := implausible_ts(record.ts, now, ts_tolerance_s)) is not None:
            return RecordError(0, "timestamp", why)
        return None
    obj: dict[str, Any] = {}
    for name in _CHECKED_FIELDS:
        value = getattr(record, name)
        if value is not None:
            obj[name] = list(value) if type(value) is tuple else value
    try:
        message = validate(obj)
    except RecursionError:
        message = f"nested more than {MAX_NESTING} levels deep"
    if message is not None:
        return RecordError(0, "schema", message)
    message = strict_problem(obj)
    if message is not None:
        return RecordError(0, "value", message)
    if now is not None and (why := implausible_ts(record.ts, now, ts_tolerance_s)) is not None:
        return RecordError(0, "timestamp", why)
    return None


def parse_ndjson(body: bytes, limit: int, *, now: float | None = None,
                 ts_tolerance_s: float = DEFAULT_TS_TOLERANCE_S) -> tuple[list[RequestRecord], list[RecordError]]:
    """Split an NDJSON body into valid records and per-line errors; BodyTooLarge past ``limit``.

    ``now``: the exporter's clock at arrival, for the timestamp check (see :func:`parse_lines`).
    """
    if len(body) > limit:
        raise BodyTooLarge(f"body of {len(body)} bytes exceeds the limit of {limit} bytes")
    return parse_lines(body.split(b"\n"), now=now, ts_tolerance_s=ts_tolerance_s)


def deliver(records: list[RequestRecord], errors: list[RecordError], sink: StateSink, health: Health,
            transport: str, received_at: float, where: str = "", slice_size: int = SLICE_RECORDS,
            source: str = SOURCE) -> None:
    """Hand valid records to the sink in slices; count them and every rejected line by kind.

    Each slice is one ``ingest_records`` call, so the state lock is held for one slice at a
    time and a scrape or another client's batch gets in between the slices of a large body.
    """
    for start in range(0, len(records), slice_size):
        sink.ingest_records(records[start:start + slice_size], received_at)
    if records:
        health.inc("prefixscope_records_ingested", (transport,), len(records))
    by_kind: dict[str, list[RecordError]] = {}
    for e in errors:
        by_kind.setdefault(e.kind, []).append(e)
    for kind, errs in by_kind.items():
        first = errs[0]
        health.error(source, kind, f"{transport}{' ' + where if where else ''} line {first.line}: {first.error}", len(errs))


# ---- file tail ----------------------------------------------------------------------------
class RecordFileTail:
    """Follow an NDJSON file: appends, truncation and rotation; a partial last line waits.

    Rotation (the path now names another file) is noticed by inode: the old file is read to its
    end first, so no complete line is lost. Truncation (the file got shorter) restarts at 0.
    """

    def __init__(self, path: str | os.PathLike[str], sink: StateSink, health: Health, *,
                 poll_interval: float = 0.25, max_line_bytes: int = 1 << 20,
                 clock: Callable[[], float] = time.time,
                 ts_tolerance_s: float = DEFAULT_TS_TOLERANCE_S) -> None:
        self.path = Path(path)
        self.sink = sink
        self.health = health
        self.poll_interval = poll_interval
        self.max_line_bytes = max_line_bytes
        self.clock = clock
        self.ts_tolerance_s = ts_tolerance_s
        self._fh: BinaryIO | None = None
        self._ino: tuple[int, int] | None = None
        self._offset = 0
        self._partial = b""
        self._line = 0  # lines consumed from the current file, for error messages
        self._skipping = False  # inside an over-long line: drop bytes up to its newline
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._missing_logged = False

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"prefixscope-tail-{self.path.name}", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._close_file()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll_once()
            except Exception as exc:  # keep tailing: a bug on one chunk must not stop intake
                log.exception("tailing %s failed", self.path)
                self.health.error(SOURCE, "tail", f"{self.path}: {type(exc).__name__}: {exc}")
            self._stop.wait(self.poll_interval)

    def _close_file(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def _open(self) -> bool:
        try:
            fh = open(self.path, "rb")  # noqa: SIM115 - held open across polls on purpose
        except FileNotFoundError:
            if not self._missing_logged:
                log.info("waiting for %s to appear", self.path)
                self._missing_logged = True
            return False
        st = os.fstat(fh.fileno())
        self._fh, self._ino = fh, (st.st_dev, st.st_ino)
        self._offset, self._partial, self._line, self._skipping = 0, b"", 0, False
        self._missing_logged = False
        return True

    def poll_once(self) -> int:
        """Read what is new; returns the number of records delivered."""
        if self._fh is None and not self._open():
            return 0
        delivered = self._read_to_end()
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return delivered  # rotated away and not yet recreated: keep the old file until it is
        if (st.st_dev, st.st_ino) != self._ino:
            delivered += self._read_to_end()  # lines written to the old file just before rotation
            if self._partial:
                self._deliver_lines([self._partial])  # the old file is finished: its last line is whole
            self._close_file()
            if self._open():
                delivered += self._read_to_end()
        elif st.st_size < self._offset:
            log.info("%s was truncated; reading from its start", self.path)
            self._fh.seek(0)
            self._offset, self._partial, self._line, self._skipping = 0, b"", 0, False
            delivered += self._read_to_end()
        return delivered

    def _read_to_end(self) -> int:
        chunk = self._fh.read()
        if not chunk:
            return 0
        self._offset += len(chunk)
        data = self._partial + chunk
        if self._skipping:
            end = data.find(b"\n")
            if end < 0:
                self._partial = b""
                return 0
            data, self._skipping = data[end + 1:], False
            self._line += 1
        lines = data.split(b"\n")
        self._partial = lines.pop()  # after the last newline: incomplete until one follows
        if len(self._partial) > self.max_line_bytes:
            self.health.error(SOURCE, "line_too_long", f"{self.path}: a line exceeds {self.max_line_bytes} bytes; dropped")
            self._partial, self._skipping = b"", True
        return self._deliver_lines(lines)

    def _deliver_lines(self, lines: list[bytes]) -> int:
        now = self.clock()
        records, errors = parse_lines(lines, self._line + 1, now=now, ts_tolerance_s=self.ts_tolerance_s)
        self._line += len(lines)
        deliver(records, errors, self.sink, self.health, "file", now, str(self.path))
        return len(records)
