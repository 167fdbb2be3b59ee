"""A simulated worker exporting vLLM-shaped spans (fleet.spans, opentelemetry-sdk's OTLP exporter)
to the exporter's /v1/traces: each request becomes a record whose values are the engine's own."""

from __future__ import annotations

import requests

from exporter.config import Config, OtlpTraces, WorkerTarget
from exporter.main import Runtime
from fleet.clock import RealClock
from fleet.engine import EngineResult, SimEngine, WorkerSpec
from fleet.spans import SpanExport
from fleet.worker_http import WorkerServer


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
    assert st.window_counter("prefixscope_request_prompt_tokens") == sum(r.prompt_tokens for r in served)
    assert st.window_counter("prefixscope_reuse_achieved_tokens") == sum(r.cached_tokens for r in served)
    assert served[1].cached_tokens > 0
    assert st.signals()["prefill_timing"] and st.signals()["otlp_spans"]
