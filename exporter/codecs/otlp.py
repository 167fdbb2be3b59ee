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
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.common.v1 import common_pb2

from prefixscope.records import RequestRecord

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


class OtlpDecodeError(ValueError):
    """The body is not an OTLP ExportTraceServiceRequest in the encoding it claims."""


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

    def worker(self, value: str) -> str:
        key = value.strip().rstrip("/").lower()
        for candidate in (key, f"http://{key}", f"https://{key}"):
            if candidate in self.worker_names:
                return self.worker_names[candidate]
        return value


# ---- decoding ------------------------------------------------------------------------------
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


def decode_protobuf(body: bytes) -> list[Span]:
    try:
        req = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
    except DecodeError as exc:
        raise OtlpDecodeError(f"not an OTLP protobuf ExportTraceServiceRequest: {exc}") from None
    out: list[Span] = []
    for rs in req.resource_spans:
        resource = _pb_attrs(rs.resource.attributes)
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(Span(s.trace_id.hex(), s.span_id.hex(), s.name, s.start_time_unix_nano,
                                s.end_time_unix_nano, _pb_attrs(s.attributes), resource, ss.scope.name,
                                s.parent_span_id.hex()))
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
    return {kv["key"]: _json_value(kv.get("value")) for kv in attrs if isinstance(kv, dict) and "key" in kv}


def decode_json(body: bytes) -> list[Span]:
    try:
        req = json.loads(body)
        out: list[Span] = []
        for rs in req.get("resourceSpans") or ():
            resource = _json_attrs((rs.get("resource") or {}).get("attributes"))
            for ss in rs.get("scopeSpans") or ():
                scope = str((ss.get("scope") or {}).get("name", ""))
                for s in ss.get("spans") or ():
                    out.append(Span(str(s.get("traceId", "")).lower(), str(s.get("spanId", "")).lower(),
                                    str(s.get("name", "")), int(s.get("startTimeUnixNano") or 0),
                                    int(s.get("endTimeUnixNano") or 0), _json_attrs(s.get("attributes")),
                                    resource, scope, str(s.get("parentSpanId", "")).lower()))
        return out
    except (ValueError, TypeError, AttributeError, KeyError) as exc:
        raise OtlpDecodeError(f"not an OTLP JSON ExportTraceServiceRequest: {exc}") from None


def decode(body: bytes, content_type: str | None) -> list[Span]:
    """Spans of one export request; ``content_type`` picks the encoding (protobuf by default)."""
    media = (content_type or PROTOBUF).split(";")[0].strip().lower()
    if media == JSON:
        return decode_json(body)
    if media in (PROTOBUF, "application/protobuf", "application/octet-stream"):
        return decode_protobuf(body)
    raise OtlpDecodeError(f"unsupported Content-Type {content_type!r}: send {PROTOBUF} or {JSON}")


# ---- spans → record facts ------------------------------------------------------------------
def _number(v: AttrValue) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v) if math.isfinite(v) and v >= 0 else None


def _string(v: AttrValue) -> str | None:
    if v is None or isinstance(v, tuple | bytes):
        return None
    s = str(v).strip()
    return s or None


def is_request(span: Span, mapping: SpanMapping) -> bool:
    return span.name in mapping.span_names


def session_of(span: Span, mapping: SpanMapping) -> str | None:
    return _string(span.attr(mapping.session_attributes)) if mapping.session_attributes else None


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
        key = session_of(s, mapping)
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


def record_of(span: Span, mapping: SpanMapping, session_key: str | None = None,
              migrated_from: str | None = None, reports_migrations: bool = False,
              trace_cached: int | None = None) -> RequestRecord:
    """The request record a request span carries; ValueError (with the reason) if it carries none.

    A measurement the span lacks stays missing (never 0). ``reports_migrations``: the producer
    knows whether the session moved, so ``migrated_from`` is carried even when None.
    ``trace_cached``: the cached tokens another span of the trace reported (the span's own win).
    """
    prompt = _number(span.attributes.get(PROMPT_TOKENS))
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
        "cached_tokens": _number(span.attr(mapping.cached_attributes)) if mapping.cached_attributes else None,
        "output_tokens": _number(span.attributes.get(COMPLETION_TOKENS)),
        "ttft_s": _number(span.attributes.get(TTFT)),
        "queue_s": _number(span.attributes.get(QUEUE)),
        "prefill_s": _number(span.attributes.get(PREFILL)),
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
