"""Worker and router /metrics text → the normalised snapshots of ``exporter.model``.

Workers: vLLM's current names, its pre-0.9.2 ``gpu_*`` names (0.9.2–0.11 emit both with equal
values, so the current name wins and nothing is counted twice) and SGLang's ``sglang:*``
names. Series are summed over vLLM's ``engine`` label (data-parallel engines behind one API
server). A signal the engine does not export stays ``None``.

Histograms a worker page carries are kept as the engine reports them (cumulative counts on its own
bounds, summed over engines, ranks and roles) and turned into observations by the state, scrape
over scrape: vLLM's sampled KV-block residency (``--kv-cache-metrics``, vLLM ≥ 0.14) and LMCache's
retrieve, store and lookup times.

Routers: one adapter per router in ``exporter.codecs.routers`` (SGLang gateway / sglang-router,
vllm-router, Dynamo's KV router, llm-d's scheduler), detected from the names present. Routers
label a worker by the URL they route to; given the configured workers, that URL is mapped to the
worker's name so router series join the worker's own series (and a worker the router reports
unhealthy is the same worker the exporter scrapes).

Values are checked before they are used (:func:`check_values`): a counter must be a finite
number ≥ 0, a ratio lie in [0, 1], a queue length be finite and ≥ 0, and ``cache_config_info``'s
``num_gpu_blocks``/``block_size`` be positive integers (or ``None``, vLLM's "not sized yet").
A sample that breaks its rule (``+Inf``, ``NaN``, a negative counter, ``num_gpu_blocks="-5"``)
is reported with the kind ``bad_value`` and its whole family is dropped from this scrape (the
other engines' samples alone would make a partial sum): the signal is missing, never wrong.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping

from exporter.codecs import promtext, routers
from exporter.codecs.promtext import ParseError, ParseResult, Sample
from exporter.codecs.routers.common import UnrecognisedMetrics, by_label, histogram, histogram_names, url_key
from exporter.model import CumulativeHistogram, RouterSnapshot, WorkerSnapshot

# ---- vLLM -----------------------------------------------------------------------------
V_QUERIES = "vllm:prefix_cache_queries_total"
V_HITS = "vllm:prefix_cache_hits_total"
V_USAGE = "vllm:kv_cache_usage_perc"
V_QUERIES_OLD = "vllm:gpu_prefix_cache_queries_total"
V_HITS_OLD = "vllm:gpu_prefix_cache_hits_total"
V_USAGE_OLD = "vllm:gpu_cache_usage_perc"
V_CACHE_CONFIG = "vllm:cache_config_info"
V_RUNNING = "vllm:num_requests_running"
V_WAITING = "vllm:num_requests_waiting"
V_PROMPT = "vllm:prompt_tokens_total"
V_SUCCESS = "vllm:request_success_total"
V_DRAFT = "vllm:spec_decode_num_draft_tokens_total"
V_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
# KV-connector / offload cache (vLLM ≥ 0.14) and cached tokens by the tier that served them (≥ 0.33)
V_EXT_QUERIES = "vllm:external_prefix_cache_queries_total"
V_EXT_HITS = "vllm:external_prefix_cache_hits_total"
V_CACHED_BY_SOURCE = "vllm:prompt_tokens_cached_by_source_total"
# The OffloadingConnector's CPU tier: the share of it in use (vLLM ≥ 0.33); its KV events say "CPU"
V_OFFLOAD_CPU_USAGE = "vllm:kv_offload_cpu_cache_usage_perc"
# Sampled KV-block residency (vLLM ≥ 0.14 with --kv-cache-metrics; v1/metrics/loggers.py): histograms
# with labels model_name, engine, on the kv_cache_residency bucket family
V_RESIDENCY = {"lifetime": "vllm:kv_block_lifetime_seconds",
               "idle_before_evict": "vllm:kv_block_idle_before_evict_seconds",
               "reuse_gap": "vllm:kv_block_reuse_gap_seconds"}
# LMCache (a KV connector inside vLLM): its hits count as external hits where vLLM's own are absent
L_REQUESTED = "lmcache:num_requested_tokens_total"
L_HITS = "lmcache:num_hit_tokens_total"
# What its lookups found (lmcache/observability.py): tokens asked for and tokens it held
L_LOOKUP_TOKENS = "lmcache:num_lookup_tokens_total"
L_LOOKUP_HITS = "lmcache:num_lookup_hits_total"
# Its time per operation, in seconds (labels model_name, worker_id, and in newer releases role and
# served_model_name): summed over every label set
L_SECONDS = {"retrieve": "lmcache:time_to_retrieve", "store": "lmcache:time_to_store",
             "lookup": "lmcache:time_to_lookup"}
WORKER_HISTOGRAM_NAMES = frozenset(n for fam in (*V_RESIDENCY.values(), *L_SECONDS.values())
                                   for n in histogram_names(fam))
# ---- SGLang ----------------------------------------------------------------------------
S_PROMPT = "sglang:prompt_tokens_total"
S_CACHED = "sglang:cached_tokens_total"
S_USAGE = "sglang:token_usage"
S_RUNNING = "sglang:num_running_reqs"
S_QUEUE = "sglang:num_queue_reqs"
S_REQUESTS = "sglang:num_requests_total"
S_HIT_RATE = "sglang:cache_hit_rate"  # a windowed gauge: used for detection only, never as tokens

VLLM_NAMES = frozenset({V_QUERIES, V_HITS, V_USAGE, V_QUERIES_OLD, V_HITS_OLD, V_USAGE_OLD, V_CACHE_CONFIG,
                        V_RUNNING, V_WAITING, V_PROMPT, V_SUCCESS, V_DRAFT, V_ACCEPTED,
                        V_EXT_QUERIES, V_EXT_HITS, V_CACHED_BY_SOURCE, V_OFFLOAD_CPU_USAGE, L_REQUESTED, L_HITS,
                        L_LOOKUP_TOKENS, L_LOOKUP_HITS}) | WORKER_HISTOGRAM_NAMES
SGLANG_NAMES = frozenset({S_PROMPT, S_CACHED, S_USAGE, S_RUNNING, S_QUEUE, S_REQUESTS, S_HIT_RATE})
WORKER_NAMES = VLLM_NAMES | SGLANG_NAMES

# ---- routers (one adapter per router: exporter.codecs.routers) ---------------------------------
ROUTER_NAMES = routers.NAMES

# ---- value rules ------------------------------------------------------------------------
def _count(v: float) -> bool:
    return 0.0 <= v < math.inf  # False for NaN too


def _ratio(v: float) -> bool:
    return 0.0 <= v <= 1.0


ValueRule = tuple[str, Callable[[float], bool]]
COUNT: ValueRule = ("a finite number ≥ 0", _count)
RATIO: ValueRule = ("a ratio in [0, 1]", _ratio)
VALUE_RULES: dict[str, ValueRule] = {
    **dict.fromkeys((V_QUERIES, V_HITS, V_QUERIES_OLD, V_HITS_OLD, V_PROMPT, V_SUCCESS, V_DRAFT, V_ACCEPTED,
                     V_EXT_QUERIES, V_EXT_HITS, V_CACHED_BY_SOURCE, L_REQUESTED, L_HITS, L_LOOKUP_TOKENS,
                     L_LOOKUP_HITS, V_RUNNING, V_WAITING, S_PROMPT, S_CACHED, S_REQUESTS, S_RUNNING, S_QUEUE,
                     *WORKER_HISTOGRAM_NAMES), COUNT),
    **dict.fromkeys((V_USAGE, V_USAGE_OLD, S_USAGE, S_HIT_RATE, V_OFFLOAD_CPU_USAGE), RATIO),
    **{name: COUNT for a in routers.ADAPTERS for name in a.counts},
    **{name: RATIO for a in routers.ADAPTERS for name in a.ratios},
}
# Integer labels of vLLM's cache_config_info; "None" is vLLM's own "not sized yet".
POSITIVE_INT_LABELS = {V_CACHE_CONFIG: ("num_gpu_blocks", "block_size")}


def _label_problem(name: str, sample: Sample) -> str | None:
    for label in POSITIVE_INT_LABELS.get(name, ()):
        raw = sample.labels.get(label)
        if raw is None or raw == "None":
            continue
        if not (raw.isascii() and raw.isdigit() and len(raw) <= 18 and int(raw) > 0):
            return f"{label}={raw[:40]!r} is not a positive integer"
    return None


def check_values(parsed: ParseResult) -> tuple[ParseResult, list[ParseError]]:
    """``parsed`` without the samples that break their name's value rule, and one error for each.

    One bad sample drops its whole name (a sum over the remaining engines would be wrong); a
    dropped name counts as present without samples (like an idle engine's families), so the
    page is still recognised and the signal stays missing.
    """
    kept: dict[str, list[Sample]] = {}
    other = set(parsed.other_names)
    rejected: list[ParseError] = []
    for name, samples in parsed.samples.items():
        rule = VALUE_RULES.get(name)
        bad = 0
        for s in samples:
            if rule is not None and not rule[1](s.value):
                problem = f"value {s.value!r} is not {rule[0]}"
            else:
                problem = _label_problem(name, s)
            if problem is not None:
                bad += 1
                excerpt = f"{name}{{{','.join(f'{k}={v!r}' for k, v in s.labels.items())}}} {s.value!r}"
                rejected.append(ParseError(0, excerpt[:promtext.EXCERPT_CHARS], problem, "bad_value"))
        if not bad:
            kept[name] = samples
        else:
            other.add(name)
    if not rejected:
        return parsed, []
    return ParseResult(samples=kept, errors=parsed.errors, lines=parsed.lines, other_names=other,
                       families=parsed.families), rejected


def _sum(samples: Iterable[Sample]) -> float | None:
    total = None
    for s in samples:
        total = s.value if total is None else total + s.value
    return total


def _first_present(parsed: ParseResult, *names: str) -> list[Sample] | None:
    for name in names:
        got = parsed.samples.get(name)
        if got:
            return got
    return None


def _engine_weighted_usage(usage: list[Sample], blocks_by_engine: dict[str, int]) -> float:
    """Worker KV usage over DP engines, weighted by each engine's block count when known."""
    if len(usage) == 1:
        return usage[0].value
    weights = [blocks_by_engine.get(s.labels.get("engine", ""), 0) for s in usage]
    if all(weights):
        return sum(s.value * w for s, w in zip(usage, weights, strict=True)) / sum(weights)
    return sum(s.value for s in usage) / len(usage)


def _int_label(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:  # "None" when vLLM has not sized the pool
        return None


def _model(*groups: list[Sample] | None) -> str | None:
    for group in groups:
        for s in group or ():
            model = s.labels.get("model_name")
            if model:
                return model
    return None


def _vllm(worker: str, p: ParseResult) -> WorkerSnapshot:
    queries = p.samples.get(V_QUERIES)
    legacy = queries is None and V_QUERIES_OLD in p.samples
    snap = WorkerSnapshot(worker=worker, flavour="vllm-legacy" if legacy else "vllm")
    queries = _first_present(p, V_QUERIES, V_QUERIES_OLD)
    hits = _first_present(p, V_HITS, V_HITS_OLD)
    snap.prefix_queried_tokens = _sum(queries or ())
    snap.prefix_hit_tokens = _sum(hits or ())
    blocks_by_engine: dict[str, int] = {}
    for s in p.samples.get(V_CACHE_CONFIG, ()):
        blocks = _int_label(s.labels.get("num_gpu_blocks"))
        if blocks is not None:
            blocks_by_engine[s.labels.get("engine", str(len(blocks_by_engine)))] = blocks
        if snap.block_size is None:
            snap.block_size = _int_label(s.labels.get("block_size"))
    if blocks_by_engine:
        snap.num_gpu_blocks = sum(blocks_by_engine.values())
    usage = _first_present(p, V_USAGE, V_USAGE_OLD)
    if usage:
        snap.kv_usage_ratio = _engine_weighted_usage(usage, blocks_by_engine)
    snap.running = _sum(p.samples.get(V_RUNNING, ()))
    snap.waiting = _sum(p.samples.get(V_WAITING, ()))
    snap.prompt_tokens = _sum(p.samples.get(V_PROMPT, ()))
    snap.requests_success = _sum(p.samples.get(V_SUCCESS, ()))
    snap.spec_draft_tokens = _sum(p.samples.get(V_DRAFT, ()))
    snap.spec_accepted_tokens = _sum(p.samples.get(V_ACCEPTED, ()))
    snap.external_queried_tokens = _sum(p.samples.get(V_EXT_QUERIES, ()))
    snap.external_hit_tokens = _sum(p.samples.get(V_EXT_HITS, ()))
    if snap.external_queried_tokens is None and snap.external_hit_tokens is None:
        snap.external_queried_tokens = _sum(p.samples.get(L_REQUESTED, ()))
        snap.external_hit_tokens = _sum(p.samples.get(L_HITS, ()))
    offload = p.samples.get(V_OFFLOAD_CPU_USAGE)
    if offload:  # a share of each engine's own tier: their mean is the worker's
        snap.offload_usage_ratio = {"CPU": sum(s.value for s in offload) / len(offload)}
    snap.tier_hit_tokens = by_label(p.samples.get(V_CACHED_BY_SOURCE, ()), "source") or None
    snap.residency = _histograms(p, V_RESIDENCY)
    snap.lmcache_seconds = _histograms(p, L_SECONDS)
    snap.lmcache_lookup_tokens = _sum(p.samples.get(L_LOOKUP_TOKENS, ()))
    snap.lmcache_lookup_hit_tokens = _sum(p.samples.get(L_LOOKUP_HITS, ()))
    snap.model = _model(queries, usage, p.samples.get(V_RUNNING), p.samples.get(V_PROMPT))
    return snap


def _histograms(p: ParseResult, families: Mapping[str, str]) -> dict[str, CumulativeHistogram] | None:
    """The families the page carries (each summed over its label sets), by key; None when it carries
    none of them (the engine runs without the flag, or without the connector: missing, not empty)."""
    out = {key: h for key, fam in families.items() if (h := histogram(p, fam)) is not None}
    return out or None


def _rank0(samples: list[Sample] | None) -> list[Sample]:
    """SGLang repeats scheduler numbers on every TP rank: keep rank 0 (or all if unlabelled)."""
    return [s for s in samples or () if s.labels.get("tp_rank", "0") == "0"]


def _sglang(worker: str, p: ParseResult) -> WorkerSnapshot:
    snap = WorkerSnapshot(worker=worker, flavour="sglang")
    prompt = _sum(_rank0(p.samples.get(S_PROMPT)))
    cached = p.samples.get(S_CACHED)
    if cached:
        # The device tier is the GPU prefix cache, the counterpart of vLLM's prefix_cache_hits;
        # host and storage tiers are extra reuse that vLLM also counts separately.
        device = [s for s in cached if s.labels.get("cache_source", "device") == "device"]
        snap.prefix_hit_tokens = _sum(device) or 0.0
        snap.tier_hit_tokens = by_label(_rank0(cached), "cache_source") or None
        # Only with a hit counter are the prompt tokens an honest denominator; with just the
        # windowed hit-rate gauge both stay missing rather than deflating the cluster ratio.
        snap.prefix_queried_tokens = prompt
    snap.prompt_tokens = prompt
    usage = _rank0(p.samples.get(S_USAGE))
    if usage:
        snap.kv_usage_ratio = sum(s.value for s in usage) / len(usage)
    snap.running = _sum(_rank0(p.samples.get(S_RUNNING)))
    snap.waiting = _sum(_rank0(p.samples.get(S_QUEUE)))
    snap.requests_success = _sum(_rank0(p.samples.get(S_REQUESTS)))
    snap.model = _model(p.samples.get(S_PROMPT), p.samples.get(S_USAGE), cached)
    return snap


def worker_from_parsed(worker: str, parsed: ParseResult) -> WorkerSnapshot:
    """Normalise parsed samples; raises UnrecognisedMetrics if no known name is present."""
    names = parsed.samples.keys()
    if any(n in VLLM_NAMES for n in names):
        return _vllm(worker, parsed)
    if any(n in SGLANG_NAMES for n in names):
        return _sglang(worker, parsed)
    # An engine that has served nothing yet still has its families (samples of other names, or
    # only # TYPE lines, as prometheus_client writes a labelled family before its first sample):
    # it is up, with every value missing.
    declared = parsed.other_names | parsed.families
    if any(n.startswith("vllm:") for n in declared):
        return WorkerSnapshot(worker=worker, flavour="vllm")
    if any(n.startswith("sglang:") for n in declared):
        return WorkerSnapshot(worker=worker, flavour="sglang")
    raise UnrecognisedMetrics(f"no vLLM or SGLang metric among {parsed.lines} sample lines")


def parse_worker(worker: str, text: str, deadline: float | None = None,
                 cache: promtext.SeriesCache | None = None) -> tuple[WorkerSnapshot, list[ParseError]]:
    """Worker /metrics text → snapshot and rejected lines and values; raises UnrecognisedMetrics.

    ``deadline`` (``time.monotonic()``) bounds the parse (``promtext.ParseTimeout``); ``cache``
    keeps parsed label sets for the next page (``promtext.SeriesCache``).
    """
    parsed, rejected = check_values(promtext.parse(text, WORKER_NAMES, deadline, cache))
    snap = worker_from_parsed(worker, parsed)
    for name in snap.__slots__:  # finite samples can still sum past the float range
        value = getattr(snap, name)
        if isinstance(value, float) and not math.isfinite(value):
            setattr(snap, name, None)
            rejected.append(ParseError(0, f"{name} {value!r}", "the samples' sum is not a finite number", "bad_value"))
    for tier, value in list((snap.tier_hit_tokens or {}).items()):
        if not math.isfinite(value):
            del snap.tier_hit_tokens[tier]  # type: ignore[union-attr]
            rejected.append(ParseError(0, f"tier {tier} {value!r}", "the samples' sum is not a finite number", "bad_value"))
    return snap, parsed.errors + rejected


def worker_names_by_url(workers: Iterable[tuple[str, str]]) -> dict[str, str]:
    """(name, metrics_url) pairs → {the worker's base URL, as a router labels it: name}.

    A router is given a worker's base URL (``http://host:port``); its /metrics sits under it.
    """
    out: dict[str, str] = {}
    for name, metrics_url in workers:
        base = url_key(metrics_url)
        out[base.removesuffix("/metrics")] = name
    return out


def router_from_parsed(router: str, parsed: ParseResult, kind: str = "auto",
                       worker_names: Mapping[str, str] | None = None,
                       max_tree_size: int | None = None) -> RouterSnapshot:
    """``kind`` "auto" detects the router from the names present (``exporter.codecs.routers``);
    otherwise that router's adapter is used as given.

    ``worker_names`` is :func:`worker_names_by_url` of the configured workers; ``max_tree_size``
    the router's ``--max-tree-size`` when it is not the router's default.
    """
    adapter = routers.adapter_for(kind, [*parsed.samples, *parsed.other_names])
    snap = adapter.build(router, parsed, worker_names)
    if snap.largest_tree is not None:
        snap.tree_bound = max_tree_size or adapter.tree_bound
    return snap


def parse_router(router: str, text: str, kind: str = "auto", worker_names: Mapping[str, str] | None = None,
                 deadline: float | None = None,
                 max_tree_size: int | None = None,
                 cache: promtext.SeriesCache | None = None) -> tuple[RouterSnapshot, list[ParseError]]:
    """Router /metrics text → snapshot and rejected lines and values; raises UnrecognisedMetrics."""
    parsed, rejected = check_values(promtext.parse(text, ROUTER_NAMES, deadline, cache))
    if kind != "auto" and not parsed.samples and not parsed.other_names:
        raise UnrecognisedMetrics(f"no metric at all among {parsed.lines} sample lines")
    snap = router_from_parsed(router, parsed, kind, worker_names, max_tree_size)
    for values in (snap.decisions, snap.healthy, snap.prefix_outcomes):
        for key in [k for k, v in values.items() if not math.isfinite(v)]:  # sums past the float range
            rejected.append(ParseError(0, f"{key} {values.pop(key)!r}", "the samples' sum is not a finite number",
                                       "bad_value"))
    return snap, parsed.errors + rejected
