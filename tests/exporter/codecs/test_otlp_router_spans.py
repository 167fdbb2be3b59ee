"""What the real sglang-router 0.3.2 exports with ``--enable-trace`` (captured by
tests/fixtures/make_router_spans.py): one root ``http_request`` span per HTTP request, the whole
request's time, and nothing that times its worker selection — so nothing for ``walk_latency``.
The exporter skips these spans (they are not requests it maps), rejecting and counting nothing."""

from __future__ import annotations

import json
from pathlib import Path

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from exporter.codecs import otlp
from exporter.core.health import Health
from exporter.sources.otlp_spans import SpanIntake
from prefixscope.records import RequestRecord

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
BODY = (FIXTURES / "sglang_router_spans.binpb").read_bytes()
CAPTURE = json.loads((FIXTURES / "sglang_router_spans.json").read_text())


class Sink:
    def __init__(self) -> None:
        self.records: list[RequestRecord] = []
        self.signals: list[str] = []

    def ingest_records(self, records: list[RequestRecord], received_at: float) -> None:
        self.records += records

    def signal_seen(self, signal: str, ts: float) -> None:
        self.signals.append(signal)


def test_one_root_http_request_span_per_request_timing_the_whole_request() -> None:
    spans = otlp.decode(BODY, otlp.PROTOBUF)
    assert {s.name for s in spans} == {"http_request"}  # no span of its own for the selection step
    assert {(s.scope, s.resource["service.name"]) for s in spans} == {("smg", "smg")}
    assert all(s.parent_span_id == "" for s in spans)  # a root: the client's traceparent is not continued
    by_id = {s.attributes["request_id"]: s for s in spans}
    for sent in CAPTURE["requests"]:
        span = by_id[sent["x_request_id"]]
        assert span.attributes["uri"] == "/v1/completions" and span.attributes["status_code"] == "200"
        # the router's `latency` (µs) is the span itself: the whole request, the worker's time included
        assert abs(int(str(span.attributes["latency"])) - (span.end_ns - span.start_ns) / 1000) < 100
        # the worker receives the router's span as its parent, not the client's
        _, trace, parent, _ = sent["worker_received_traceparent"].split("-")
        assert (trace, parent) == (span.trace_id, span.span_id)
        if sent["client_traceparent"]:
            assert sent["client_traceparent"].split("-")[1] not in {s.trace_id for s in spans}


def test_the_span_events_name_the_chosen_worker_and_nothing_times_the_choice() -> None:
    req = trace_service_pb2.ExportTraceServiceRequest.FromString(BODY)
    by_request = {}
    for rs in req.resource_spans:
        for ss in rs.scope_spans:
            for s in ss.spans:
                attrs = {a.key: a.value.string_value for a in s.attributes}
                by_request[attrs["request_id"]] = s
    for sent in CAPTURE["requests"]:
        span = by_request[sent["x_request_id"]]
        assert [e.name for e in span.events] == ["Sending request", "Received concurrent requests"]
        url = {a.key: a.value.string_value for a in span.events[0].attributes}["url"]
        assert url == sent["worker_url"]


def test_the_router_spans_are_skipped_not_rejected() -> None:
    sink, health = Sink(), Health()
    intake = SpanIntake(otlp.SpanMapping(session_attributes=("gen_ai.conversation.id",)), sink, health)
    result = intake.ingest(BODY, otlp.PROTOBUF)
    assert (result.accepted, result.rejected, intake.pending()) == (0, 0, 0)
    assert sink.records == [] and sink.signals == []
    assert health.total("prefixscope_ingest_errors") is None
