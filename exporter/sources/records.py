"""Request records (``prefixscope.request/v1``): NDJSON parsing, validation and a file tailer.

``parse_ndjson`` is pure: bytes in, valid records and per-line errors out. The schema is
compiled once. Most records are valid, so each is first checked by a fast path compiled from
the same schema file (required fields, and type/bounds/enum of the fields present); only a
record the fast path does not accept goes through the full ``jsonschema`` validator, which
then decides and words the error. The fast path never accepts what the validator rejects
for this flat schema, so the answer is the validator's either way. Each accepted object becomes
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
from typing import Any, BinaryIO

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
SLICE_RECORDS = 200  # records applied per hold of the state lock (a few ms)


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


# ---- the fast path, compiled from the schema ----------------------------------------------
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
    "array": (list,), "object": (dict,), "null": (type(None),),
}
Check = Callable[[Any], bool]


def _type_ok(value: Any, types: tuple[str, ...]) -> bool:
    for t in types:
        if t == "null" and value is None:
            return True
        if t == "boolean":
            if type(value) is bool:
                return True
        elif isinstance(value, _JSON_TYPES[t]) and type(value) is not bool:
            return True
    return False


def _compile_property(spec: dict[str, Any]) -> Check | None:
    """A predicate for one property, or None if the schema uses keywords we do not fast-check."""
    known = {"type", "minimum", "maximum", "minLength", "maxLength", "enum", "items", "description", "const"}
    if set(spec) - known:
        return None
    raw = spec.get("type")
    types = (raw,) if isinstance(raw, str) else tuple(raw or ())
    lo, hi = spec.get("minimum"), spec.get("maximum")
    min_len, max_len = spec.get("minLength"), spec.get("maxLength")
    enum = spec.get("enum")
    has_const, const = "const" in spec, spec.get("const")
    items = _compile_property(spec["items"]) if "items" in spec else None
    if "items" in spec and items is None:
        return None

    def check(v: Any) -> bool:
        if types and not _type_ok(v, types):
            return False
        if has_const and v != const:
            return False
        if enum is not None and v not in enum:
            return False
        if isinstance(v, int | float) and type(v) is not bool and (
                (lo is not None and v < lo) or (hi is not None and v > hi)):
            return False
        if isinstance(v, str) and ((min_len is not None and len(v) < min_len) or (max_len is not None and len(v) > max_len)):
            return False
        return not (items is not None and isinstance(v, list) and not all(map(items, v)))

    return check


def _compile(schema: dict[str, Any]) -> Callable[[Any], bool]:
    props = {name: _compile_property(spec) for name, spec in schema.get("properties", {}).items()}
    required = tuple(schema.get("required", ()))
    closed = schema.get("additionalProperties", True) is False
    if any(c is None for c in props.values()):
        return lambda _rec: False  # the schema outgrew the fast path: always ask the validator

    def fast_ok(rec: Any) -> bool:
        if type(rec) is not dict:
            return False
        for name in required:
            if name not in rec:
                return False
        for name, value in rec.items():
            check = props.get(name)
            if check is None:
                if closed:
                    return False
            elif not check(value):
                return False
        return True

    return fast_ok


FAST_OK = _compile(SCHEMA)


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
# For those, one pass over the object does what the schema check, ``strict_problem`` and
# ``RequestRecord.from_json`` do in three, and builds the value. Anything else (a type or bound
# it does not know to be fine, a non-ASCII string, a nested value under an unknown key) makes it
# answer None, and the line takes the three steps, which then decide and word the error. It
# accepts only what those steps accept, with the same value (tests/exporter/sources/test_records_source.py).
_FAIL: Any = object()
Convert = Callable[[Any], Any]  # the value as RequestRecord holds it, or _FAIL


def _spec_types(spec: dict[str, Any]) -> tuple[set[str], bool, list[Any] | None]:
    """A schema property's JSON types other than null, whether null is allowed (not when an
    enum without None leaves it out), and its enum."""
    raw = spec.get("type")
    types = set((raw,) if isinstance(raw, str) else raw or ())
    nullable = "null" in types
    types.discard("null")
    enum = spec.get("enum")
    if enum is not None and nullable and None not in enum:
        nullable = False
    return types, nullable, enum


def _fast_convert(name: str, spec: dict[str, Any]) -> Convert | None:
    """Check-and-convert for one schema property; None if the fast path cannot decide it."""
    if set(spec) - {"type", "minimum", "maximum", "minLength", "maxLength", "enum", "items", "description", "const"}:
        return None
    types, nullable, enum = _spec_types(spec)
    if "const" in spec:
        const = spec["const"]
        if types or enum is not None or type(const) is not str or not const.isascii():
            return None
        return lambda v: v if v == const and type(v) is str else _FAIL
    if len(types) != 1:
        return None
    (kind,) = types
    lo, hi = spec.get("minimum"), spec.get("maximum")
    if kind == "string":
        if lo is not None or hi is not None:
            return None
        min_len = spec.get("minLength", 0)
        max_len = min(spec.get("maxLength", MAX_LABEL_VALUE_CHARS), MAX_LABEL_VALUE_CHARS)
        allowed = frozenset(e for e in enum if type(e) is str) if enum is not None else None

        def string(v: Any) -> Any:
            if type(v) is str:
                if min_len <= len(v) <= max_len and v.isascii() and (allowed is None or v in allowed):
                    return v
                return _FAIL
            return None if v is None and nullable else _FAIL
        return string
    if enum is not None or "minLength" in spec or "maxLength" in spec:
        return None
    if kind == "integer":
        low, high = (lo if lo is not None else -MAX_INTEGER), min(hi if hi is not None else MAX_INTEGER, MAX_INTEGER)

        def integer(v: Any) -> Any:
            if type(v) is int:
                return v if low <= v <= high else _FAIL
            return None if v is None and nullable else _FAIL
        return integer
    if kind == "number":
        low_n = max(lo, -MAX_NUMBER) if lo is not None else -MAX_NUMBER
        high_n = min(hi, MAX_NUMBER) if hi is not None else MAX_NUMBER

        def number(v: Any) -> Any:
            t = type(v)
            if t is float or t is int:
                return float(v) if low_n <= v <= high_n else _FAIL  # NaN fails the comparison
            return None if v is None and nullable else _FAIL
        return number
    if kind == "boolean":
        if lo is not None or hi is not None:
            return None
        return lambda v: v if type(v) is bool or (v is None and nullable) else _FAIL
    if kind == "array":
        items = spec.get("items", {})
        if lo is not None or hi is not None or set(items) - {"type", "minimum", "maximum", "description"} \
                or items.get("type") != "integer":
            return None
        i_lo = items.get("minimum", -MAX_INTEGER)
        i_hi = items.get("maximum", 2**64 - 1)

        def int_array(v: Any) -> Any:
            if type(v) is list:
                if not v:
                    return ()
                if set(map(type, v)) == _INT_ONLY and i_lo <= min(v) and max(v) <= i_hi:
                    return tuple(v)
                return _FAIL
            return None if v is None and nullable else _FAIL
        return int_array
    return None


_INT_ONLY = {int}


def _fast_source(spec: dict[str, Any], var: str, const: Callable[[Any], str]) -> list[str] | None:
    """:func:`_fast_convert` as lines of Python checking and converting ``var`` in place (``return
    None`` where the converter answers ``_FAIL``), for the code generated per record shape; None
    where that converter is None. ``const`` names a value for the generated code."""
    types, nullable, enum = _spec_types(spec)
    v = var
    otherwise = [f"elif {v} is not None:", "    return None"] if nullable else ["else:", "    return None"]
    if "const" in spec:
        return [f"if not (type({v}) is str and {v} == {const(spec['const'])}):", "    return None"]
    (kind,) = types
    lo, hi = spec.get("minimum"), spec.get("maximum")
    if kind == "string":
        min_len = spec.get("minLength", 0)
        max_len = min(spec.get("maxLength", MAX_LABEL_VALUE_CHARS), MAX_LABEL_VALUE_CHARS)
        allowed = f" and {v} in {const(frozenset(e for e in enum if type(e) is str))}" if enum is not None else ""
        return [f"if type({v}) is str:",
                f"    if not ({const(min_len)} <= len({v}) <= {const(max_len)} and {v}.isascii(){allowed}):",
                "        return None", *otherwise]
    if kind == "integer":
        low, high = (lo if lo is not None else -MAX_INTEGER), min(hi if hi is not None else MAX_INTEGER, MAX_INTEGER)
        return [f"if type({v}) is int:", f"    if not ({const(low)} <= {v} <= {const(high)}):", "        return None",
                *otherwise]
    if kind == "number":
        low_n = max(lo, -MAX_NUMBER) if lo is not None else -MAX_NUMBER
        high_n = min(hi, MAX_NUMBER) if hi is not None else MAX_NUMBER
        return [f"t = type({v})", "if t is float or t is int:",
                f"    if not ({const(low_n)} <= {v} <= {const(high_n)}):", "        return None",
                f"    {v} = float({v})", *otherwise]
    if kind == "boolean":
        return [f"if type({v}) is not bool{f' and {v} is not None' if nullable else ''}:", "    return None"]
    if kind == "array":
        items = spec.get("items", {})
        i_lo, i_hi = const(items.get("minimum", -MAX_INTEGER)), const(items.get("maximum", 2**64 - 1))
        return [f"if type({v}) is list:", f"    if not {v}:", f"        {v} = ()",
                f"    elif set(map(type, {v})) == _INT_ONLY and {i_lo} <= min({v}) and max({v}) <= {i_hi}:",
                f"        {v} = tuple({v})", "    else:", "        return None", *otherwise]
    return None


_FLAT_UNKNOWN: Convert = lambda v: _FAIL  # noqa: E731 - marks a key the schema does not name
_RECORD_FIELDS = tuple(f.name for f in fields(RequestRecord))  # the constructor's positional order
# The slots of RequestRecord, set one by one: what its generated __init__ does (through
# object.__setattr__, it being frozen), less the call. Only while __init__ does nothing more.
_SETTERS: tuple[Callable[[Any, Any], None], ...] | None = (
    tuple(getattr(RequestRecord, name).__set__ for name in _RECORD_FIELDS)
    if not hasattr(RequestRecord, "__post_init__") and getattr(RequestRecord, "__slots__", ()) == _RECORD_FIELDS
    else None)
Build = Callable[[dict[str, Any]], RequestRecord | None]  # one record shape's check-and-convert
MAX_SHAPES = 256  # record shapes (key sequences) remembered, each with its generated code


def _compile_fast_record(schema: dict[str, Any], generate: bool = True) -> Callable[[Any], RequestRecord | None]:
    """The whole-record fast path. ``generate=False``: every shape takes the generic loop over
    per-field converters (the reference the generated code is tested against)."""
    props: dict[str, dict[str, Any]] = schema.get("properties", {})
    convert = {name: _fast_convert(name, spec) for name, spec in props.items()}
    required = tuple(schema.get("required", ()))
    if (any(c is None for c in convert.values()) or schema.get("additionalProperties", True) is not True
            or required != _RECORD_FIELDS[:4] or _RECORD_FIELDS[-1] != "carried"
            or set(convert) != set(_RECORD_FIELDS[:-1])):
        return lambda _obj: None  # the schema outgrew the fast path: every line takes the steps
    position = {name: i for i, name in enumerate(_RECORD_FIELDS)}
    # A producer writes the same keys in the same order record after record: per such shape, the
    # code that checks and converts its values (generated once, for a shape kept), else the loop.
    shapes: dict[tuple[str, ...], Build | None] = {}
    fail = _FAIL

    def generic(keys: tuple[str, ...]) -> Build:
        steps = tuple((convert[k], position[k]) if k in convert else (_FLAT_UNKNOWN, -1) for k in keys)
        template: list[Any] = [None] * len(_RECORD_FIELDS)
        template[-1] = frozenset(k for k in keys if k in convert and k not in required)  # carried

        def build(obj: dict[str, Any]) -> RequestRecord | None:
            args = template.copy()
            for (conv, at), value in zip(steps, obj.values(), strict=True):
                if at < 0:  # a key the schema does not name: allowed, if flat and finite
                    t = type(value)
                    if t is dict or t is list or (t is float and value - value != 0.0):
                        return None
                    continue
                out = conv(value)
                if out is fail:
                    return None
                args[at] = out
            return RequestRecord(*args)
        return build

    def generated(keys: tuple[str, ...]) -> Build | None:
        """Straight-line code for one shape: no call per field, no loop."""
        consts: dict[str, Any] = {"_RR": RequestRecord, "_INT_ONLY": _INT_ONLY}

        def const(value: Any) -> str:
            name = f"_c{len(consts)}"
            consts[name] = value
            return name
        names = [f"v{i}" for i in range(len(keys))]
        lines = ["def build(obj):", f"    {', '.join(names)}, = obj.values()"]
        args = ["None"] * len(_RECORD_FIELDS)
        for k, v in zip(keys, names, strict=True):
            if k in props:
                code = _fast_source(props[k], v, const)
                if code is None:
                    return None
                args[position[k]] = v
            else:  # a key the schema does not name: allowed, if flat and finite
                code = [f"t = type({v})", f"if t is dict or t is list or (t is float and {v} - {v} != 0.0):",
                        "    return None"]
            lines += ["    " + line for line in code]
        args[-1] = const(frozenset(k for k in keys if k in convert and k not in required))
        if _SETTERS is None:
            lines.append(f"    return _RR({', '.join(args)})")
        else:  # the frozen dataclass's __init__ without its call: each slot set directly
            lines.append("    o = _new(_RR)")
            lines += [f"    {const(setter)}(o, {arg})" for setter, arg in zip(_SETTERS, args, strict=True)]
            lines.append("    return o")
            consts["_new"] = object.__new__
        exec("\n".join(lines), consts)  # code from the schema; keys enter only as positions
        return consts["build"]  # type: ignore[no-any-return]

    def shape_of(keys: tuple[str, ...]) -> Build | None:
        if not all(name in keys for name in required) or len(set(keys)) != len(keys):
            return None
        if len(shapes) >= MAX_SHAPES:
            return generic(keys)  # not kept: not worth generating
        build = (generated(keys) if generate else None) or generic(keys)
        shapes[keys] = build
        return build

    def fast_record(obj: Any) -> RequestRecord | None:
        if type(obj) is not dict:
            return None
        keys = tuple(obj)
        build = shapes.get(keys)
        if build is None:
            build = shape_of(keys)
            if build is None:
                return None
        return build(obj)

    return fast_record


FAST_RECORD = _compile_fast_record(SCHEMA)
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
    scan, fast_record = _FAST_SCAN, FAST_RECORD
    for i, line in enumerate(lines, first_line):
        # The fast path, for a line that opens an object in UTF-8 (what json.loads would detect)
        if line[:1] == b"{" and line[1:2] != b"\x00":
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
    None: the same schema, value and timestamp checks, under the same error kinds (line 0)."""
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
