"""OTLP/gRPC ``TraceService/Export``: vLLM-shaped spans sent by opentelemetry-sdk's own gRPC exporter
(vLLM's default protocol) reach the state exactly as the same spans over OTLP/HTTP do; bad messages
are refused, counted, and the receiver keeps serving; the config's checks of the address."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
import requests
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from exporter.config import (
    Config,
    ConfigError,
    HttpRecords,
    OtlpTraces,
    WorkerTarget,
    check_intake_auth,
    parse_config,
)
from exporter.main import Runtime
from exporter.web.exposition import render_state
from exporter.web.otlp_grpc import PATH, authorised
from fleet.engine import EngineResult
from fleet.spans import FleetSpans

TOKEN = "grpc-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}  # as OTEL_EXPORTER_OTLP_TRACES_HEADERS sets it
WORKERS = tuple(WorkerTarget(f"w{i}", f"http://127.0.0.1:{i + 1}/metrics") for i in range(2))


@contextmanager
def running(otlp: OtlpTraces, max_body_bytes: int = 8 * 1024 * 1024) -> Iterator[Runtime]:
    """The exporter's HTTP server and trace receivers (no scrape loop: the workers are not there)."""
    cfg = Config(listen_address="127.0.0.1:0", workers=WORKERS, otlp=otlp, scrape_interval=60.0,
                 scrape_timeout=1.0, http_records=HttpRecords(bearer_token=TOKEN, max_body_bytes=max_body_bytes))
    rt = Runtime.build(cfg)
    rt.server.start()
    assert rt.spans is not None
    rt.spans.start()
    if rt.grpc is not None:
        rt.grpc.start()
    try:
        yield rt
    finally:
        if rt.grpc is not None:
            rt.grpc.stop()
        rt.spans.close()
        rt.server.stop()


def results(now: float) -> list[EngineResult]:
    """What two workers' engines served: cold and warm requests, with their own timings."""
    out = []
    for i in range(6):
        prompt, cached = 256 + 64 * i, (0 if i < 2 else 128 + 16 * i)
        prefill = 0.002 * (prompt - cached) / 16
        out.append(EngineResult(f"cmpl-{i}", f"w{i % 2}", prompt, cached, 8, "length", now - 5 + i * 0.1,
                                0.001 * i, prefill, 0.08, 0.001 * i + prefill + 0.01, 0.001 * i + prefill + 0.08,
                                [], cached // 16))
    return out


def send(protocol: str, endpoint: str, served: list[EngineResult]) -> None:
    spans = FleetSpans(endpoint, cache_read=True, batch=False, headers=AUTH, protocol=protocol)
    try:
        for r in served:
            spans(r, {}, "/v1/completions")
    finally:
        spans.close()


def request_derived(text: bytes) -> list[str]:
    """The exposition's sample lines that requests feed (the receivers' own bookkeeping left out)."""
    return sorted(line for line in text.decode().splitlines() if line and not line.startswith("#")
                  and "seconds_since" not in line and "_up{" not in line and "_config_last_reload" not in line)


@pytest.mark.parametrize("compression", [None, "gzip"])
def test_vllm_spans_over_grpc_reach_the_state_exactly_as_over_http(monkeypatch: pytest.MonkeyPatch,
                                                                    compression: str | None) -> None:
    if compression:  # how an operator turns it on for vLLM's exporter
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", compression)
    served = results(time.time())
    with running(OtlpTraces(session_wait=0.0)) as over_http, \
            running(OtlpTraces(enabled=False, session_wait=0.0, grpc_listen_address="127.0.0.1:0")) as over_grpc:
        assert over_grpc.grpc is not None
        send("http/protobuf", f"{over_http.url}/v1/traces", served)
        send("grpc", f"http://{over_grpc.grpc.address}", served)
        for rt in (over_http, over_grpc):
            st = rt.state
            assert st.store.window_counter("prefixscope_request_prompt_tokens") == sum(r.prompt_tokens for r in served)
            assert st.store.window_counter("prefixscope_reuse_achieved_tokens") == sum(r.cached_tokens for r in served)
            assert rt.health.counter_value("prefixscope_records_ingested", ("otlp",)) == len(served)
            assert st.signals()["otlp_spans"] and st.signals()["prefill_timing"] and st.signals()["cached_tokens"]
        assert over_http.state.signals() == over_grpc.state.signals()
        assert request_derived(render_state(over_grpc.state)) == request_derived(render_state(over_http.state))
        # the second one's OTLP/HTTP route is off (otlp.enabled: false): only gRPC fed it
        assert requests.post(f"{over_grpc.url}/v1/traces", data=b"", timeout=5).status_code == 404


def test_what_the_spans_carried_per_worker_requests_and_ttft() -> None:
    """Each worker's requests and its time-to-first-token histogram, from its own spans, over either
    receiver: the counts and sums are the engines' own, each TTFT in the catalogue bucket holding it."""
    from prefixscope.catalog import METRICS_BY_NAME
    from tests.e2e.router_stack import exported
    served = results(time.time())
    buckets = METRICS_BY_NAME["prefixscope_worker_ttft_seconds"].buckets
    assert buckets is not None
    with running(OtlpTraces(session_wait=0.0, grpc_listen_address="127.0.0.1:0")) as rt:
        assert rt.grpc is not None
        send("http/protobuf", f"{rt.url}/v1/traces", served[:3])
        send("grpc", f"http://{rt.grpc.address}", served[3:])
        got = exported(rt.url)
    for w in ("w0", "w1"):
        mine = [r.ttft_s for r in served if r.worker == w]
        assert got[("prefixscope_worker_requests_total", (("worker", w),))] == len(mine)
        assert got[("prefixscope_worker_ttft_seconds_count", (("worker", w),))] == len(mine)
        assert got[("prefixscope_worker_ttft_seconds_sum", (("worker", w),))] == pytest.approx(sum(mine))
        for le in buckets:
            key = ("prefixscope_worker_ttft_seconds_bucket", (("le", f"{le:g}" if le != int(le) else f"{le:.1f}"),
                                                              ("worker", w)))
            assert got[key] == sum(t <= le for t in mine), (w, le)


def _span(attrs: dict[str, int | str], worker: str = "w0") -> trace_service_pb2.ExportTraceServiceRequest:
    now = time.time_ns()
    span = trace_pb2.Span(trace_id=bytes(range(16)), span_id=bytes(range(8)), name="llm_request",
                          start_time_unix_nano=now - 10**9, end_time_unix_nano=now)
    for k, v in attrs.items():
        value = common_pb2.AnyValue(int_value=v) if isinstance(v, int) else common_pb2.AnyValue(string_value=v)
        span.attributes.append(common_pb2.KeyValue(key=k, value=value))
    req = trace_service_pb2.ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    rs.resource.attributes.append(common_pb2.KeyValue(key="service.instance.id",
                                                      value=common_pb2.AnyValue(string_value=worker)))
    rs.scope_spans.add().spans.append(span)
    return req


def test_a_bad_message_is_refused_and_counted_and_the_receiver_keeps_serving() -> None:
    with running(OtlpTraces(grpc_listen_address="127.0.0.1:0", session_wait=0.0), max_body_bytes=4096) as rt:
        assert rt.grpc is not None
        metadata = (("authorization", f"Bearer {TOKEN}"),)
        with grpc.insecure_channel(rt.grpc.address) as channel:
            raw = channel.unary_unary(PATH)  # bytes as they are: a message that does not decode
            stub = trace_service_pb2_grpc.TraceServiceStub(channel)
            with pytest.raises(grpc.RpcError) as bad:
                raw(b"\xff\xff\xff", metadata=metadata, timeout=5)
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # never retried by OTLP exporters
            assert "not an OTLP protobuf" in (bad.value.details() or "")
            assert rt.health.counter_value("prefixscope_ingest_errors", ("otlp", "decode")) == 1

            # over the limit (but within twice it): read, refused, counted
            with pytest.raises(grpc.RpcError) as large:
                stub.Export(_span({"gen_ai.usage.prompt_tokens": 64, "pad": "x" * 5000}), metadata=metadata, timeout=5)
            assert large.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "exceeds the limit" in (large.value.details() or "")
            assert rt.health.counter_value("prefixscope_ingest_errors", ("otlp", "too_large")) == 1
            # beyond twice the limit gRPC refuses it unread
            with pytest.raises(grpc.RpcError) as huge:
                stub.Export(_span({"gen_ai.usage.prompt_tokens": 64, "pad": "x" * 9000}), metadata=metadata, timeout=5)
            assert huge.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

            with pytest.raises(grpc.RpcError) as unauthorised:
                stub.Export(_span({"gen_ai.usage.prompt_tokens": 64}), metadata=(("authorization", "Bearer no"),),
                            timeout=5)
            assert unauthorised.value.code() == grpc.StatusCode.UNAUTHENTICATED

            # a request span without prompt tokens: the message is taken, the span rejected and said so
            resp = stub.Export(_span({"gen_ai.request.id": "x"}), metadata=metadata, timeout=5)
            assert resp.partial_success.rejected_spans == 1
            assert "has no gen_ai.usage.prompt_tokens" in resp.partial_success.error_message
            assert rt.health.counter_value("prefixscope_ingest_errors", ("otlp", "span")) == 1

            # and a good one after all that
            resp = stub.Export(_span({"gen_ai.usage.prompt_tokens": 64, "gen_ai.request.id": "ok"}),
                               metadata=metadata, timeout=5)
            assert not resp.HasField("partial_success")
        assert rt.state.store.window_counter("prefixscope_request_prompt_tokens") == 64
        assert rt.health.counter_value("prefixscope_records_ingested", ("otlp",)) == 1


def test_bearer_token_in_metadata() -> None:
    assert authorised((), None)
    assert authorised((("authorization", "bearer t"),), "t")
    assert authorised((("authorization", b"Bearer t"),), "t")
    assert not authorised((("authorization", "Basic t"),), "t")
    assert not authorised((), "t")


# ---- config --------------------------------------------------------------------------------------
def test_the_grpc_receiver_is_off_unless_an_address_is_given(tmp_path: Path) -> None:
    assert parse_config({}).otlp.grpc_listen_address is None
    cfg = parse_config({"otlp": {"grpc_listen_address": "127.0.0.1:4317"}})
    assert cfg.otlp.grpc_listen_address == "127.0.0.1:4317" and cfg.otlp.enabled
    with pytest.raises(ConfigError, match=r"otlp\.grpc_listen_address"):
        parse_config({"otlp": {"grpc_listen_address": "4317"}})
    with pytest.raises(ConfigError, match=r"otlp\.grpc_listen_address"):
        parse_config({"otlp": {"grpc_listen_address": "127.0.0.1:70000"}})


def test_the_grpc_address_needs_its_own_port_and_a_token_beyond_loopback() -> None:
    same = Config(listen_address="127.0.0.1:9400", otlp=OtlpTraces(grpc_listen_address="127.0.0.1:9400"))
    with pytest.raises(ConfigError, match="port of its own"):
        check_intake_auth(same)
    open_to_all = Config(otlp=OtlpTraces(grpc_listen_address="0.0.0.0:4317"))
    with pytest.raises(ConfigError, match=r"needs records\.http\.bearer_token"):
        check_intake_auth(open_to_all)
    check_intake_auth(Config(otlp=OtlpTraces(grpc_listen_address="0.0.0.0:4317"),
                             http_records=HttpRecords(bearer_token="t")))


def test_a_taken_grpc_port_is_a_clear_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = Config(listen_address="127.0.0.1:0", otlp=OtlpTraces(grpc_listen_address=f"127.0.0.1:{port}"))
        with pytest.raises(ConfigError, match=rf"otlp\.grpc_listen_address: cannot listen on 127\.0\.0\.1:{port}"):
            Runtime.build(cfg)


def test_the_runtime_starts_and_stops_the_grpc_receiver() -> None:
    cfg = Config(listen_address="127.0.0.1:0", workers=WORKERS, scrape_interval=60.0, scrape_timeout=1.0,
                 otlp=OtlpTraces(grpc_listen_address="127.0.0.1:0", session_wait=0.0))
    rt = Runtime.build(cfg).start()
    assert rt.grpc is not None
    address = rt.grpc.address
    try:
        with grpc.insecure_channel(address) as channel:
            stub = trace_service_pb2_grpc.TraceServiceStub(channel)
            stub.Export(_span({"gen_ai.usage.prompt_tokens": 32}), timeout=5)
        assert rt.state.store.window_counter("prefixscope_request_prompt_tokens") == 32
    finally:
        rt.stop()
    with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as gone:
        trace_service_pb2_grpc.TraceServiceStub(channel).Export(_span({"gen_ai.usage.prompt_tokens": 32}), timeout=2)
    assert gone.value.code() == grpc.StatusCode.UNAVAILABLE
