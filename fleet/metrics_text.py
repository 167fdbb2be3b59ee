"""A simulated worker's /metrics, in vLLM's (or SGLang's) exact exposition.

Rendered by prometheus_client from a private registry, so label order, ``_total``/``_created``
series, HELP/TYPE lines and number formatting are what prometheus_client writes for the real
engines. Three flavours:

- ``vllm``: current vLLM names (0.14+; vllm.md §1.2–1.3): ``vllm:prefix_cache_{queries,hits}``,
  ``vllm:kv_cache_usage_perc``, ``vllm:cache_config_info`` (CacheConfig fields as string labels
  plus ``engine``, no ``model_name``), running/waiting, TTFT/queue/prefill/decode/inference/e2e
  histograms with vLLM's bucket lists, token and success counters, and the spec-decode counters
  (registered only when speculative decoding is on, as in vLLM), and with ``--kv-cache-metrics``
  (``WorkerSpec.kv_cache_metrics``) the sampled block residency histograms
  ``vllm:kv_block_{lifetime,idle_before_evict,reuse_gap}_seconds`` on the ``kv_cache_residency``
  bounds (vllm.md §1.2; present and empty from the start, absent without the flag).
- ``vllm-legacy``: the pre-0.9.2 names ``vllm:gpu_prefix_cache_{queries,hits}`` and
  ``vllm:gpu_cache_usage_perc`` in place of the current ones (vllm.md §1.4).
- ``sglang``: SGLang's ``sglang:*`` names, confirmed in sgl-project/sglang
  ``python/sglang/srt/metrics/collector.py`` (SchedulerMetricsCollector: num_running_reqs,
  num_queue_reqs, num_used_tokens, token_usage, max_total_num_tokens, cache_hit_rate,
  spec_accept_length, spec_accept_rate, queue_time_seconds; TokenizerMetricsCollector:
  prompt_tokens, generation_tokens, cached_tokens, num_requests counters and the
  time_to_first_token / e2e_request_latency histograms, with their default buckets) and in
  its docs/references/production_metrics.md example scrape. Labels: ``model_name``,
  ``engine_type``, ``tp_rank``, ``pp_rank``.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from fleet.engine import EngineSnapshot, SimEngine, WorkerSpec
from fleet.histogram import Histogram

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
FLAVOURS = ("vllm", "vllm-legacy", "sglang")

# vLLM bucket families (vllm.md §1.2).
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                     7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                        120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# SGLang defaults (collector.py).
SGLANG_TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
SGLANG_E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200,
                      1800, 2400)
SGLANG_QUEUE_BUCKETS = (0.0, 0.1, 0.2, 0.5, 1, 2, 3, 4, 5, 10, 15, 20, 30, 40, 50, 60, 70, 80, 90, 100, 200,
                        300, 400, 500, 600, 700, 800, 900, 1000, 1200, 1400, 1600, 1800, 2000, 2500, 3000)

VLLM_LABELS = ("model_name", "engine")
SGLANG_LABELS = ("model_name", "engine_type", "tp_rank", "pp_rank")


def request_tokens_buckets(max_model_len: int) -> tuple[int, ...]:
    """vLLM's ``build_1_2_5_buckets``: 1, 2, 5, 10, 20, 50, … up to max_model_len."""
    out: list[int] = []
    exp = 1
    while True:
        for m in (1, 2, 5):
            v = m * exp
            if v > max_model_len:
                return tuple(out)
            out.append(v)
        exp *= 10


def _buckets(values: Sequence[float], bounds: Iterable[float]) -> list[tuple[str, float]]:
    ordered = sorted(values)
    out = [(floatToGoString(b), float(bisect_right(ordered, b))) for b in bounds]
    out.append(("+Inf", float(len(ordered))))
    return out


class _Families:
    """Builds metric families with one fixed label set and the engine's creation time."""

    def __init__(self, labelnames: Sequence[str], labelvalues: Sequence[str], created: float) -> None:
        self.names = list(labelnames)
        self.values = list(labelvalues)
        self.created = created
        self.out: list[Metric] = []

    def counter(self, name: str, doc: str, value: float) -> None:
        f = CounterMetricFamily(name, doc, labels=self.names)
        f.add_metric(self.values, value, created=self.created)
        self.out.append(f)

    def counter_by(self, name: str, doc: str, label: str, values: dict[str, float]) -> None:
        f = CounterMetricFamily(name, doc, labels=[*self.names, label])
        for k, v in sorted(values.items()):
            f.add_metric([*self.values, k], v, created=self.created)
        self.out.append(f)

    def gauge(self, name: str, doc: str, value: float) -> None:
        f = GaugeMetricFamily(name, doc, labels=self.names)
        f.add_metric(self.values, value)
        self.out.append(f)

    def histogram(self, name: str, doc: str, values: Sequence[float], bounds: Iterable[float]) -> None:
        f = HistogramMetricFamily(name, doc, labels=self.names)
        f.add_metric(self.values, _buckets(values, bounds), float(sum(values)))
        f.samples.append(Sample(f"{name}_created", dict(zip(self.names, self.values, strict=True)), self.created))
        self.out.append(f)

    def histogram_of(self, name: str, doc: str, h: Histogram) -> None:
        """A histogram the engine kept as bucket counts (too many observations to keep each)."""
        f = HistogramMetricFamily(name, doc, labels=self.names)
        f.add_metric(self.values, [(floatToGoString(b), float(c)) for b, c in h.cumulative()], float(h.sum))
        f.samples.append(Sample(f"{name}_created", dict(zip(self.names, self.values, strict=True)), self.created))
        self.out.append(f)


def cache_config_labels(spec: WorkerSpec) -> dict[str, str]:
    """The CacheConfig fields vLLM 0.11+ puts on ``vllm:cache_config_info`` (as strings)."""
    return {
        "block_size": str(spec.block_size),
        "cache_dtype": "auto",
        "calculate_kv_scales": "False",
        "cpu_offload_gb": "0",
        "enable_prefix_caching": "True",
        "gpu_memory_utilization": "0.9",
        "is_attention_free": "False",
        "kv_sharing_fast_prefill": "False",
        "num_cpu_blocks": "None",
        "num_gpu_blocks": str(spec.num_gpu_blocks),
        "num_gpu_blocks_override": "None",
        "prefix_caching_hash_algo": "sha256_cbor",
        "sliding_window": "None",
        "swap_space": "4",
    }


def _vllm(spec: WorkerSpec, s: EngineSnapshot, legacy: bool) -> list[Metric]:
    c = s.counters
    f = _Families(VLLM_LABELS, (spec.model, spec.engine_index), c.created)
    f.gauge("vllm:num_requests_running", "Number of requests in model execution batches.", s.running)
    f.gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", s.waiting)
    if legacy:
        f.gauge("vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.", s.kv_usage)
        f.counter("vllm:gpu_prefix_cache_queries",
                  "GPU prefix cache queries, in terms of number of queried tokens.", c.prefix_queries)
        f.counter("vllm:gpu_prefix_cache_hits",
                  "GPU prefix cache hits, in terms of number of cached tokens.", c.prefix_hits)
    else:
        f.gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.kv_usage)
        f.counter("vllm:prefix_cache_queries",
                  "Prefix cache queries, in terms of number of queried tokens.", c.prefix_queries)
        f.counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", c.prefix_hits)
    f.counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", 0)
    f.counter("vllm:prompt_tokens", "Number of prefill tokens processed.", c.prompt_tokens)
    f.counter("vllm:generation_tokens", "Number of generation tokens processed.", c.generation_tokens)
    f.counter_by("vllm:request_success", "Count of successfully processed requests.", "finished_reason",
                 {r: float(c.requests_success.get(r, 0)) for r in ("stop", "length", "abort")})
    tokens = request_tokens_buckets(spec.max_model_len)
    f.histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", c.prompt_lengths, tokens)
    f.histogram("vllm:request_generation_tokens", "Number of generation tokens processed.",
                c.generation_lengths, tokens)
    f.histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                c.ttft, VLLM_TTFT_BUCKETS)
    f.histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                c.e2e, VLLM_LATENCY_BUCKETS)
    f.histogram("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
                c.queue, VLLM_LATENCY_BUCKETS)
    f.histogram("vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.",
                c.inference, VLLM_LATENCY_BUCKETS)
    f.histogram("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.",
                c.prefill, VLLM_LATENCY_BUCKETS)
    f.histogram("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
                c.decode, VLLM_LATENCY_BUCKETS)
    if spec.spec_tokens > 0:
        f.counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", c.spec_drafts)
        f.counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", c.spec_draft_tokens)
        f.counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", c.spec_accepted_tokens)
    if s.residency is not None and not legacy:
        sampled = "Sampled metrics (controlled by --kv-cache-metrics-sample)."
        r = s.residency
        f.histogram_of("vllm:kv_block_lifetime_seconds",
                       f"Histogram of KV cache block lifetime from allocation to eviction. {sampled}", r.lifetime)
        f.histogram_of("vllm:kv_block_idle_before_evict_seconds",
                       f"Histogram of idle time before KV cache block eviction. {sampled}", r.idle_before_evict)
        f.histogram_of("vllm:kv_block_reuse_gap_seconds",
                       "Histogram of time gaps between consecutive KV cache block accesses. Only the most recent "
                       f"accesses are recorded (ring buffer). {sampled}", r.reuse_gap)
    info_labels = {**cache_config_labels(spec), "engine": spec.engine_index}
    info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                             labels=list(info_labels))
    info.add_metric(list(info_labels.values()), 1.0)
    f.out.append(info)
    return f.out


def _sglang(spec: WorkerSpec, s: EngineSnapshot) -> list[Metric]:
    c = s.counters
    f = _Families(SGLANG_LABELS, (spec.model, "unified", "0", "0"), c.created)
    max_tokens = spec.num_gpu_blocks * spec.block_size
    f.gauge("sglang:num_running_reqs", "The number of running requests.", s.running)
    f.gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.", s.waiting)
    f.gauge("sglang:num_used_tokens", "The number of used tokens.", round(s.kv_usage * max_tokens))
    f.gauge("sglang:token_usage", "The token usage.", s.kv_usage)
    f.gauge("sglang:max_total_num_tokens", "Maximum total number of tokens in the KV cache pool.", max_tokens)
    # SGLang's gauge is a recent-window rate; the simulator reports the cumulative ratio.
    rate = c.prefix_hits / c.prefix_queries if c.prefix_queries else 0.0
    f.gauge("sglang:cache_hit_rate", "The prefix cache hit rate.", rate)
    if spec.spec_tokens > 0:
        drafts = c.spec_drafts or 1
        f.gauge("sglang:spec_accept_length", "The average acceptance length of speculative decoding.",
                1.0 + c.spec_accepted_tokens / drafts if c.spec_drafts else 0.0)
        f.gauge("sglang:spec_accept_rate",
                "The average acceptance rate of speculative decoding (`accepted tokens / total draft tokens` in batch).",
                c.spec_accepted_tokens / c.spec_draft_tokens if c.spec_draft_tokens else 0.0)
    f.counter("sglang:prompt_tokens", "Number of prefill tokens processed.", c.prompt_tokens)
    f.counter("sglang:generation_tokens", "Number of generation tokens processed.", c.generation_tokens)
    f.counter("sglang:cached_tokens", "Number of cached prompt tokens.", c.prefix_hits)
    f.counter("sglang:num_requests", "Number of requests processed.", sum(c.requests_success.values()))
    f.histogram("sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                c.ttft, SGLANG_TTFT_BUCKETS)
    f.histogram("sglang:e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds",
                c.e2e, SGLANG_E2E_BUCKETS)
    f.histogram("sglang:queue_time_seconds", "Histogram of queueing time in seconds.", c.queue,
                SGLANG_QUEUE_BUCKETS)
    return f.out


class _Static:
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


def render_snapshot(spec: WorkerSpec, snapshot: EngineSnapshot, flavour: str = "vllm") -> bytes:
    if flavour == "sglang":
        families = _sglang(spec, snapshot)
    elif flavour in ("vllm", "vllm-legacy"):
        families = _vllm(spec, snapshot, legacy=flavour == "vllm-legacy")
    else:
        raise ValueError(f"unknown metrics flavour {flavour!r}; choose one of {', '.join(FLAVOURS)}")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Static(families))
    return generate_latest(registry)


def render_metrics(engine: SimEngine, flavour: str = "vllm") -> bytes:
    """The engine's /metrics page (Prometheus text format 0.0.4)."""
    return render_snapshot(engine.spec, engine.snapshot(), flavour)
