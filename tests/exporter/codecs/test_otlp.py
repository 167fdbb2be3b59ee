"""OTLP request spans → request records: pure decoding, the intake's session join and migrations,
and vLLM-shaped spans sent by opentelemetry-sdk's own OTLP/HTTP exporter to the exporter's port."""

from __future__ import annotations

import gzip
import json
import time
from collections.abc import Iterator

import pytest
import requests
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import SpanKind

from exporter.codecs import otlp
from exporter.config import Config, OtlpTraces, WorkerTarget
from exporter.core.health import Health
from exporter.core.state import ClusterState
from exporter.main import Runtime
from exporter.sources.otlp_spans import SpanIntake
from prefixscope.records import RequestRecord

# Exactly the attributes vLLM's OutputProcessor.do_tracing sets (vllm/tracing/utils.py SpanAttributes).
VLLM_ATTRS = {
    "gen_ai.usage.prompt_tokens": 512, "gen_ai.usage.completion_tokens": 16,
    "gen_ai.request.id": "cmpl-1", "gen_ai.request.max_tokens": 16, "gen_ai.request.n": 1,
    "gen_ai.latency.time_in_queue": 0.01, "gen_ai.latency.time_to_first_token": 0.2,
    "gen_ai.latency.e2e": 0.5, "gen_ai.latency.time_in_model_prefill": 0.15,
    "gen_ai.latency.time_in_model_decode": 0.3, "gen_ai.latency.time_in_model_inference": 0.45,
}


class Sink:
    def __init__(self) -> None:
        self.records: list[RequestRecord] = []
        self.signals: list[str] = []

    def ingest_records(self, records, received_at):
        self.records += records

    def signal_seen(self, signal, ts):
        self.signals.append(signal)


def _json_request(spans: list[dict], resource: dict) -> bytes:
    def attrs(d: dict) -> list[dict]:
        out = []
        for k, v in d.items():
            value = ({"intValue": str(v)} if isinstance(v, int) else {"doubleValue": v} if isinstance(v, float)
                     else {"stringValue": v})
            out.append({"key": k, "value": value})
        return out
    return json.dumps({"resourceSpans": [{"resource": {"attributes": attrs(resource)}, "scopeSpans": [{
        "scope": {"name": "vllm.tracing.otel"},
        "spans": [{"traceId": s["trace"], "spanId": s.get("span", "00f067aa0ba902b7"), "name": s.get("name", "llm_request"),
                   "kind": 2, "startTimeUnixNano": "1700000000000000000", "endTimeUnixNano": str(s.get("end", 1700000001000000000)),
                   "attributes": attrs(s["attrs"])} for s in spans]}]}]}).encode()


TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


def test_json_span_becomes_a_record_with_what_it_carries_and_nothing_more() -> None:
    spans = otlp.decode(_json_request([{"trace": TRACE, "attrs": VLLM_ATTRS}], {"service.instance.id": "w0"}),
                        "application/json")
    rec = otlp.record_of(spans[0], otlp.SpanMapping())
    assert (rec.worker, rec.prompt_tokens, rec.request_id, rec.ts) == ("w0", 512, "cmpl-1", 1700000001.0)
    assert (rec.queue_s, rec.prefill_s, rec.ttft_s, rec.output_tokens) == (0.01, 0.15, 0.2, 16)
    assert rec.cached_tokens is None and rec.session_key is None  # vLLM sets neither: missing, not 0
    assert rec.model is None and not rec.reports("migrated_from")


def test_cache_read_attribute_and_worker_url_mapping() -> None:
    attrs = VLLM_ATTRS | {"gen_ai.usage.cache_read.input_tokens": 384}
    spans = otlp.decode(_json_request([{"trace": TRACE, "attrs": attrs}], {"service.instance.id": "10.0.0.5:8000"}),
                        "application/json")
    mapping = otlp.SpanMapping(worker_names={"http://10.0.0.5:8000": "w0"})
    rec = otlp.record_of(spans[0], mapping)
    assert rec.cached_tokens == 384 and rec.worker == "w0"


def test_the_configured_attributes_name_the_adapter_and_the_tenant() -> None:
    attrs = VLLM_ATTRS | {"gen_ai.request.model": "sql-lora"}
    spans = otlp.decode(_json_request([{"trace": TRACE, "attrs": attrs}], {"service.instance.id": "w0",
                                                                          "tenant.id": "acme"}), "application/json")
    rec = otlp.record_of(spans[0], otlp.SpanMapping())
    assert rec.lora_name is None and rec.tenant is None  # not configured: vLLM's model may be the base model
    mapping = otlp.SpanMapping(adapter_attributes=("gen_ai.request.model",), tenant_attributes=("tenant.id",))
    rec = otlp.record_of(spans[0], mapping)
    assert (rec.lora_name, rec.tenant) == ("sql-lora", "acme")


def test_a_request_span_without_prompt_tokens_is_rejected_and_a_bad_body_refused() -> None:
    spans = otlp.decode(_json_request([{"trace": TRACE, "attrs": {"gen_ai.request.id": "x"}}], {"service.name": "w"}),
                        "application/json")
    with pytest.raises(ValueError, match=r"gen_ai\.usage\.prompt_tokens"):
        otlp.record_of(spans[0], otlp.SpanMapping())
    with pytest.raises(otlp.OtlpDecodeError):
        otlp.decode(b"\xff\x00garbage", "application/x-protobuf")
    with pytest.raises(otlp.OtlpDecodeError):
        otlp.decode(b"{}", "text/plain")


SPAN_END_S = 1700000001.0  # when _json_request's spans end: the intakes' clock reads it


def _intake(sink: Sink, healthy: set[str], wait: float = 5.0, clock: list[float] | None = None) -> SpanIntake:
    now = clock or [SPAN_END_S]
    return SpanIntake(otlp.SpanMapping(session_attributes=("gen_ai.conversation.id",)), sink, Health(),
                      is_healthy=lambda w: w in healthy, session_wait_s=wait, clock=lambda: now[0])


def test_session_from_a_later_span_of_the_trace_and_the_wait_that_ends_without_one() -> None:
    sink, clock = Sink(), [SPAN_END_S]
    intake = _intake(sink, {"w0"}, clock=clock)
    intake.ingest(_json_request([{"trace": TRACE, "attrs": VLLM_ATTRS}], {"service.name": "w0"}), "application/json")
    assert sink.records == [] and intake.pending() == 1  # waits for the client's span
    client = {"trace": TRACE, "span": "1111111111111111", "name": "chat", "attrs": {"gen_ai.conversation.id": "s1"}}
    intake.ingest(_json_request([client], {"service.name": "app"}), "application/json")
    assert [r.session_key for r in sink.records] == ["s1"] and sink.records[0].reports("migrated_from")
    other = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
    intake.ingest(_json_request([{"trace": other, "attrs": VLLM_ATTRS}], {"service.name": "w0"}), "application/json")
    clock[0] += 6
    assert intake.flush_due() == 1 and sink.records[-1].session_key is None


@pytest.mark.parametrize("wait", [0.0, 5.0])
def test_every_rejected_span_is_reported_whatever_the_session_settings(wait: float) -> None:
    """A span that can never be a record (no prompt tokens) is rejected in the response of the
    export that carried it, even when request spans wait for their trace's session."""
    sink = Sink()
    intake = _intake(sink, {"w0"}, wait=wait)
    bad = {"trace": TRACE, "span": "2222222222222222", "attrs": {"gen_ai.request.id": "x"}}
    good = {"trace": TRACE, "attrs": VLLM_ATTRS}
    result = intake.ingest(_json_request([bad, good], {"service.name": "w0"}), "application/json")
    assert (result.accepted, result.rejected) == (1, 1)
    assert "gen_ai.usage.prompt_tokens" in result.errors[0]
    assert sum(intake.health.snapshot()[0]["prefixscope_ingest_errors"].values()) == 1
    assert intake.pending() == (1 if wait else 0)  # the good one waits for its session, if configured


def test_a_follow_up_that_left_an_unhealthy_worker_is_a_migration() -> None:
    sink = Sink()
    healthy = {"w0", "w1"}
    intake = _intake(sink, healthy, wait=0.0)
    mapping_attrs = {"gen_ai.conversation.id": "s1"}
    def turn(worker: str, trace: str) -> None:
        intake.ingest(_json_request([{"trace": trace, "attrs": VLLM_ATTRS | mapping_attrs}], {"service.name": worker}),
                      "application/json")
    turn("w0", "1" * 32)
    turn("w1", "2" * 32)  # w0 still healthy: a collision, not a migration
    healthy.discard("w1")
    turn("w0", "3" * 32)  # w1 down: migrated
    assert [r.migrated_from for r in sink.records] == [None, None, "w1"]
    assert sink.records[2].migration_kind == "hard"


def test_trace_facts_take_the_session_and_the_clients_cached_tokens_of_each_trace() -> None:
    mapping = otlp.SpanMapping(session_attributes=("gen_ai.conversation.id",))
    other = "b" * 32
    client = {"trace": TRACE, "span": "1111111111111111", "name": "chat sim-model",
              "attrs": {"gen_ai.conversation.id": "s1", "gen_ai.usage.cache_read.input_tokens": 96}}
    session_only = {"trace": other, "span": "2222222222222222", "name": "chat", "attrs": {"gen_ai.conversation.id": "s2"}}
    engine = {"trace": other, "attrs": VLLM_ATTRS | {"gen_ai.usage.cache_read.input_tokens": 7}}
    spans = otlp.decode(_json_request([client, session_only, engine], {"service.name": "app"}), "application/json")
    facts = otlp.trace_facts(spans, mapping)
    assert facts == {TRACE: otlp.TraceFacts("s1", 96), other: otlp.TraceFacts("s2", None)}  # a request's own count is not the trace's
    assert otlp.sessions_by_trace(spans, mapping) == {TRACE: "s1", other: "s2"}
    assert otlp.TraceFacts("s1").merged(otlp.TraceFacts("s9", 5)) == otlp.TraceFacts("s1", 5)
    vllm = otlp.decode(_json_request([{"trace": TRACE, "attrs": VLLM_ATTRS}], {"service.name": "w0"}),
                       "application/json")[0]
    assert otlp.record_of(vllm, mapping, "s1", trace_cached=96).cached_tokens == 96
    assert otlp.record_of(vllm, mapping, "s1").cached_tokens is None  # no span said: missing, not 0
    own = otlp.decode(_json_request([engine], {"service.name": "w0"}), "application/json")[0]
    assert otlp.record_of(own, mapping, trace_cached=96).cached_tokens == 7  # the engine's own count wins
    # a fractional or negative count is no token count
    odd = {"trace": TRACE, "span": "3333333333333333", "name": "chat", "attrs": {"gen_ai.usage.cache_read.input_tokens": 1.5}}
    assert otlp.trace_facts(otlp.decode(_json_request([odd], {}), "application/json"), mapping) == {}


def test_migration_source_is_a_move_off_an_unhealthy_worker_only() -> None:
    assert otlp.migration_source(None, "w1", False) is None  # the session's first request
    assert otlp.migration_source("w1", "w1", False) is None  # stayed
    assert otlp.migration_source("w0", "w1", True) is None  # left a healthy worker: a collision
    assert otlp.migration_source("w0", "w1", False) == "w0"


def test_the_clients_span_gives_the_engines_span_its_session_and_cached_tokens() -> None:
    sink = Sink()
    intake = _intake(sink, {"w0"})
    intake.ingest(_json_request([{"trace": TRACE, "attrs": VLLM_ATTRS}], {"service.instance.id": "w0"}),
                  "application/json")
    assert sink.records == []
    client = {"trace": TRACE, "span": "1111111111111111", "name": "chat sim-model",
              "attrs": {"gen_ai.conversation.id": "s1", "gen_ai.usage.cache_read.input_tokens": 384}}
    intake.ingest(_json_request([client], {"service.name": "app"}), "application/json")
    [rec] = sink.records
    assert (rec.session_key, rec.cached_tokens, rec.prompt_tokens, rec.worker) == ("s1", 384, 512, "w0")


def test_gzip_and_limits() -> None:
    sink = Sink()
    intake = _intake(sink, set(), wait=0.0)
    body = _json_request([{"trace": TRACE, "attrs": VLLM_ATTRS}], {"service.name": "w0"})
    assert intake.ingest(gzip.compress(body), "application/json", "gzip").accepted == 1
    intake.max_body_bytes = 10
    with pytest.raises(ValueError, match="exceeds the limit"):
        intake.ingest(body, "application/json")


# ---- the real SDK exporter against the exporter's port ---------------------------------------
@pytest.fixture
def runtime() -> Iterator[Runtime]:
    cfg = Config(listen_address="127.0.0.1:0", workers=(WorkerTarget("w0", "http://127.0.0.1:1/metrics"),),
                 otlp=OtlpTraces(session_wait=0.2), scrape_interval=60.0, scrape_timeout=1.0)
    rt = Runtime.build(cfg)
    rt.server.start()
    assert rt.spans is not None
    rt.spans.start()
    yield rt
    rt.spans.close()
    rt.server.stop()


def _provider(url: str, worker: str, **exporter_kw) -> TracerProvider:
    provider = TracerProvider(resource=Resource.create({"service.name": "vllm", "service.instance.id": worker,
                                                        "vllm.instrumenting_module_name": "vllm.llm_engine"}))
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=f"{url}/v1/traces", **exporter_kw)))
    return provider


@pytest.mark.parametrize("compression", [None, "gzip"])
def test_vllm_spans_through_the_sdk_exporter_reach_the_state(runtime: Runtime, compression: str | None) -> None:
    from opentelemetry.exporter.otlp.proto.http import Compression
    kw = {"compression": Compression.Gzip} if compression else {}
    provider = _provider(runtime.url, "127.0.0.1:1", **kw)  # the worker's host:port, as a fleet would name it
    tracer = provider.get_tracer("vllm.tracing.otel")
    start = time.time_ns()
    for i in range(3):
        span = tracer.start_span("llm_request", kind=SpanKind.SERVER, start_time=start)
        span.set_attributes(VLLM_ATTRS | {"gen_ai.request.id": f"cmpl-{i}",
                                          "gen_ai.usage.cache_read.input_tokens": 256})
        span.end(end_time=start + 500_000_000)
    provider.shutdown()
    st: ClusterState = runtime.state
    assert st.store.window_counter("prefixscope_request_prompt_tokens") == 3 * 512
    assert st.store.window_counter("prefixscope_reuse_achieved_tokens") == 3 * 256
    assert st.signals()["otlp_spans"] and st.signals()["prefill_timing"] and st.signals()["cached_tokens"]
    assert "w0" in st.worker_pool.workers  # host:port of the configured worker's metrics_url


def test_traces_route_answers_in_the_request_encoding(runtime: Runtime) -> None:
    body = _json_request([{"trace": TRACE, "attrs": {"gen_ai.request.id": "x"}}], {"service.name": "w0"})
    r = requests.post(f"{runtime.url}/v1/traces", data=body, headers={"Content-Type": "application/json"}, timeout=5)
    assert r.status_code == 200 and r.json()["partialSuccess"]["rejectedSpans"] == "1"
    r = requests.post(f"{runtime.url}/v1/traces", data=b"\xff\xff", headers={"Content-Type": "application/x-protobuf"},
                      timeout=5)
    assert r.status_code == 400
    assert requests.get(f"{runtime.url}/v1/traces", timeout=5).status_code == 405
