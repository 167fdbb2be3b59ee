"""OTLP span intake: vLLM ``llm_request`` spans through ``SpanIntake.ingest`` to the state, per core.

An export request is what a vLLM process's batch span processor sends: one resource (the
worker's ``service.name``/``service.instance.id``), the ``vllm.tracing.otel`` scope and
``SPANS`` request spans, each with vLLM's attributes (request id, prompt and completion tokens,
time to first token, queue and prefill times, the model). The intake decodes the protobuf body,
checks each span's record as a line would be checked and hands the records to a real
``ClusterState``. The row is request spans per second of CPU (best of ``REPEATS`` runs); the
baseline, in the same run, is protobuf's own parse of the same bodies
(``ExportTraceServiceRequest.FromString``), the least any intake must do. Target: ≥ 50 k spans/s.
A second row sets it against the same intake with every compiled step of the span path off (the
span loop, the record's slots, the records check's struct, the state's per-record core: their
Python references), on a state of its own, in the same run.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Iterator
from typing import Any

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

import exporter.core.state as state_module
from exporter.bootstrap import bootstrap
from exporter.codecs import otlp
from exporter.core import record_slice
from exporter.sources import records
from exporter.sources.otlp_spans import SpanIntake

TARGET_SPANS_S = 50_000.0
SPANS = 512  # vLLM's batch span processor exports up to 512 spans a request
BODIES = 8
WORKERS = 16
REPEATS = 5


def _kv(key: str, value: object) -> common_pb2.KeyValue:
    v = common_pb2.AnyValue()
    if isinstance(value, str):
        v.string_value = value
    elif isinstance(value, int):
        v.int_value = value
    else:
        v.double_value = float(value)  # type: ignore[arg-type]
    return common_pb2.KeyValue(key=key, value=v)


def export_body(rng: random.Random, worker: str, now: float) -> bytes:
    request = trace_service_pb2.ExportTraceServiceRequest()
    rs = request.resource_spans.add()
    rs.resource.attributes.extend([_kv("service.name", "vllm"), _kv("service.instance.id", worker)])
    ss = rs.scope_spans.add()
    ss.scope.name = "vllm.tracing.otel"
    for _ in range(SPANS):
        start = int((now - rng.uniform(0.5, 3.0)) * 1e9)
        span = trace_pb2.Span(trace_id=rng.randbytes(16), span_id=rng.randbytes(8), name=otlp.VLLM_SPAN,
                              kind=trace_pb2.Span.SPAN_KIND_SERVER, start_time_unix_nano=start,
                              end_time_unix_nano=start + int(rng.uniform(0.2, 2.0) * 1e9))
        span.attributes.extend([
            _kv(otlp.REQUEST_ID, f"cmpl-{rng.getrandbits(64):016x}"),
            _kv(otlp.PROMPT_TOKENS, rng.randrange(100, 8000)), _kv(otlp.COMPLETION_TOKENS, rng.randrange(1, 500)),
            _kv(otlp.TTFT, rng.uniform(0.01, 0.5)), _kv(otlp.QUEUE, rng.uniform(0.0, 0.05)),
            _kv(otlp.PREFILL, rng.uniform(0.005, 0.3)), _kv(otlp.RESPONSE_MODEL, "meta-llama/Llama-3.1-8B-Instruct"),
            _kv("gen_ai.request.max_tokens", 512), _kv("gen_ai.request.temperature", 0.7),
            _kv("gen_ai.request.top_p", 1.0), _kv("gen_ai.request.n", 1),
            _kv("gen_ai.latency.time_in_scheduler", rng.uniform(0.0, 0.05)),
            _kv("gen_ai.latency.time_in_model_forward", rng.uniform(0.1, 1.0)),
            _kv("gen_ai.latency.time_in_model_decode", rng.uniform(0.1, 1.0)),
            _kv("gen_ai.latency.time_in_model_inference", rng.uniform(0.1, 2.0)),
            _kv("gen_ai.latency.e2e", rng.uniform(0.2, 2.0))])
        ss.spans.append(span)
    return request.SerializeToString()


def _best(fn: Any) -> float:
    best = float("inf")
    for _ in range(REPEATS):
        t0 = time.process_time()
        fn()
        best = min(best, time.process_time() - t0)
    return best


@contextlib.contextmanager
def _references() -> Iterator[None]:
    """The span path with its Python references in place of the compiled steps."""
    saved = otlp._SPANS_OF, otlp._MAKE_RECORD, records.RECORD_OK, state_module.apply_records
    otlp._SPANS_OF = otlp._MAKE_RECORD = records.RECORD_OK = None
    state_module.apply_records = record_slice.reference_apply_records
    try:
        yield
    finally:
        otlp._SPANS_OF, otlp._MAKE_RECORD, records.RECORD_OK, state_module.apply_records = saved


def run() -> Iterator[dict[str, Any]]:
    rng = random.Random(5)
    now = time.time()
    bodies = [export_body(rng, f"w{i % WORKERS:03d}", now) for i in range(BODIES)]
    spans = SPANS * BODIES

    def ingester() -> Any:
        parts = bootstrap()
        intake = SpanIntake(otlp.SpanMapping(), parts.state, parts.health)

        def ingest() -> None:
            for body in bodies:
                result = intake.ingest(body, otlp.PROTOBUF)
                if result.rejected:
                    raise RuntimeError(f"{result.rejected} spans rejected: {result.errors[:3]}")

        ingest()  # the workers join the state
        return ingest

    def bare() -> None:
        for body in bodies:
            trace_service_pb2.ExportTraceServiceRequest.FromString(body)

    base = spans / _best(bare)
    ours = spans / _best(ingester())
    with _references():
        reference = spans / _best(ingester())
    yield {"name": f"OTLP request spans/s per core: protobuf export of {SPANS} vLLM spans through the intake "
                   "to the state (CPU, best of 5)",
           "value": ours, "baseline": base, "ratio": base / ours, "target": f"≥ {TARGET_SPANS_S:,.0f}/s",
           "ok": ours >= TARGET_SPANS_S}
    yield {"name": "OTLP request spans/s per core, compiled span path against its Python references (same run)",
           "value": ours, "baseline": reference, "ratio": ours / reference, "target": "information", "ok": True}


if __name__ == "__main__":
    for row in run():
        print(row)
