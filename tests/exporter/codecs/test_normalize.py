"""Worker and router /metrics normalisation, against hand-computed values from the fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest

from exporter.codecs import normalize

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def _worker(name: str):
    snap, errors = normalize.parse_worker("w0", (FIXTURES / name).read_text())
    assert errors == []
    return snap


def test_vllm_current_sums_dp_engines() -> None:
    s = _worker("vllm_0_33_dp2.txt")
    assert s.flavour == "vllm" and s.model == MODEL
    assert s.prefix_queried_tokens == 32000 + 8000
    assert s.prefix_hit_tokens == 24000 + 2000
    assert s.num_gpu_blocks == 1000 + 3000 and s.block_size == 16
    # usage weighted by each engine's blocks: (0.25·1000 + 0.75·3000) / 4000
    assert s.kv_usage_ratio == pytest.approx(0.625)
    assert (s.running, s.waiting) == (8.0, 1.0)
    assert s.prompt_tokens == 49000
    assert (s.spec_draft_tokens, s.spec_accepted_tokens) == (1000.0, 630.0)
    assert s.requests_success == 24.0
    assert s.max_running is None  # vLLM does not export max_num_seqs


def test_vllm_0_10_both_names_not_double_counted() -> None:
    s = _worker("vllm_0_10_both_names.txt")
    assert s.flavour == "vllm"
    assert (s.prefix_queried_tokens, s.prefix_hit_tokens) == (5000.0, 1250.0)
    assert s.kv_usage_ratio == 0.5
    assert (s.num_gpu_blocks, s.block_size) == (2048, 32)
    assert s.spec_draft_tokens is None and s.prompt_tokens is None  # not exported: missing, not zero


def test_vllm_legacy_names() -> None:
    s = _worker("vllm_0_8_legacy.txt")
    assert s.flavour == "vllm-legacy"
    assert (s.prefix_queried_tokens, s.prefix_hit_tokens, s.kv_usage_ratio) == (800.0, 200.0, 0.125)
    assert s.num_gpu_blocks == 512


def test_sglang_with_cached_token_counter() -> None:
    s = _worker("sglang_cached_counter.txt")
    assert s.flavour == "sglang" and s.model == MODEL
    # TP ranks repeat the scheduler's numbers: rank 0 only. Hits: the device (GPU) tier.
    assert s.prefix_queried_tokens == 10000.0
    assert s.prefix_hit_tokens == 6000.0
    assert (s.kv_usage_ratio, s.running, s.waiting, s.requests_success) == (0.28, 7.0, 2.0, 40.0)
    assert s.num_gpu_blocks is None and s.spec_draft_tokens is None


def test_sglang_hit_rate_gauge_only_leaves_tokens_missing() -> None:
    s = _worker("sglang_hit_rate_only.txt")
    assert s.prefix_hit_tokens is None and s.prefix_queried_tokens is None
    assert s.prompt_tokens == 10000.0


def test_idle_vllm_without_samples_of_known_names() -> None:
    text = "# TYPE vllm:iteration_tokens_total histogram\nvllm:iteration_tokens_total_count{engine=\"0\"} 0\n"
    snap, _ = normalize.parse_worker("w1", text)
    assert snap.flavour == "vllm" and snap.prefix_hit_tokens is None


def test_unrecognised_page_raises() -> None:
    with pytest.raises(normalize.UnrecognisedMetrics):
        normalize.parse_worker("w", "node_cpu_seconds_total{cpu=\"0\"} 1\n")
    with pytest.raises(normalize.UnrecognisedMetrics):
        normalize.parse_router("r", (FIXTURES / "vllm_0_33_dp2.txt").read_text())


def test_sglang_router() -> None:
    snap, errors = normalize.parse_router("r0", (FIXTURES / "sglang_router_metrics.txt").read_text())
    assert errors == [] and snap.kind == "sglang-router"
    assert snap.decisions == {"http://127.0.0.1:8151": 60.0, "http://127.0.0.1:8152": 63.0, "http://127.0.0.1:8153": 33.0}
    assert snap.healthy == dict.fromkeys(snap.decisions, 1.0)
    assert snap.prefix_outcomes == {}  # sglang-router exports no hit/miss outcome


def test_vllm_router() -> None:
    snap, errors = normalize.parse_router("r1", (FIXTURES / "vllm_router_metrics.txt").read_text())
    assert errors == [] and snap.kind == "vllm-router"
    assert snap.decisions == {"http://127.0.0.1:8331": 10.0, "http://127.0.0.1:8332": 90.0, "http://127.0.0.1:8333": 20.0}
    assert snap.prefix_outcomes == {"hit": 110.0, "miss": 10.0}
    assert snap.healthy["http://127.0.0.1:8332"] == 1.0


def test_router_health_zero_and_policy_sum() -> None:
    text = "\n".join([
        'vllm_router_policy_decisions_total{policy="cache_aware",worker="http://a"} 3',
        'vllm_router_policy_decisions_total{policy="round_robin",worker="http://a"} 4',
        'vllm_router_worker_health{worker="http://a"} 0',
    ])
    snap, _ = normalize.parse_router("r", text)
    assert snap.decisions == {"http://a": 7.0} and snap.healthy == {"http://a": 0.0}
    assert snap.prefix_outcomes == {}


@pytest.mark.parametrize(("line", "field"), [
    ('vllm:prefix_cache_queries_total{engine="0"} +Inf', "prefix_queried_tokens"),
    ('vllm:prefix_cache_queries_total{engine="0"} -5', "prefix_queried_tokens"),
    ('vllm:num_requests_running{engine="0"} NaN', "running"),
    ('vllm:kv_cache_usage_perc{engine="0"} 1.5', "kv_usage_ratio"),
    ('vllm:cache_config_info{engine="0",num_gpu_blocks="-5",block_size="16"} 1', "num_gpu_blocks"),
    ('vllm:cache_config_info{engine="0",num_gpu_blocks="100",block_size="0x10"} 1', "block_size"),
])
def test_impossible_values_are_rejected_and_the_signal_is_missing(line: str, field: str) -> None:
    other = 'vllm:prefix_cache_queries_total{engine="1"} 7' if "queries" in line else 'vllm:prefix_cache_hits_total 1'
    snap, errors = normalize.parse_worker("w", f"{line}\n{other}\n")
    assert getattr(snap, field) is None  # not a partial sum over the other engine either
    assert [e.kind for e in errors] == ["bad_value"]


def test_unsized_pool_is_not_an_error_and_sums_past_the_float_range_are() -> None:
    snap, errors = normalize.parse_worker("w", 'vllm:cache_config_info{num_gpu_blocks="None",block_size="16"} 1\n'
                                               'vllm:num_requests_running{engine="0"} 1e308\n'
                                               'vllm:num_requests_running{engine="1"} 1e308\n')
    assert snap.num_gpu_blocks is None and snap.block_size == 16 and snap.running is None
    assert [e.kind for e in errors] == ["bad_value"]


def test_router_values_checked_too() -> None:
    snap, errors = normalize.parse_router("r", 'vllm_router_policy_decisions_total{worker="http://a"} -1\n'
                                               'vllm_router_worker_health{worker="http://a"} 1\n')
    assert snap.decisions == {} and snap.healthy == {"http://a": 1.0}
    assert [e.kind for e in errors] == ["bad_value"]
