"""A simulated worker exporting vLLM-shaped spans (fleet.spans, opentelemetry-sdk's OTLP exporter)
to the exporter's /v1/traces: each request becomes a record whose values are the engine's own."""

from __future__ import annotations

import requests

from exporter.config import Config, OtlpTraces, WorkerTarget
from exporter.main import Runtime
from fleet.clock import RealClock
from fleet.engine import EngineResult, SimEngine, WorkerSpec
from fleet.spans import FleetSpans, GenAiClient, SpanExport
from fleet.worker_http import WorkerServer
from tests.support import wait_for


def test_worker_spans_carry_the_engines_own_numbers() -> None:
    spec = WorkerSpec("w0", block_size=16, num_gpu_blocks=256)
    served: list[EngineResult] = []
    runtime = Runtime.build(Config(listen_address="127.0.0.1:0", otlp=OtlpTraces(session_wait=0.0),
                                   workers=(WorkerTarget("w0", "http://127.0.0.1:1/metrics"),)))
    runtime.server.start()
    spans = SpanExport(f"{runtime.url}/v1/traces", "w0", cache_read=True, batch=False)

    def on_request(r: EngineResult, headers: dict[str, str], path: str) -> None:
        served.append(r)
        spans(r, headers, path)

    worker = WorkerServer(SimEngine(spec, RealClock()), delay_scale=1.0, on_request=on_request).start()
    try:
        prompt = list(range(1, 161))
        # Served in real time (delay_scale 1): the first request has finished in engine time, and
        # its blocks are in the cache, before the second is admitted.
        for _ in range(2):  # the second reuses the first's blocks
            r = requests.post(f"{worker.url}/v1/completions", json={"prompt": prompt, "max_tokens": 2}, timeout=10)
            assert r.status_code == 200
    finally:
        worker.stop()
        spans.close()
        runtime.server.stop()
    st = runtime.state
    assert st.store.window_counter("prefixscope_request_prompt_tokens") == sum(r.prompt_tokens for r in served)
    assert st.store.window_counter("prefixscope_reuse_achieved_tokens") == sum(r.cached_tokens for r in served)
    assert served[1].cached_tokens > 0
    assert st.signals()["prefill_timing"] and st.signals()["otlp_spans"]


def test_a_genai_client_span_gives_the_workers_span_its_session_and_cached_tokens() -> None:
    """vLLM's span carries neither; the client's span of the same trace (traceparent) carries both."""
    spec = WorkerSpec("w0", block_size=16, num_gpu_blocks=256)
    served: list[EngineResult] = []
    runtime = Runtime.build(Config(listen_address="127.0.0.1:0",
                                   otlp=OtlpTraces(session_attributes=("gen_ai.conversation.id",), session_wait=30.0),
                                   workers=(WorkerTarget("w0", "http://127.0.0.1:1/metrics"),)))
    runtime.server.start()
    endpoint = f"{runtime.url}/v1/traces"
    fleet_spans = FleetSpans(endpoint, batch=False)  # vLLM's span only: no cached-token attribute
    client = GenAiClient(endpoint, batch=False)

    def on_request(r: EngineResult, headers: dict[str, str], path: str) -> None:
        served.append(r)
        fleet_spans(r, headers, path)

    worker = WorkerServer(SimEngine(spec, RealClock()), delay_scale=1.0, on_request=on_request).start()
    try:
        prompt = list(range(1, 161))
        for _ in range(2):
            with client.call("sim-model", "conv-7") as (span, headers):
                r = requests.post(f"{worker.url}/v1/completions", json={"prompt": prompt, "max_tokens": 2},
                                  headers=headers, timeout=10)
                assert r.status_code == 200
                client.record_usage(span, r.json()["usage"])
        # the client's span ended (and was exported) after vLLM's: the records waited for it
        wait_for(lambda: runtime.state.store.window_counter("prefixscope_followup_requests") == 1, "the follow-up")
    finally:
        worker.stop()
        fleet_spans.close()
        client.close()
        runtime.server.stop()
    st = runtime.state
    assert served[1].cached_tokens > 0
    assert st.store.window_counter("prefixscope_reuse_achieved_tokens") == sum(r.cached_tokens for r in served)
    assert st.store.window_counter("prefixscope_session_followup_cached_tokens") == served[1].cached_tokens
    assert st.store.window_counter("prefixscope_session_followup_prompt_tokens") == served[1].prompt_tokens
    signals = st.signals()
    assert signals["session_key"] and signals["cached_tokens"] and signals["migrations"]


def test_usage_the_response_lacks_stays_off_the_client_span() -> None:
    class Recorder:
        def __init__(self) -> None:
            self.attrs: dict[str, int] = {}

        def set_attribute(self, key: str, value: int) -> None:
            self.attrs[key] = value

    span = Recorder()
    GenAiClient.record_usage(span, {"prompt_tokens": 10, "completion_tokens": 2, "prompt_tokens_details": None})  # type: ignore[arg-type]
    assert span.attrs == {"gen_ai.usage.input_tokens": 10, "gen_ai.usage.output_tokens": 2}
    GenAiClient.record_usage(span, {"prompt_tokens_details": {"cached_tokens": 0}})  # type: ignore[arg-type]
    assert span.attrs["gen_ai.usage.cache_read.input_tokens"] == 0  # reported 0 is 0
