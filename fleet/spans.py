"""Simulated workers export request spans the way vLLM does: OTLP/HTTP protobuf, one ``llm_request``
span per finished request, made by opentelemetry-sdk's own tracer and OTLP exporter.

Span name, kind, tracer scope, resource and attribute names are vLLM's (vllm/tracing/{otel,utils}.py,
v1/engine/output_processor.py ``do_tracing``): the span starts at arrival, its parent comes from the
request's ``traceparent``, and it carries ``gen_ai.latency.*``, ``gen_ai.usage.prompt_tokens``/
``completion_tokens`` and ``gen_ai.request.id``. vLLM sets no cached-token attribute (up to
v0.33); ``cache_read=True`` adds ``gen_ai.usage.cache_read.input_tokens`` as the open vLLM proposals
would (vllm-project/vllm#41788), to show what that attribute turns on.

Use a :class:`SpanExport` as (or chained into) a ``WorkerServer``'s ``on_request`` callback.
"""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry import propagate
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.trace import SpanKind

from fleet.engine import EngineResult

SPAN_NAME = "llm_request"
SCOPE = "vllm.tracing.otel"
NS = 1_000_000_000


class SpanExport:
    """One worker's span exporter: ``__call__(result, headers, path)`` exports the request's span."""

    def __init__(self, endpoint: str, instance_id: str, *, cache_read: bool = False, batch: bool = True,
                 service_name: str = "vllm") -> None:
        self.cache_read = cache_read
        self.provider = TracerProvider(resource=Resource.create({
            "service.name": service_name, "service.instance.id": instance_id,
            "vllm.instrumenting_module_name": "vllm.llm_engine"}))
        exporter = OTLPSpanExporter(endpoint=endpoint)  # http/protobuf, as vLLM's exporter sends it
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
