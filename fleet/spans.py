"""Simulated workers export request spans the way vLLM does: one ``llm_request`` span per finished
request, made by opentelemetry-sdk's own tracer and OTLP exporter — OTLP/HTTP protobuf, or OTLP/gRPC
with ``protocol="grpc"`` (vLLM's default, ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``).

Span name, kind, tracer scope, resource and attribute names are vLLM's (vllm/tracing/{otel,utils}.py,
v1/engine/output_processor.py ``do_tracing``): the span starts at arrival, its parent comes from the
request's ``traceparent``, and it carries ``gen_ai.latency.*``, ``gen_ai.usage.prompt_tokens``/
``completion_tokens`` and ``gen_ai.request.id``. vLLM sets no cached-token attribute (up to
v0.33); ``cache_read=True`` adds ``gen_ai.usage.cache_read.input_tokens`` as the open vLLM proposals
would (vllm-project/vllm#41788), to show what that attribute turns on.

Use a :class:`SpanExport` as (or chained into) a ``WorkerServer``'s ``on_request`` callback, or a
:class:`FleetSpans` as a ``WorkerFleet``'s (one exporter per worker, as each vLLM process has its own).

:class:`GenAiClient` is the other end: an application calling the router with OpenTelemetry's
GenAI client conventions — a CLIENT span ``chat MODEL`` whose ``traceparent`` goes with the
request (both routers forward it, so vLLM's span becomes its child), carrying the conversation
(``gen_ai.conversation.id``) and, from the response's ``usage``, ``gen_ai.usage.input_tokens``,
``.output_tokens`` and ``.cache_read.input_tokens`` (``prompt_tokens_details.cached_tokens``,
which vLLM reports with ``--enable-prompt-tokens-details``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from opentelemetry import propagate
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace import Span, SpanKind

from fleet.engine import EngineResult

SPAN_NAME = "llm_request"
SCOPE = "vllm.tracing.otel"
NS = 1_000_000_000
PROTOCOLS = ("http/protobuf", "grpc")  # vLLM's two (tracing/otel.py get_span_exporter)


def span_exporter(endpoint: str, protocol: str, headers: Mapping[str, str] | None) -> SpanExporter:
    """The SDK's exporter for ``protocol``: ``endpoint`` is ``http://HOST:PORT/v1/traces`` for
    http/protobuf, ``http://HOST:PORT`` (plaintext) for grpc."""
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcSpanExporter,
        )
        return GrpcSpanExporter(endpoint=endpoint, headers={k.lower(): v for k, v in (headers or {}).items()})
    if protocol != "http/protobuf":
        raise ValueError(f"unknown OTLP protocol {protocol!r}; choose one of {', '.join(PROTOCOLS)}")
    return OTLPSpanExporter(endpoint=endpoint, headers=dict(headers or {}))


class SpanExport:
    """One worker's span exporter: ``__call__(result, headers, path)`` exports the request's span."""

    def __init__(self, endpoint: str, instance_id: str, *, cache_read: bool = False, batch: bool = True,
                 service_name: str = "vllm", headers: Mapping[str, str] | None = None,
                 protocol: str = "http/protobuf") -> None:
        self.cache_read = cache_read
        self.provider = TracerProvider(resource=Resource.create({
            "service.name": service_name, "service.instance.id": instance_id,
            "vllm.instrumenting_module_name": "vllm.llm_engine"}))
        # as vLLM's exporter sends it; ``headers`` as OTEL_EXPORTER_OTLP_TRACES_HEADERS
        exporter = span_exporter(endpoint, protocol, headers)
        self.provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=200) if batch
                                         else SimpleSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer(SCOPE)

    def attributes(self, r: EngineResult) -> dict[str, float | int | str]:
        attrs: dict[str, float | int | str] = {
            "gen_ai.request.id": r.request_id,
            "gen_ai.usage.prompt_tokens": r.prompt_tokens,
            "gen_ai.usage.completion_tokens": r.output_tokens,
            "gen_ai.latency.time_in_queue": r.queue_s,
            "gen_ai.latency.time_to_first_token": r.ttft_s,
            "gen_ai.latency.e2e": r.e2e_s,
            "gen_ai.latency.time_in_model_prefill": r.prefill_s,
            "gen_ai.latency.time_in_model_decode": r.decode_s,
            "gen_ai.latency.time_in_model_inference": r.prefill_s + r.decode_s,
        }
        if self.cache_read:
            attrs["gen_ai.usage.cache_read.input_tokens"] = r.cached_tokens
        return attrs

    def __call__(self, r: EngineResult, headers: Mapping[str, str], _path: str) -> None:
        ctx = propagate.extract(dict(headers))
        start = int(r.arrival * NS)
        span = self.tracer.start_span(SPAN_NAME, context=ctx, kind=SpanKind.SERVER, start_time=start)
        span.set_attributes(self.attributes(r))
        span.end(end_time=start + int(r.e2e_s * NS))

    def close(self) -> None:
        self.provider.shutdown()


class FleetSpans:
    """A fleet's ``on_request``: each worker's requests go out through that worker's own exporter
    (resource ``service.instance.id`` = the worker's name), made on its first request."""

    def __init__(self, endpoint: str, *, cache_read: bool = False, batch: bool = True,
                 headers: Mapping[str, str] | None = None, protocol: str = "http/protobuf") -> None:
        self.endpoint, self.cache_read, self.batch, self.headers = endpoint, cache_read, batch, headers
        self.protocol = protocol
        self._lock = threading.Lock()
        self.exports: dict[str, SpanExport] = {}

    def export_for(self, worker: str) -> SpanExport:
        with self._lock:
            if worker not in self.exports:
                self.exports[worker] = SpanExport(self.endpoint, worker, cache_read=self.cache_read, batch=self.batch,
                                                  headers=self.headers, protocol=self.protocol)
            return self.exports[worker]

    def __call__(self, r: EngineResult, headers: Mapping[str, str], path: str) -> None:
        self.export_for(r.worker)(r, headers, path)

    def flush(self) -> None:
        for e in list(self.exports.values()):
            e.provider.force_flush()

    def close(self) -> None:
        for e in list(self.exports.values()):
            e.close()


class GenAiClient:
    """An application's GenAI client spans (OpenTelemetry GenAI semantic conventions), exported
    over OTLP/HTTP protobuf like any instrumented service."""

    def __init__(self, endpoint: str, service_name: str = "chat-app", *, batch: bool = True,
                 headers: Mapping[str, str] | None = None) -> None:
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        exporter = OTLPSpanExporter(endpoint=endpoint, headers=dict(headers or {}))
        self.provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=200) if batch
                                         else SimpleSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("genai.client")

    @contextmanager
    def call(self, model: str, conversation: str | None) -> Iterator[tuple[Span, dict[str, str]]]:
        """A CLIENT span around one call → (the span, headers carrying its ``traceparent``)."""
        attrs: dict[str, str] = {"gen_ai.operation.name": "chat", "gen_ai.request.model": model}
        if conversation is not None:
            attrs["gen_ai.conversation.id"] = conversation
        with self.tracer.start_as_current_span(f"chat {model}", kind=SpanKind.CLIENT, attributes=attrs) as span:
            headers: dict[str, str] = {}
            propagate.inject(headers)
            yield span, headers

    @staticmethod
    def record_usage(span: Span, usage: Mapping[str, Any]) -> None:
        """The response's OpenAI ``usage`` on the span; a count the response lacks is left out."""
        for attr, value in (("gen_ai.usage.input_tokens", usage.get("prompt_tokens")),
                            ("gen_ai.usage.output_tokens", usage.get("completion_tokens")),
                            ("gen_ai.usage.cache_read.input_tokens",
                             (usage.get("prompt_tokens_details") or {}).get("cached_tokens"))):
            if isinstance(value, int) and not isinstance(value, bool):
                span.set_attribute(attr, value)

    def flush(self) -> None:
        self.provider.force_flush()

    def close(self) -> None:
        self.provider.shutdown()
