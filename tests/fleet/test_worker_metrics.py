"""A worker's /metrics carries vLLM's (or SGLang's) names, labels and buckets, and parses."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleet.clock import VirtualClock
from fleet.engine import EngineRequest, SimEngine, WorkerSpec
from fleet.metrics_text import VLLM_LATENCY_BUCKETS, VLLM_TTFT_BUCKETS, render_metrics


def busy_engine(**kw) -> SimEngine:
    clock = VirtualClock()
    eng = SimEngine(WorkerSpec("w0", model="org/model-7b", block_size=16, num_gpu_blocks=1000,
                               prefill_tps=1000.0, prefill_overhead_s=0.0, attention_knee_tokens=1e12, **kw), clock)
    p = list(range(1, 65))
    for i in range(3):  # 64 tokens each: hits 0, 48, 48
        r = eng.execute(EngineRequest(f"r{i}", token_ids=p, max_tokens=4))
        clock.advance(r.e2e_s + 0.01)
    eng.execute(EngineRequest("running", token_ids=[7] * 40, max_tokens=1000))
    return eng


def samples(text: str) -> dict[str, list]:
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append(s)
    return out


def one(smp: dict, name: str):
    assert len(smp[name]) == 1, name
    return smp[name][0]


def test_vllm_current_names_labels_values_and_buckets():
    eng = busy_engine(spec_tokens=2)
    text = render_metrics(eng, "vllm").decode()
    smp = samples(text)
    q = one(smp, "vllm:prefix_cache_queries_total")
    assert q.labels == {"engine": "0", "model_name": "org/model-7b"}
    assert q.value == 3 * 64 + 40
    assert one(smp, "vllm:prefix_cache_hits_total").value == 48 + 48
    assert "vllm:prefix_cache_queries_created" in smp
    assert one(smp, "vllm:num_requests_running").value == 1
    assert one(smp, "vllm:num_requests_waiting").value == 0
    assert 0 < one(smp, "vllm:kv_cache_usage_perc").value <= 1
    # prompt tokens count once the prefill is done (the running request's is not yet)
    assert one(smp, "vllm:prompt_tokens_total").value == 3 * 64
    success = {s.labels["finished_reason"]: s.value for s in smp["vllm:request_success_total"]}
    assert success == {"stop": 0, "length": 3, "abort": 0}
    info = one(smp, "vllm:cache_config_info")
    assert info.value == 1 and "model_name" not in info.labels
    assert (info.labels["block_size"], info.labels["num_gpu_blocks"], info.labels["engine"]) == ("16", "1000", "0")
    for name, bounds in (("vllm:time_to_first_token_seconds", VLLM_TTFT_BUCKETS),
                         ("vllm:e2e_request_latency_seconds", VLLM_LATENCY_BUCKETS),
                         ("vllm:request_queue_time_seconds", VLLM_LATENCY_BUCKETS),
                         ("vllm:request_prefill_time_seconds", VLLM_LATENCY_BUCKETS)):
        les = [s.labels["le"] for s in smp[f"{name}_bucket"]]
        assert les == [*(str(float(b)) for b in bounds), "+Inf"], name
        assert f"{name}_created" in smp
    ttft = {s.labels["le"]: s.value for s in smp["vllm:time_to_first_token_seconds_bucket"]}
    # cold 64-token prefill at 1000 tok/s = 0.064 s; warm 16 uncached tokens = 0.016 s
    assert (ttft["0.01"], ttft["0.02"], ttft["0.06"], ttft["0.08"], ttft["+Inf"]) == (0, 2, 2, 3, 3)
    for n in ("drafts", "draft_tokens", "accepted_tokens"):
        assert f"vllm:spec_decode_num_{n}_total" in smp
    assert one(smp, "vllm:spec_decode_num_draft_tokens_total").value == 2 * one(
        smp, "vllm:spec_decode_num_drafts_total").value
    assert not any(n.startswith("vllm:gpu_") for n in smp)
    # the exposition itself: sorted labels and the _total family name in HELP/TYPE
    assert 'vllm:prefix_cache_hits_total{engine="0",model_name="org/model-7b"} 96.0' in text
    assert "# TYPE vllm:prefix_cache_hits_total counter" in text


def test_spec_decode_series_absent_when_speculative_decoding_is_off():
    smp = samples(render_metrics(busy_engine(), "vllm").decode())
    assert not any(n.startswith("vllm:spec_decode") for n in smp)


def test_vllm_legacy_names():
    smp = samples(render_metrics(busy_engine(), "vllm-legacy").decode())
    assert one(smp, "vllm:gpu_prefix_cache_queries_total").value == 3 * 64 + 40
    assert one(smp, "vllm:gpu_prefix_cache_hits_total").value == 96
    assert "vllm:gpu_cache_usage_perc" in smp
    assert not any(n.startswith(("vllm:prefix_cache", "vllm:kv_cache")) for n in smp)


def test_sglang_names():
    smp = samples(render_metrics(busy_engine(spec_tokens=2), "sglang").decode())
    labels = {"model_name": "org/model-7b", "engine_type": "unified", "tp_rank": "0", "pp_rank": "0"}
    assert one(smp, "sglang:prompt_tokens_total").labels == labels
    assert one(smp, "sglang:cached_tokens_total").value == 96
    assert one(smp, "sglang:num_running_reqs").value == 1
    assert one(smp, "sglang:num_queue_reqs").value == 0
    assert one(smp, "sglang:cache_hit_rate").value == pytest.approx(96 / (3 * 64 + 40))
    assert one(smp, "sglang:max_total_num_tokens").value == 16000
    assert one(smp, "sglang:num_requests_total").value == 3
    assert "sglang:token_usage" in smp and "sglang:spec_accept_length" in smp
    les = [s.labels["le"] for s in smp["sglang:time_to_first_token_seconds_bucket"]]
    assert les[0] == "0.1" and les[-1] == "+Inf"
    assert not any(n.startswith("vllm:") for n in smp)


def test_unknown_flavour_is_refused():
    with pytest.raises(ValueError, match="flavour"):
        render_metrics(busy_engine(), "tgi")


@pytest.mark.parametrize("flavour", ["vllm", "vllm-legacy", "sglang"])
def test_promtool_check_metrics_accepts_the_page(flavour):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed")
    text = render_metrics(busy_engine(spec_tokens=2), flavour)
    proc = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, timeout=30)
    # vLLM's and SGLang's names contain ':' (reserved for recording rules), which promtool flags
    # on the real engines' pages too; anything else would be ours
    problems = [ln for ln in proc.stdout.decode().splitlines() + proc.stderr.decode().splitlines() if ln.strip()]
    assert problems, "expected the ':' lint that real vLLM/SGLang pages draw"
    assert all(ln.endswith("metric names should not contain ':'") for ln in problems), problems
