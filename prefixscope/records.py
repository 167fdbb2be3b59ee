"""One request record (``prefixscope.request/v1``) as a typed value.

Producers write records as JSON objects (one per NDJSON line); the schema in
``schemas/request.v1.json`` is the contract. :class:`RequestRecord` holds exactly the schema's
fields, so code that reads a record names its fields instead of looking up string keys, and a
misspelt field is an AttributeError instead of a silent ``None``.

Two constructors:

- :meth:`RequestRecord.from_json` for an object that already passed the schema (the exporter's
  intake validates every line first, on its fast path). It converts and checks only what it must
  to build the value, and raises :class:`InvalidRecord` when a required field is missing or
  cannot be converted.
- :meth:`RequestRecord.parse` validates against the schema first (the full ``jsonschema``
  validator) and raises :class:`InvalidRecord` with the validator's message.

A record keeps one more thing than the values: which optional fields the object *carried*,
null included. For fields that describe an event (a migration, an async-prefill wait), a
producer that writes the key with null is saying "it did not happen" — the signal is
instrumented — while an absent key says nothing. :meth:`RequestRecord.reports` answers that.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import jsonschema

from prefixscope import REQUEST_SCHEMA_PATH

SCHEMA_ID = "prefixscope.request/v1"
SCHEMA: dict[str, Any] = json.loads(REQUEST_SCHEMA_PATH.read_text())
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)
REQUIRED: tuple[str, ...] = tuple(SCHEMA["required"])


# How far a record's ts may be from the exporter's clock when it arrives. A record is sent after
# its response, so minutes late is normal (long generations, a gateway's batching); hours late,
# or in the future past clock skew, is a wrong clock or a unit error. Configurable
# (the exporter's ``records.ts_tolerance``).
DEFAULT_TS_TOLERANCE_S = 900.0


def implausible_ts(ts: float, received_at: float, tolerance_s: float) -> str | None:
    """Why a record's ``ts`` cannot be its arrival time, received at ``received_at``; None if it can."""
    off = ts - received_at
    if abs(off) <= tolerance_s:
        return None
    if abs(ts / 1000.0 - received_at) <= tolerance_s:
        return f"ts {ts!r} is in milliseconds (ts must be Unix seconds)"
    when = "ahead of" if off > 0 else "behind"
    return f"ts {ts!r} is {abs(off):.0f} s {when} the exporter's clock (tolerance {tolerance_s:g} s)"


class InvalidRecord(ValueError):
    """The object is not a valid ``prefixscope.request/v1`` record (the message says why)."""


def schema_error(obj: Any) -> str | None:
    """None if ``obj`` passes the schema, else the validator's best message (with the field's path)."""
    error = jsonschema.exceptions.best_match(VALIDATOR.iter_errors(obj))
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path)
    return f"{where}: {error.message}" if where else error.message


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request served behind a prefix-aware router (see the schema for each field's meaning)."""

    ts: float
    request_id: str
    worker: str
    prompt_tokens: int
    schema: str | None = None
    session_key: str | None = None
    model: str | None = None
    block_hashes: tuple[int, ...] | None = None
    block_size: int | None = None
    cached_tokens: int | None = None
    predicted_cached_tokens: int | None = None
    output_tokens: int | None = None
    ttft_s: float | None = None
    prefill_s: float | None = None
    queue_s: float | None = None
    walk_s: float | None = None
    decision: str | None = None
    fallback_tier: str | None = None
    async_wait_s: float | None = None
    migrated_from: str | None = None
    migration_kind: str | None = None
    migrate_s: float | None = None
    expert_signature: str | None = None
    admitted_by_affinity: bool | None = None
    segment: str | None = None
    lora_name: str | None = None
    tenant: str | None = None
    # Not a schema field: the optional fields the source object carried, null included.
    carried: frozenset[str] = frozenset()

    def reports(self, name: str) -> bool:
        """The record says something about ``name``: a value, or an explicit null in its object."""
        return getattr(self, name) is not None or name in self.carried

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> RequestRecord:
        """Build from an object that passed the schema; unknown keys are ignored (the schema allows them).

        Raises :class:`InvalidRecord` if a required field is missing or a value cannot be converted.
        """
        try:
            ts, request_id, worker, prompt = obj["ts"], obj["request_id"], obj["worker"], obj["prompt_tokens"]
        except KeyError as exc:
            raise InvalidRecord(f"missing required field {exc.args[0]!r}") from None
        except TypeError:
            raise InvalidRecord(f"expected a JSON object, got {type(obj).__name__}") from None
        carried = _OPTIONAL.intersection(obj)
        try:
            kw = {name: _CONVERT[name](obj[name]) for name in carried}
            return cls(float(ts), str(request_id), str(worker), int(prompt), carried=carried, **kw)
        except (TypeError, ValueError, OverflowError) as exc:  # OverflowError: an integer past any float
            raise InvalidRecord(f"record {request_id!r}: {exc}") from None

    @classmethod
    def parse(cls, obj: Any) -> RequestRecord:
        """Validate ``obj`` against the schema, then build the record (:class:`InvalidRecord` if invalid)."""
        message = schema_error(obj)
        if message is not None:
            raise InvalidRecord(message)
        return cls.from_json(obj)


def _opt(conv: Any) -> Any:
    return lambda v: None if v is None else conv(v)


def _same(v: Any) -> Any:
    return v


def _hashes(v: Any) -> tuple[int, ...] | None:
    return None if v is None else tuple(v)


# Optional field -> its conversion from the JSON value: numbers become floats and integers ints
# (JSON may spell either way: 5 for 5.0, 512.0 for 512); the block hashes a tuple, so the value
# stays immutable.
_KINDS: dict[str, Any] = {"number": _opt(float), "integer": _opt(int), "array": _hashes}
_CONVERT: dict[str, Any] = {}
for _f in fields(RequestRecord):
    if _f.name in REQUIRED or _f.name == "carried":
        continue
    _spec = SCHEMA["properties"][_f.name]  # a field the schema lacks fails here, at import
    _types = _spec.get("type", ())
    _types = (_types,) if isinstance(_types, str) else tuple(_types)
    _CONVERT[_f.name] = next((_KINDS[t] for t in _types if t in _KINDS), _same)
_OPTIONAL = frozenset(_CONVERT)
del _f, _spec, _types
if set(SCHEMA["properties"]) != set(REQUIRED) | _OPTIONAL:  # the value and its contract move together
    raise ImportError(f"RequestRecord lacks schema fields: {sorted(set(SCHEMA['properties']) - set(REQUIRED) - _OPTIONAL)}")
