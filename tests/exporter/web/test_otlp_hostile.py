"""Hostile OTLP against a running exporter (HTTP ``/v1/traces`` and gRPC ``Export`` on 127.0.0.1).

Each case broke the trace receivers before: a span whose model is a lone surrogate made every
scrape answer 500 until the label went idle; tokens of 1.7e308 made a counter +Inf for good; a
1 MB model name grew /metrics by megabytes; 8 MB of empty spans (8 KB gzipped) built 4 M spans
and took a gigabyte and a half; a span ten years ahead was taken; bodies that tripped the
decoder answered 500 uncounted; four gRPC calls that never sent their message starved every
other Export.
"""

from __future__ import annotations

import gzip
import json
import re
import resource
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import grpc
import pytest
import requests
from google.protobuf.internal.encoder import _VarintBytes
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from exporter.config import Config, HttpRecords, OtlpTraces, Web
from exporter.main import Runtime
from exporter.web.otlp_grpc import PATH

TOKEN = "t0ken"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


@contextmanager
def running(grpc_receiver: bool = False, read_timeout: float = 10.0) -> Iterator[Runtime]:
    cfg = Config(listen_address="127.0.0.1:0", scrape_interval=60.0, scrape_timeout=1.0,
                 otlp=OtlpTraces(session_wait=0.0, grpc_listen_address="127.0.0.1:0" if grpc_receiver else None),
                 http_records=HttpRecords(bearer_token=TOKEN), web=Web(read_timeout=read_timeout))
    rt = Runtime.build(cfg).start()
    try:
        yield rt
    finally:
        rt.stop()


def attrs(d: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for k, v in d.items():
        if isinstance(v, bool):
            value: dict[str, Any] = {"boolValue": v}
        elif isinstance(v, int):
            value = {"intValue": str(v)}
        elif isinstance(v, float) or v in ("Infinity", "NaN"):
            value = {"doubleValue": v}
        else:
            value = {"stringValue": v}
        out.append({"key": k, "value": value})
    return out


def json_body(span_attrs: dict[str, Any], end_s: float | None = None, span: str = "00f067aa0ba902b7") -> bytes:
    end = int((end_s if end_s is not None else time.time()) * 1e9)
    return json.dumps({"resourceSpans": [{"resource": {"attributes": attrs({"service.instance.id": "w0"})},
                                          "scopeSpans": [{"spans": [{
                                              "traceId": TRACE, "spanId": span, "name": "llm_request",
                                              "startTimeUnixNano": str(end - 10**9), "endTimeUnixNano": str(end),
                                              "attributes": attrs(span_attrs)}]}]}]}).encode()


def post(rt: Runtime, body: bytes, ctype: str = "application/json", **headers: str) -> requests.Response:
    return requests.post(f"{rt.url}/v1/traces", data=body, timeout=30,
                         headers={"Content-Type": ctype, **AUTH, **headers})


def scrape(rt: Runtime) -> str:
    r = requests.get(f"{rt.url}/metrics", timeout=10)
    assert r.status_code == 200, r.text[:300]
    return r.text


def otlp_errors(text: str, kind: str) -> float:
    m = re.search(rf'^prefixscope_ingest_errors_total\{{kind="{kind}",source="otlp"\}} (\S+)', text, re.M)
    return float(m.group(1)) if m else 0.0


def prompt_tokens(text: str) -> float:
    return sum(float(v) for v in re.findall(r"^prefixscope_request_prompt_tokens_total\{[^}]*\} (\S+)", text, re.M))


GOOD = {"gen_ai.usage.prompt_tokens": 100, "gen_ai.response.model": "m"}


# ---- values ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("span_attrs", "kind"), [
    ({"gen_ai.usage.prompt_tokens": 64, "gen_ai.response.model": "\ud800"}, "value"),  # the poison span
    ({"gen_ai.usage.prompt_tokens": 64, "gen_ai.response.model": "m" * (1 << 20)}, "schema"),  # 1 MB model
    ({"gen_ai.usage.prompt_tokens": 1.7e308}, "value"),
    ({"gen_ai.usage.prompt_tokens": "Infinity"}, "span"),
    ({"gen_ai.usage.prompt_tokens": 64, "gen_ai.latency.time_to_first_token": "NaN"}, "span"),
    ({"gen_ai.usage.prompt_tokens": 64, "gen_ai.latency.time_in_queue": 1e300}, "value"),
    ({"gen_ai.usage.prompt_tokens": 64, "gen_ai.usage.completion_tokens": -5}, "span"),
])
def test_a_span_no_record_could_carry_is_rejected_and_metrics_stay_correct(span_attrs: dict[str, Any],
                                                                             kind: str) -> None:
    with running() as rt:
        before = len(scrape(rt))
        for _ in range(2):  # twice: a sum of two 1.7e308 is +Inf
            r = post(rt, json_body(span_attrs))
            assert r.status_code == 200 and r.json()["partialSuccess"]["rejectedSpans"] == "1", r.text[:300]
        assert post(rt, json_body(GOOD, span="1111111111111111")).json() == {}
        text = scrape(rt)
        assert otlp_errors(text, kind) == 2
        assert prompt_tokens(text) == 100  # the good span alone, finite
        assert "\\ud800" not in text and "mmmmmmmmmm" * 30 not in text
        assert len(text) - before < 20_000  # the good span's series, not a megabyte of label


def test_a_span_ending_beyond_the_clock_tolerance_is_rejected_and_the_window_keeps_moving() -> None:
    with running() as rt:
        ahead = time.time() + 10 * 365 * 86400
        r = post(rt, json_body(GOOD, end_s=ahead))
        assert r.json()["partialSuccess"]["rejectedSpans"] == "1"
        assert "ahead of the exporter's clock" in r.json()["partialSuccess"]["errorMessage"]
        post(rt, json_body(GOOD, span="1111111111111111"))
        assert otlp_errors(scrape(rt), "timestamp") == 1
        assert rt.state.store.window_counter("prefixscope_request_prompt_tokens") == 100


# ---- bodies that trip the decoder -------------------------------------------------------------------
def _pb(spans: bytes) -> bytes:
    scope = b"\x12" + _VarintBytes(len(spans)) + spans
    return b"\x0a" + _VarintBytes(len(scope)) + scope


HOSTILE_BODIES = [
    ("application/json", b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"endTimeUnixNano": 1e400}]}]}]}'),
    ("application/json", b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"endTimeUnixNano": "-1"}]}]}]}'),
    ("application/json", b'{"resourceSpans": [{"scopeSpans": [{"spans": [7, "x", null]}]}]}'),
    ("application/json", b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "' + b"ab" * 5000 + b'"}]}]}]}'),
    ("application/json", b'{"resourceSpans": [{"resource": {"attributes": [{"key": {}, "value": 1}]}}]}'),
    ("application/json", b"[" * 100_000 + b"]" * 100_000),
    ("application/json", b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"attributes": [{"key": "a", "value": '
     + b'{"arrayValue": {"values": ' + b"[{" * 3000 + b"}]" * 3000 + b"}}}]}]}]}]}"),
    ("application/json", b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"attributes": [{"key": "a", "value": '
     + b'{"intValue": "' + b"9" * 5000 + b'"}}]}]}]}]}'),
    ("application/json", b'["resourceSpans"]'),
    ("application/x-protobuf", _pb(b"\x0a\x03abc")),  # a 3-byte trace id
    ("application/x-protobuf", _pb(b"\x12\x00") + b"\x0a\xff\xff\xff\xff\x0f"),  # a field past the end
    ("application/x-protobuf", b"\x0b\x0c"),  # a group
]


@pytest.mark.parametrize(("ctype", "body"), HOSTILE_BODIES, ids=range(len(HOSTILE_BODIES)))
def test_a_body_that_trips_the_decoder_is_a_counted_400_never_a_500(ctype: str, body: bytes) -> None:
    with running() as rt:
        r = post(rt, body, ctype)
        assert r.status_code in (200, 400), r.text[:300]
        text = scrape(rt)
        if r.status_code == 400:
            assert otlp_errors(text, "decode") == 1
        else:  # taken as a request whose spans are not requests, or rejected one by one
            assert not re.search(r'kind="decode",source="otlp"', text)


def test_a_gzip_bomb_of_empty_spans_is_refused_before_it_is_built() -> None:
    body = gzip.compress(_pb(b"\x12\x00" * 4_000_000))  # 8 MB of empty spans, ~8 KB on the wire
    assert len(body) < 20_000
    with running() as rt:
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        r = post(rt, body, "application/x-protobuf", **{"Content-Encoding": "gzip"})
        assert r.status_code == 413 and "spans" in r.json()["error"]
        grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
        assert grown_mb < 100, grown_mb  # the 8 MB decompressed, not the 675 MB of 4 M built spans
        text = scrape(rt)
        assert otlp_errors(text, "too_large") == 1 and prompt_tokens(text) == 0
        assert post(rt, json_body(GOOD)).status_code == 200


def test_requests_past_the_memory_limit_are_told_to_come_back_later() -> None:
    with running() as rt:
        assert rt.spans is not None
        rt.spans.limiter.limit_bytes = 10_000  # as if the requests in flight held all but this
        r = post(rt, json_body(GOOD | {"pad": "x" * 20_000}))
        assert r.status_code == 429 and r.headers["Retry-After"] == "1"
        assert otlp_errors(scrape(rt), "overloaded") == 1
        assert rt.spans.limiter.in_use == 0
        rt.spans.limiter.limit_bytes = 256 << 20
        assert post(rt, json_body(GOOD)).status_code == 200


# ---- gRPC ------------------------------------------------------------------------------------------
def _export_request(prompt: int, span_id: bytes) -> bytes:
    now = time.time_ns()
    span = trace_pb2.Span(trace_id=bytes(range(16)), span_id=span_id, name="llm_request",
                          start_time_unix_nano=now - 10**9, end_time_unix_nano=now)
    span.attributes.append(common_pb2.KeyValue(key="gen_ai.usage.prompt_tokens",
                                               value=common_pb2.AnyValue(int_value=prompt)))
    req = trace_service_pb2.ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    rs.resource.attributes.append(common_pb2.KeyValue(key="service.instance.id",
                                                      value=common_pb2.AnyValue(string_value="w0")))
    rs.scope_spans.add().spans.append(span)
    return req.SerializeToString()


def test_calls_that_never_send_their_message_leave_other_exports_served() -> None:
    metadata = (("authorization", f"Bearer {TOKEN}"),)
    with running(grpc_receiver=True, read_timeout=2.0) as rt:
        assert rt.grpc is not None
        never = threading.Event()

        def silent() -> Iterator[bytes]:  # headers go out; the message never does
            never.wait(60)
            yield b""

        hanging = []
        for _ in range(4):
            channel = grpc.insecure_channel(rt.grpc.address, options=[("grpc.use_local_subchannel_pool", 1)])  # four clients
            hanging.append((channel, channel.stream_unary(PATH).future(silent(), metadata=metadata, timeout=60)))
        try:
            time.sleep(0.5)  # the four calls are in
            with grpc.insecure_channel(rt.grpc.address) as channel:
                stub = trace_service_pb2_grpc.TraceServiceStub(channel)
                for i in range(8):
                    req = trace_service_pb2.ExportTraceServiceRequest.FromString(_export_request(10, bytes([i]) * 8))
                    stub.Export(req, metadata=metadata, timeout=5)
            assert rt.state.store.window_counter("prefixscope_request_prompt_tokens") == 80
            for _channel, call in hanging:  # and the server ends them itself
                with pytest.raises(grpc.RpcError) as ended:
                    call.result(timeout=30)
                assert ended.value.code() == grpc.StatusCode.CANCELLED
            deadline = time.monotonic() + 10  # (counted by the server's threads as they let go)
            while rt.health.counter_value("prefixscope_ingest_errors", ("otlp", "timeout")) < 4:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        finally:
            never.set()
            for channel, _call in hanging:
                channel.close()


def test_an_unauthenticated_call_is_refused_before_its_message_is_read() -> None:
    with running(grpc_receiver=True) as rt:
        assert rt.grpc is not None
        assert rt.spans is not None
        seen: list[int] = []
        ingest = rt.spans.ingest
        rt.spans.ingest = lambda raw, *a, **kw: seen.append(len(raw)) or ingest(raw, *a, **kw)  # type: ignore[method-assign]
        with grpc.insecure_channel(rt.grpc.address) as channel:
            never = threading.Event()

            def silent() -> Iterator[bytes]:
                never.wait(30)
                yield b""

            call = channel.stream_unary(PATH).future(silent(), metadata=(("authorization", "Bearer wrong"),), timeout=30)
            try:
                with pytest.raises(grpc.RpcError) as refused:
                    call.result(timeout=10)  # answered while the message has not even been sent
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            finally:
                never.set()
        assert seen == []
