"""OTLP trace export requests → the request facts their spans carry (pure: bytes in, values out).

vLLM exports one span per finished request (``llm_request``, kind SERVER; tracer scope
``vllm.tracing.otel``) with ``gen_ai.*`` attributes (vllm/tracing/utils.py ``SpanAttributes``):
``gen_ai.latency.time_to_first_token``, ``.time_in_queue``, ``.time_in_model_prefill`` (seconds),
``gen_ai.usage.prompt_tokens`` (cached tokens included), ``.completion_tokens`` and
``gen_ai.request.id``. vLLM sets no cached-token attribute (up to v0.33); OpenTelemetry's GenAI
conventions name it ``gen_ai.usage.cache_read.input_tokens`` (proposed for vLLM in
vllm-project/vllm#41788), read when present. The worker is named by a resource attribute
(``service.instance.id``, else ``service.name``), the session by a configured attribute on the
span, its resource or another span of the same trace (a client's or router's span).

What vLLM's span lacks, the client's span of the same trace may carry: both routers forward
``traceparent``, so an OpenTelemetry GenAI client's span (kind CLIENT, ``chat MODEL``) is the
parent of vLLM's. Its ``gen_ai.conversation.id`` names the session, and its
``gen_ai.usage.cache_read.input_tokens`` is the response's ``usage.prompt_tokens_details.cached_tokens``
(vLLM reports it with ``--enable-prompt-tokens-details``). :func:`trace_facts` collects both per
trace; the request span's own values win.

Both OTLP/HTTP encodings decode to the same :class:`Span` values: binary protobuf
(``application/x-protobuf``, what vLLM's ``http/protobuf`` exporter sends; an OTLP/gRPC
``Export`` message is the same bytes, ``exporter.web.otlp_grpc``) and OTLP JSON
(``application/json``: hex ids, lowerCamelCase keys, 64-bit integers as decimal strings).

Routers' spans map onto nothing. sglang-router's ``--enable-trace`` (0.3.2) exports one root
``http_request`` span per HTTP request whose duration is the whole request, the worker's time
included, and no span of its worker selection; mapping it onto the router tree-walk time
(``walk_latency``) would report the worker's latency as the router's lookup, so it is skipped
like any span that is not a request (docs/routers.md, tests/fixtures/sglang_router_spans.binpb).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.common.v1 import common_pb2

from exporter.core.labels import label_value_problem
from prefixscope.records import SCHEMA, RequestRecord

AttrValue = str | bool | int | float | bytes | tuple[Any, ...] | None
PROTOBUF = "application/x-protobuf"
JSON = "application/json"

# vLLM's span and attribute names (vllm/tracing/utils.py SpanAttributes; output_processor.py do_tracing).
VLLM_SPAN = "llm_request"
REQUEST_ID = "gen_ai.request.id"
PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
TTFT = "gen_ai.latency.time_to_first_token"
QUEUE = "gen_ai.latency.time_in_queue"
PREFILL = "gen_ai.latency.time_in_model_prefill"
RESPONSE_MODEL = "gen_ai.response.model"
REQUEST_MODEL = "gen_ai.request.model"
CACHE_READ = "gen_ai.usage.cache_read.input_tokens"
MAX_SESSION_CHARS: int = SCHEMA["properties"]["session_key"]["maxLength"]


@dataclass(frozen=True, slots=True)
class Span:
    trace_id: str  # lower-case hex
    span_id: str
    name: str
    start_ns: int
    end_ns: int
    attributes: Mapping[str, AttrValue]
    resource: Mapping[str, AttrValue]
    scope: str = ""
    parent_span_id: str = ""

    def slim(self, names: frozenset[str]) -> Span:
        """The span with only the attributes named (what waits for its session keeps no more)."""
        return Span(self.trace_id, self.span_id, self.name, self.start_ns, self.end_ns,
                    {k: v for k, v in self.attributes.items() if k in names},
                    {k: v for k, v in self.resource.items() if k in names}, self.scope, self.parent_span_id)

    def attr(self, names: Iterable[str]) -> AttrValue:
        """The first of ``names`` set on the span, else on its resource."""
        for name in names:
            if self.attributes.get(name) is not None:
                return self.attributes[name]
        for name in names:
            if self.resource.get(name) is not None:
                return self.resource[name]
        return None


@dataclass(frozen=True)
class SpanMapping:
    """Which spans are requests and which attributes name the worker, the session and the model."""

    span_names: frozenset[str] = frozenset({VLLM_SPAN})
    worker_attributes: tuple[str, ...] = ("service.instance.id", "service.name")
    session_attributes: tuple[str, ...] = ()  # none by default: vLLM's span carries no session
    cached_attributes: tuple[str, ...] = (CACHE_READ,)
    model_attributes: tuple[str, ...] = (RESPONSE_MODEL, REQUEST_MODEL)
    # The request's LoRA adapter and tenant (records' lora_name and tenant): none by default —
    # vLLM names a LoRA request's adapter as its model, so (REQUEST_MODEL,) when it serves adapters.
    adapter_attributes: tuple[str, ...] = ()
    tenant_attributes: tuple[str, ...] = ()
    # An attribute value (a worker's URL, host:port or name) -> the configured worker name.
    worker_names: Mapping[str, str] = field(default_factory=dict)

    @property
    def read(self) -> frozenset[str]:
        """Every attribute a request span is read for."""
        return frozenset((REQUEST_ID, PROMPT_TOKENS, COMPLETION_TOKENS, TTFT, QUEUE, PREFILL, *self.worker_attributes,
                          *self.session_attributes, *self.cached_attributes, *self.model_attributes,
                          *self.adapter_attributes, *self.tenant_attributes))

    def worker(self, value: str) -> str:
        key = value.strip().rstrip("/").lower()
        for candidate in (key, f"http://{key}", f"https://{key}"):
            if candidate in self.worker_names:
                return self.worker_names[candidate]
        return value


# ---- the request's budget -------------------------------------------------------------------
# A message costs memory by its elements, not its bytes: an empty span is two bytes on the wire
# and a few hundred in memory, so 8 MB of them (8 KB gzipped) would build 4 M spans. The budget
# is checked on the wire, before anything is built: spans, and every element (a span, an
# attribute, its value, an event...).
DEFAULT_MAX_SPANS = 10_000  # the Collector's batch processor sends 8,192 by default, vLLM 512
ITEMS_PER_SPAN = 64  # elements allowed per span on average (vLLM's request span has ~25)
MAX_DEPTH = 64  # nested values (an attribute holding arrays of arrays ...)
# A protobuf body up to this size is parsed without being walked first: it cannot hold more than
# half as many elements as it has bytes, which the budget allows; its spans are counted once built.
WALK_ABOVE = 64 * 1024


class OtlpDecodeError(ValueError):
    """The body is not an OTLP ExportTraceServiceRequest in the encoding it claims."""

    kind = "decode"


class BudgetExceeded(OtlpDecodeError):
    """The request holds more spans or elements than one request may (resending cannot succeed)."""

    kind = "too_large"


@dataclass(frozen=True, slots=True)
class Budget:
    """What one export request may hold: spans, and elements of any kind."""

    max_spans: int = DEFAULT_MAX_SPANS
    max_items: int = DEFAULT_MAX_SPANS * ITEMS_PER_SPAN

    def check(self, spans: int, items: int) -> None:
        if spans > self.max_spans:
            raise BudgetExceeded(f"more than {self.max_spans} spans in one request; send smaller batches")
        if items > self.max_items:
            raise BudgetExceeded(f"more than {self.max_items} elements (spans, attributes, values) in one "
                                 "request; send smaller batches")


def _message_tables() -> dict[str, dict[int, str]]:
    """Message type → {field number: the message type of a field that holds one} over the request's types."""
    tables: dict[str, dict[int, str]] = {}
    todo = [trace_service_pb2.ExportTraceServiceRequest.DESCRIPTOR]
    while todo:
        desc = todo.pop()
        if desc.full_name in tables:
            continue
        tables[desc.full_name] = {f.number: f.message_type.full_name for f in desc.fields if f.message_type is not None}
        todo += [f.message_type for f in desc.fields if f.message_type is not None]
    return tables


_TABLES = _message_tables()
_REQUEST = trace_service_pb2.ExportTraceServiceRequest.DESCRIPTOR.full_name
_SPAN = "opentelemetry.proto.trace.v1.Span"

try:
    from exporter.codecs import _otlp_core
except ImportError as exc:  # not built: the Python reference walks
    _WALKER = None
    logging.getLogger(__name__).warning("OTLP wire walk: the Python reference (compiled core not used: %s)", exc)
else:
    _WALKER = _otlp_core.Walker(_TABLES, _REQUEST, _SPAN, MAX_DEPTH, OtlpDecodeError)
CORE = "reference" if _WALKER is None else "compiled"


def _varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    result = shift = 0
    while pos < end:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            break
    raise OtlpDecodeError("not an OTLP protobuf ExportTraceServiceRequest: a truncated or overlong varint")


def count_protobuf(body: bytes, budget: Budget) -> tuple[int, int]:
    """:func:`count_protobuf_reference`'s answer, from the compiled walk when it is built."""
    if _WALKER is not None:
        return _WALKER.count(body, budget)  # type: ignore[no-any-return]
    return count_protobuf_reference(body, budget)


def count_protobuf_reference(body: bytes, budget: Budget) -> tuple[int, int]:
    """(spans, elements) of a protobuf ExportTraceServiceRequest, read off its wire format without
    building it; BudgetExceeded as soon as either passes the budget, OtlpDecodeError where the
    wire format breaks (the parser that follows decides everything else)."""
    spans = items = 0
    stack = [(0, len(body), _REQUEST, 0)]
    while stack:
        pos, end, name, depth = stack.pop()
        fields = _TABLES[name]
        while pos < end:
            tag, pos = _varint(body, pos, end)
            wire = tag & 7
            if wire == 0:
                _, pos = _varint(body, pos, end)
            elif wire == 1:
                pos += 8
            elif wire == 5:
                pos += 4
            elif wire == 2:
                n, pos = _varint(body, pos, end)
                child = fields.get(tag >> 3)
                if child is not None and pos + n <= end:
                    items += 1
                    if child == _SPAN:
                        spans += 1
                    if spans > budget.max_spans or items > budget.max_items:
                        budget.check(spans, items)
                    if depth >= MAX_DEPTH:
                        raise OtlpDecodeError(f"values nested more than {MAX_DEPTH} levels deep")
                    stack.append((pos, pos + n, child, depth + 1))
                pos += n
            else:
                raise OtlpDecodeError(f"not an OTLP protobuf ExportTraceServiceRequest: wire type {wire}")
        if pos > end:
            raise OtlpDecodeError("not an OTLP protobuf ExportTraceServiceRequest: a field runs past its message")
    return spans, items


def elements(body: bytes, content_type: str | None, budget: Budget) -> int:
    """How many elements the request may build: an upper bound (exact for a walked protobuf body),
    BudgetExceeded when it passes the budget (see :func:`count_protobuf`, :func:`count_json`)."""
    if media_of(content_type) == JSON:
        return count_json(body, budget)
    if len(body) > WALK_ABOVE:
        return count_protobuf(body, budget)[1]
    return len(body) // 2  # every element takes two bytes at least


def count_json(body: bytes, budget: Budget) -> int:
    """An upper bound of the elements of a JSON request (its objects and arrays), counted before it
    is parsed; BudgetExceeded past the budget."""
    items = body.count(b"{") + body.count(b"[")
    if items > budget.max_items:
        budget.check(0, items)
    return items


# ---- decoding ------------------------------------------------------------------------------
# The compiled loop sets a Span's slots directly: only while the dataclass's __init__ does nothing more.
_SPAN_FIELDS = tuple(f.name for f in fields(Span))
_SPANS_OF = (_otlp_core.spans_of if _WALKER is not None and len(_SPAN_FIELDS) == 9
             and not hasattr(Span, "__post_init__") and getattr(Span, "__slots__", ()) == _SPAN_FIELDS else None)


def _pb_value(v: common_pb2.AnyValue) -> AttrValue:
    kind = v.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return tuple(_pb_value(x) for x in v.array_value.values)
    if kind == "kvlist_value":
        return tuple((kv.key, _pb_value(kv.value)) for kv in v.kvlist_value.values)
    return getattr(v, kind)


def _pb_attrs(attrs: Iterable[common_pb2.KeyValue]) -> dict[str, AttrValue]:
    return {kv.key: _pb_value(kv.value) for kv in attrs}


def _pb_id(raw: bytes, size: int, what: str) -> str:
    if raw and len(raw) != size:
        raise OtlpDecodeError(f"{what} of {len(raw)} bytes (an OTLP {what} has {size} or none)")
    return raw.hex()


def decode_protobuf(body: bytes, budget: Budget | None = None, *, counted: bool = False) -> list[Span]:
    """``counted``: :func:`elements` has walked the body already (with the same budget)."""
    budget = budget or Budget()
    if len(body) > WALK_ABOVE and not counted:
        count_protobuf(body, budget)
    try:
        req = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
    except DecodeError as exc:
        raise OtlpDecodeError(f"not an OTLP protobuf ExportTraceServiceRequest: {exc}") from None
    budget.check(sum(len(ss.spans) for rs in req.resource_spans for ss in rs.scope_spans), 0)
    if _SPANS_OF is not None:  # the same loop compiled (exporter.codecs._otlp_core.spans_of)
        return _SPANS_OF(req, Span, _SPAN_FIELDS, _pb_value, _pb_id)  # type: ignore[no-any-return]
    return decode_spans_reference(req)


def decode_spans_reference(req: trace_service_pb2.ExportTraceServiceRequest) -> list[Span]:
    """The spans of a parsed request, in order (the definition the compiled loop follows)."""
    out: list[Span] = []
    for rs in req.resource_spans:
        resource = _pb_attrs(rs.resource.attributes)
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(Span(_pb_id(s.trace_id, 16, "trace id"), _pb_id(s.span_id, 8, "span id"), s.name,
                                s.start_time_unix_nano, s.end_time_unix_nano, _pb_attrs(s.attributes), resource,
                                ss.scope.name, _pb_id(s.parent_span_id, 8, "parent span id")))
    return out


def _json_value(v: Any) -> AttrValue:
    if not isinstance(v, dict) or not v:
        return None
    kind, raw = next(iter(v.items()))
    if kind == "stringValue":
        return str(raw)
    if kind == "boolValue":
        return bool(raw)
    if kind == "intValue":
        return int(raw)  # a decimal string in OTLP JSON, a number from lenient senders
    if kind == "doubleValue":
        return float(raw)
    if kind == "bytesValue":
        return str(raw)
    if kind == "arrayValue":
        return tuple(_json_value(x) for x in (raw or {}).get("values", ()))
    if kind == "kvlistValue":
        return tuple((kv.get("key"), _json_value(kv.get("value"))) for kv in (raw or {}).get("values", ()))
    return None


def _json_attrs(attrs: Any) -> dict[str, AttrValue]:
    if not isinstance(attrs, list):
        return {}
    return {str(kv["key"]): _json_value(kv.get("value")) for kv in attrs if isinstance(kv, dict) and "key" in kv}


def _json_id(raw: Any, size: int, what: str) -> str:
    """A hex id of ``size`` bytes (or none), lower-cased."""
    text = str(raw or "")
    if text and (len(text) != 2 * size or len(bytes.fromhex(text)) != size):
        raise OtlpDecodeError(f"{what} {text[:40]!r} is not {2 * size} hex digits")
    return text.lower()


def _json_time(raw: Any) -> int:
    """Unix nanoseconds: a decimal string in OTLP JSON, a number from lenient senders."""
    if raw is None or raw == "":
        return 0
    if isinstance(raw, bool) or not isinstance(raw, int | str):
        raise OtlpDecodeError(f"a time of {type(raw).__name__} (OTLP JSON sends unix nanoseconds as a string)")
    value = int(raw)
    if not 0 <= value < 2**64:
        raise OtlpDecodeError(f"time {value} is outside 0..2^64-1 nanoseconds")
    return value


def decode_json(body: bytes, budget: Budget | None = None) -> list[Span]:
    budget = budget or Budget()
    count_json(body, budget)
    try:
        req = json.loads(body)
        out: list[Span] = []
        for rs in req.get("resourceSpans") or ():
            resource = _json_attrs((rs.get("resource") or {}).get("attributes"))
            for ss in rs.get("scopeSpans") or ():
                scope = str((ss.get("scope") or {}).get("name", ""))
                for s in ss.get("spans") or ():
                    out.append(Span(_json_id(s.get("traceId"), 16, "trace id"), _json_id(s.get("spanId"), 8, "span id"),
                                    str(s.get("name", "")), _json_time(s.get("startTimeUnixNano")),
                                    _json_time(s.get("endTimeUnixNano")), _json_attrs(s.get("attributes")),
                                    resource, scope, _json_id(s.get("parentSpanId"), 8, "parent span id")))
        budget.check(len(out), 0)
        return out
    except OtlpDecodeError:
        raise
    except (ValueError, TypeError, AttributeError, KeyError, OverflowError, RecursionError) as exc:
        raise OtlpDecodeError(f"not an OTLP JSON ExportTraceServiceRequest: {type(exc).__name__}: {exc}") from None


def media_of(content_type: str | None) -> str:
    """The media type a Content-Type names (protobuf when none is given), lower case, without parameters."""
    return (content_type or PROTOBUF).split(";")[0].strip().lower()


def decode(body: bytes, content_type: str | None, budget: Budget | None = None, *,
           counted: bool = False) -> list[Span]:
    """Spans of one export request; ``content_type`` picks the encoding (protobuf by default).

    OtlpDecodeError when the body is not a request in that encoding, BudgetExceeded (one of them)
    when it holds more than ``budget`` allows — found before the request is built. ``counted``:
    :func:`elements` has checked the body against ``budget`` already (it is not walked again).
    """
    media = media_of(content_type)
    if media == JSON:
        return decode_json(body, budget)
    if media in (PROTOBUF, "application/protobuf", "application/octet-stream"):
        return decode_protobuf(body, budget, counted=counted)
    raise OtlpDecodeError(f"unsupported Content-Type {content_type!r}: send {PROTOBUF} or {JSON}")


# ---- spans → record facts ------------------------------------------------------------------
def _number(v: AttrValue) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v) if math.isfinite(v) and v >= 0 else None


def _measure(span: Span, name: str, v: AttrValue) -> float | None:
    """A measurement the span carries: None when it carries none; ValueError (the span is rejected)
    when it carries one no count or duration can be — not a number, negative, infinite or NaN."""
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ValueError(f"span {span.span_id or '?'}: {name} is {type(v).__name__} {str(v)[:40]!r}, not a number")
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"span {span.span_id or '?'}: {name} = {v!r} is not a finite number ≥ 0")
    return float(v)


def _string(v: AttrValue) -> str | None:
    if v is None or isinstance(v, tuple | bytes):
        return None
    s = str(v).strip()
    return s or None


def is_request(span: Span, mapping: SpanMapping) -> bool:
    return span.name in mapping.span_names


def session_of(span: Span, mapping: SpanMapping) -> str | None:
    return _string(span.attr(mapping.session_attributes)) if mapping.session_attributes else None


def _usable_session(key: str | None) -> str | None:
    """A session key another span may lend a request: one a record could carry (see the
    request's own check in the intake), else none — it would be remembered for every trace."""
    if key is None or len(key) > MAX_SESSION_CHARS or label_value_problem(key) is not None:
        return None
    return key


@dataclass(frozen=True, slots=True)
class TraceFacts:
    """What the other spans of a request's trace say about it (None: no span said)."""

    session_key: str | None = None
    cached_tokens: int | None = None

    def merged(self, newer: TraceFacts) -> TraceFacts:
        """The facts known so far, completed (never overwritten) by a later span's."""
        return TraceFacts(self.session_key if self.session_key is not None else newer.session_key,
                          self.cached_tokens if self.cached_tokens is not None else newer.cached_tokens)


def _tokens(v: AttrValue) -> int | None:
    n = _number(v)
    return int(n) if n is not None and n == int(n) else None


def trace_facts(spans: Iterable[Span], mapping: SpanMapping) -> dict[str, TraceFacts]:
    """Trace id → the session key (any span with a session attribute) and the cached tokens a
    span that is not itself a request reports (a client's span, from the response's usage)."""
    out: dict[str, TraceFacts] = {}
    for s in spans:
        if not s.trace_id:
            continue
        key = _usable_session(session_of(s, mapping))
        cached = None
        if mapping.cached_attributes and not is_request(s, mapping):
            cached = _tokens(s.attr(mapping.cached_attributes))
        if key is None and cached is None:
            continue
        facts = TraceFacts(key, cached)
        out[s.trace_id] = out[s.trace_id].merged(facts) if s.trace_id in out else facts
    return out


def sessions_by_trace(spans: Iterable[Span], mapping: SpanMapping) -> dict[str, str]:
    """Trace id → session key, from any span of the batch that carries a session attribute."""
    return {t: f.session_key for t, f in trace_facts(spans, mapping).items() if f.session_key is not None}


def migration_source(previous: str | None, worker: str, previous_healthy: bool) -> str | None:
    """The worker a keyed session's request left, when it left one that is no longer healthy.

    A follow-up served elsewhere while its previous worker is still healthy is a sticky
    collision (the session table counts it), not a migration; the first request has nowhere
    to come from.
    """
    if previous is None or previous == worker or previous_healthy:
        return None
    return previous


_RECORD_FIELDS = tuple(f.name for f in fields(RequestRecord))
try:
    from exporter.core._records_core import SlotSetter
except ImportError:  # not built: the dataclass's own constructor
    _MAKE_RECORD = None
else:
    _MAKE_RECORD = (SlotSetter(RequestRecord, _RECORD_FIELDS).make
                    if _RECORD_FIELDS[:4] == ("ts", "request_id", "worker", "prompt_tokens") and _RECORD_FIELDS[-1] == "carried"
                    and not hasattr(RequestRecord, "__post_init__") and getattr(RequestRecord, "__slots__", ()) == _RECORD_FIELDS
                    else None)


def record_of(span: Span, mapping: SpanMapping, session_key: str | None = None,
              migrated_from: str | None = None, reports_migrations: bool = False,
              trace_cached: int | None = None) -> RequestRecord:
    """The request record a request span carries; ValueError (with the reason) if it carries none.

    A measurement the span lacks stays missing (never 0). ``reports_migrations``: the producer
    knows whether the session moved, so ``migrated_from`` is carried even when None.
    ``trace_cached``: the cached tokens another span of the trace reported (the span's own win).
    """
    prompt = _measure(span, PROMPT_TOKENS, span.attributes.get(PROMPT_TOKENS))
    if prompt is None:
        raise ValueError(f"span {span.span_id or '?'} ({span.name}) has no {PROMPT_TOKENS}")
    worker = _string(span.attr(mapping.worker_attributes))
    if worker is None:
        raise ValueError(f"span {span.span_id or '?'} has none of the worker attributes "
                         f"{', '.join(mapping.worker_attributes)}")
    if span.end_ns <= 0:
        raise ValueError(f"span {span.span_id or '?'} has no end time")
    values: dict[str, Any] = {
        "model": _string(span.attr(mapping.model_attributes)),
        "cached_tokens": (_measure(span, "cached tokens", span.attr(mapping.cached_attributes))
                          if mapping.cached_attributes else None),
        "output_tokens": _measure(span, COMPLETION_TOKENS, span.attributes.get(COMPLETION_TOKENS)),
        "ttft_s": _measure(span, TTFT, span.attributes.get(TTFT)),
        "queue_s": _measure(span, QUEUE, span.attributes.get(QUEUE)),
        "prefill_s": _measure(span, PREFILL, span.attributes.get(PREFILL)),
        "session_key": session_key,
        "migrated_from": migrated_from,
        "migration_kind": "hard" if migrated_from else None,
        "lora_name": _string(span.attr(mapping.adapter_attributes)) if mapping.adapter_attributes else None,
        "tenant": _string(span.attr(mapping.tenant_attributes)) if mapping.tenant_attributes else None,
    }
    if values["cached_tokens"] is None and mapping.cached_attributes:
        values["cached_tokens"] = trace_cached
    for name in ("cached_tokens", "output_tokens"):
        if values[name] is not None:
            values[name] = int(values[name])
    if values["cached_tokens"] is not None:
        values["cached_tokens"] = min(values["cached_tokens"], int(prompt))
    carried = {k for k, v in values.items() if v is not None}
    if reports_migrations:
        carried.add("migrated_from")
    request_id = _string(span.attributes.get(REQUEST_ID)) or span.span_id
    if _MAKE_RECORD is not None:  # RequestRecord(...) less its __init__'s call: each slot set directly
        return _MAKE_RECORD((span.end_ns / 1e9, request_id, mapping.worker(worker), int(prompt)), values,  # type: ignore[no-any-return]
                            frozenset(carried))
    return RequestRecord(ts=span.end_ns / 1e9, request_id=request_id, worker=mapping.worker(worker),
                         prompt_tokens=int(prompt), carried=frozenset(carried), **values)


def response_body(media: str, rejected: int = 0, message: str = "") -> bytes:
    """An ExportTraceServiceResponse in the request's encoding (partial success when spans were rejected)."""
    if media == JSON:
        payload: dict[str, Any] = {}
        if rejected:
            payload["partialSuccess"] = {"rejectedSpans": str(rejected), "errorMessage": message}
        return json.dumps(payload).encode()
    resp = trace_service_pb2.ExportTraceServiceResponse()
    if rejected:
        resp.partial_success.rejected_spans = rejected
        resp.partial_success.error_message = message
    return resp.SerializeToString()
