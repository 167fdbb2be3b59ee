"""The reference router's /metrics in a real router's own names: one flavour per router.

Real deployments put sglang-router / the SGLang model gateway (smg), vllm-router, Dynamo's KV
router or llm-d's scheduler (EPP) in front of the engines; each exports its routing in its own
series. The simulated router can speak any one of them (``router_metrics`` in the topology file,
``--router-metrics`` on ``prefixscope sim``), so the exporter's router adapters can be exercised
against a router whose every decision is known.

:data:`SERIES` is the table: one :class:`RouterSeries` row per flavour and series — its name,
type, label set and unit exactly as the real router exports them (sources in :data:`FLAVOURS`
and the signals reference), the catalogue signal it feeds (the ``RouterSnapshot`` field the
exporter's adapter fills from it) and the tally quantity behind its value. The fleet does not
import the exporter; a contract test holds this table and the adapters' names together.

:class:`RouterMetrics` keeps the tally (decisions per worker, lookup outcomes, histograms on the
flavour's own bounds) and renders the page. Like a Prometheus client library, it shows unlabelled
series from the start (0, empty histograms) and a labelled one once its label set was used;
worker health is shown for every worker in the router's pool. Under a policy that walks no
prefix index (round-robin, hashing) the prefix series are left out, as the real routers export
them from their cache-aware / KV-aware policy only.

The SGLang gateway's tree gauges (``smg_cache_tree_chars``/``smg_cache_tree_tokens``) come from
:class:`TreeSize`: the size of its cache-aware string tree, kept as the gateway keeps it in front
of HTTP workers — the text of each routed request inserted under the picked worker (a prefix
several workers hold counts once per worker), trimmed least recently used first at each eviction
pass (every ``--eviction-interval-secs``) to ``--max-tree-size`` characters per model, and
reported only from the first pass on.
"""

from __future__ import annotations

import math
import threading
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from fleet.histogram import Histogram

NONE = "none"
DEFAULT_FLAVOUR = "sglang"  # the demo's: decisions, outcomes, health and the match ratio

WORKER = "{worker}"  # a label value standing for the worker's URL (real routers label workers by URL)
MODEL = "{model}"  # a label value standing for the served model
POLICY = "{policy}"  # a label value standing for the routing policy, in the real router's spelling

# The tally quantities a series can show (RouterSeries.value).
DECISIONS = "decisions"  # per worker: requests routed there
DECISIONS_OK = "decisions_ok"  # per worker: ... that the engine accepted
DECISIONS_FAILED = "decisions_failed"  # per worker: ... that the engine refused
HEALTHY = "healthy"  # per worker: 1 in the router's healthy set, 0 in its pool but not healthy
HITS = "hits"  # index lookups whose pick was predicted to hold a cached prefix
MISSES = "misses"  # index lookups whose pick was not
LOOKUPS = "lookups"  # every index lookup
LOOKUP_HITS = "lookup_hits"  # index lookups where some worker held a prefix (llm-d's "best candidate")
PREDICTED_RATIO = "predicted_ratio"  # histogram: predicted cached share of the prompt on the pick
WALK_SECONDS = "walk_seconds"  # histogram: the index walk's latency (seconds, before ``scale``)
TREE_CHARS = "tree_chars"  # per model: characters in the string tree (HTTP routing), at the last eviction pass
TREE_TOKENS = "tree_tokens"  # per model: tokens in the token tree (gRPC routing: none in front of HTTP workers)
PER_WORKER = frozenset({DECISIONS, DECISIONS_OK, DECISIONS_FAILED, HEALTHY})
HISTOGRAMS = frozenset({PREDICTED_RATIO, WALK_SECONDS})
PER_MODEL = frozenset({TREE_CHARS, TREE_TOKENS})
# Signals only a prefix-aware policy produces: a router routing round-robin exports none of them.
PREFIX_SIGNALS = frozenset({"prefix_outcomes", "predicted_hit_ratio", "lookup_seconds", "largest_tree"})
# The SGLang gateway's cache-aware tree (smg launch defaults; its docs' "Cache-aware routing")
SMG_MAX_TREE_SIZE = 67_108_864  # --max-tree-size: characters (string tree) per model, shared by its workers
SMG_EVICTION_INTERVAL_S = 120.0  # --eviction-interval-secs


@dataclass(frozen=True, slots=True)
class Label:
    name: str
    value: str  # a literal, or WORKER / POLICY


@dataclass(frozen=True, slots=True)
class RouterSeries:
    """One series of one flavour (a histogram is one row: its ``_bucket``/``_sum``/``_count``)."""

    flavour: str
    signal: str  # the RouterSnapshot field the exporter fills from it
    name: str  # the family name (a histogram's base name)
    type: str  # counter, gauge or histogram
    value: str  # the tally quantity it shows
    labels: tuple[Label, ...] = ()
    buckets: tuple[float, ...] = ()  # a histogram's finite upper bounds, in the series' unit
    scale: float = 1.0  # tally unit -> series unit (1000: a latency in milliseconds)
    help: str = ""

    @property
    def sample_names(self) -> tuple[str, ...]:
        if self.type == "histogram":
            return f"{self.name}_bucket", f"{self.name}_sum", f"{self.name}_count"
        return (self.name,)


@dataclass(frozen=True, slots=True)
class Flavour:
    name: str
    adapter: str  # the exporter's router kind that reads this flavour
    source: str  # where the names, labels and units come from


FLAVOURS: dict[str, Flavour] = {f.name: f for f in (
    Flavour("sglang", "sglang-router",
            "SGLang model gateway smg >= 1.11 (smg-project/smg model_gateway/src/observability/metrics.rs)"),
    Flavour("sglang-legacy", "sglang-router", "sglang-router <= 0.2.4 (sgl-project/sglang sgl-router/src/metrics.rs)"),
    Flavour("vllm-router", "vllm-router", "vllm-router 0.1.17 (vllm-project/router src/metrics.rs and the wheel)"),
    Flavour("dynamo", "dynamo", "Dynamo KV router (ai-dynamo/dynamo lib/llm/src/kv_router/metrics.rs)"),
    Flavour("llm-d", "llm-d", "llm-d EPP with kvBlockIndexConfig.enableMetrics (llm-d/llm-d-router docs/metrics.md)"),
)}
CHOICES: tuple[str, ...] = (*FLAVOURS, NONE)

# Bucket bounds as each router declares them.
DECILES = tuple(round(0.1 * i, 10) for i in range(1, 11))  # smg_cache_aware_match_ratio
DYNAMO_HIT_RATE = tuple(round(0.05 * i, 10) for i in range(21))  # linear_buckets(0.0, 0.05, 21)
DYNAMO_ASYNC_MS = tuple(round(0.01 * 3 ** i, 10) for i in range(17))  # exponential_buckets(0.01, 3.0, 17)
PROMETHEUS_DEFAULT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)  # client_golang DefBuckets

_W = Label("worker", WORKER)
_DYNAMO = (Label("dynamo_namespace", "sim"), Label("dynamo_component", "router"), Label("router_id", "1"))

SERIES: tuple[RouterSeries, ...] = (
    # SGLang model gateway (smg >= 1.11) in front of HTTP workers: its text tree times no lookup
    RouterSeries("sglang", "decisions", "smg_worker_cb_outcomes_total", "counter", DECISIONS_OK,
                 (_W, Label("outcome", "success")), help="Circuit-breaker outcomes per worker"),
    RouterSeries("sglang", "decisions", "smg_worker_cb_outcomes_total", "counter", DECISIONS_FAILED,
                 (_W, Label("outcome", "failure")), help="Circuit-breaker outcomes per worker"),
    RouterSeries("sglang", "healthy", "smg_worker_health", "gauge", HEALTHY, (_W,),
                 help="Worker health (1 healthy, 0 unhealthy)"),
    RouterSeries("sglang", "prefix_outcomes", "smg_cache_aware_policy_branch_total", "counter", HITS,
                 (Label("branch", "tree_match"),), help="Cache-aware policy branch taken"),
    RouterSeries("sglang", "prefix_outcomes", "smg_cache_aware_policy_branch_total", "counter", MISSES,
                 (Label("branch", "spill"),), help="Cache-aware policy branch taken"),
    RouterSeries("sglang", "predicted_hit_ratio", "smg_cache_aware_match_ratio", "histogram", PREDICTED_RATIO,
                 buckets=DECILES, help="Best prefix match divided by the input length"),
    RouterSeries("sglang", "largest_tree", "smg_cache_tree_tokens", "gauge", TREE_TOKENS, (Label("model", MODEL),),
                 help="Cache-aware token tree cached tokens by model (summed across tenants)"),
    RouterSeries("sglang", "largest_tree", "smg_cache_tree_chars", "gauge", TREE_CHARS, (Label("model", MODEL),),
                 help="Cache-aware string tree cached characters by model (summed across tenants)"),
    # sglang-router <= 0.2.4
    RouterSeries("sglang-legacy", "decisions", "sgl_router_policy_decisions_total", "counter", DECISIONS,
                 (Label("policy", POLICY), _W), help="Routing decisions by policy and worker"),
    RouterSeries("sglang-legacy", "prefix_outcomes", "sgl_router_cache_hits_total", "counter", HITS,
                 help="Cache-aware routing hits"),
    RouterSeries("sglang-legacy", "prefix_outcomes", "sgl_router_cache_misses_total", "counter", MISSES,
                 help="Cache-aware routing misses"),
    # vllm-router
    RouterSeries("vllm-router", "decisions", "vllm_router_policy_decisions_total", "counter", DECISIONS,
                 (Label("policy", POLICY), _W), help="Routing decisions by policy and worker"),
    RouterSeries("vllm-router", "prefix_outcomes", "vllm_router_prefix_routing_decisions_total", "counter", HITS,
                 (Label("policy", POLICY), Label("stage", "regular"), Label("outcome", "prefix_hit")),
                 help="Prefix routing decisions by outcome"),
    RouterSeries("vllm-router", "prefix_outcomes", "vllm_router_prefix_routing_decisions_total", "counter", MISSES,
                 (Label("policy", POLICY), Label("stage", "regular"), Label("outcome", "prefix_miss")),
                 help="Prefix routing decisions by outcome"),
    RouterSeries("vllm-router", "healthy", "vllm_router_worker_health", "gauge", HEALTHY, (_W,),
                 help="Worker health (1 healthy, 0 unhealthy)"),
    # Dynamo KV router (no per-worker decision, outcome or health series)
    RouterSeries("dynamo", "predicted_hit_ratio", "dynamo_component_router_kv_hit_rate", "histogram",
                 PREDICTED_RATIO, _DYNAMO, buckets=DYNAMO_HIT_RATE,
                 help="Predicted KV cache hit rate at routing time (0.0-1.0)"),
    RouterSeries("dynamo", "lookup_seconds", "dynamo_router_overhead_indexer_find_matches_ms", "histogram",
                 WALK_SECONDS, (Label("router_id", "1"),), buckets=DYNAMO_ASYNC_MS, scale=1000.0,
                 help="Time spent in indexer find_matches in milliseconds"),
    # llm-d EPP, KV-cache index metrics (no per-worker decision or health series)
    RouterSeries("llm-d", "prefix_outcomes", "llm_d_epp_kv_cache_index_lookup_requests_total", "counter", LOOKUPS,
                 help="Total number of KV-cache index lookups"),
    RouterSeries("llm-d", "prefix_outcomes", "llm_d_epp_kv_cache_index_lookup_hits_total", "counter", LOOKUP_HITS,
                 help="Total number of KV-cache index lookups that found a cached prefix"),
    RouterSeries("llm-d", "lookup_seconds", "llm_d_epp_kv_cache_index_lookup_latency_seconds", "histogram",
                 WALK_SECONDS, buckets=PROMETHEUS_DEFAULT, help="Latency of KV-cache index lookups in seconds"),
)


def series_of(flavour: str) -> tuple[RouterSeries, ...]:
    return tuple(s for s in SERIES if s.flavour == flavour)


def names_of(flavour: str) -> frozenset[str]:
    """Every sample name the flavour's page can carry."""
    return frozenset(n for s in series_of(flavour) for n in s.sample_names)


def check_flavour(flavour: str) -> str:
    if flavour not in CHOICES:
        raise ValueError(f"unknown router_metrics flavour {flavour!r}; choose one of {', '.join(CHOICES)}")
    return flavour


def policy_label(policy: str) -> str:
    """The simulator's policy in the real routers' spelling (both prefix-aware ones are cache_aware)."""
    return "cache_aware" if policy in ("prefix-tree", "topology-aware") else policy.replace("-", "_")


@dataclass(frozen=True, slots=True)
class Lookup:
    """One walk of the router's prefix index."""

    walk_s: float  # its latency (modelled on a virtual clock, plus any injected delay)
    predicted_ratio: float  # the share of the prompt predicted cached on the pick
    pick_matched: bool  # the pick was predicted to hold a prefix: a hit
    any_matched: bool  # some worker was believed to hold a prefix
    # for the tree's size: the prompt's characters the pick's tree did not hold yet, the model
    # and when (the router's clock)
    new_chars: int = 0
    model: str = "sim-model"
    at: float = 0.0


@dataclass(frozen=True, slots=True)
class Routed:
    """One routing decision as the router's own metrics count it."""

    worker: str
    accepted: bool  # the engine took the request (False: it refused it)
    lookup: Lookup | None  # None when the policy walked no index


class TreeSize:
    """The size of the SGLang gateway's string tree per model, without its text.

    Each tenant (worker) holds the characters inserted under it; what a request adds is the part
    of its text the picked worker's branch did not hold (the router's own prefix index stands in
    for the tree's match, so text the worker's engine evicted meanwhile is counted again, as a
    tree that was trimmed would insert it again). An eviction pass trims a model's tree that is
    over ``max_size`` back to it — in the gateway, leaves least recently used first; here every
    tenant in proportion, which leaves the same size — and sets the gauge. Passes run every
    ``interval_s`` from the first request on, as the router's clock reaches them.
    """

    def __init__(self, max_size: int = SMG_MAX_TREE_SIZE, interval_s: float = SMG_EVICTION_INTERVAL_S) -> None:
        if max_size <= 0 or interval_s <= 0:
            raise ValueError("max_size and interval_s must be positive")
        self.max_size, self.interval_s = max_size, interval_s
        self.chars: dict[str, Counter[str]] = {}  # model -> tenant -> characters
        self.reported: dict[str, int] = {}  # model -> characters at the last pass (empty before the first)
        self.passes = 0
        self._next: float | None = None

    def insert(self, model: str, tenant: str, chars: int, at: float) -> None:
        self.advance(at)
        if self._next is None:
            self._next = at + self.interval_s  # the eviction loop's first pass, an interval after start
        self.chars.setdefault(model, Counter())[tenant] += max(0, chars)

    def advance(self, at: float) -> None:
        """Run the passes due by ``at``."""
        while self._next is not None and self._next <= at:
            self._evict()
            self._next += self.interval_s

    def _evict(self) -> None:
        self.passes += 1
        for model, tenants in self.chars.items():
            total = sum(tenants.values())
            if total > self.max_size:
                keep = self.max_size / total
                for t in tenants:
                    tenants[t] = int(tenants[t] * keep)
            self.reported[model] = sum(tenants.values())


class RouterMetrics:
    """The tally behind one flavour's page, and the page itself. Thread-safe (HTTP renders while
    the driving thread routes)."""

    def __init__(self, flavour: str) -> None:
        self.flavour = check_flavour(flavour)
        self.series = series_of(flavour)
        self._lock = threading.Lock()
        self.decisions: Counter[str] = Counter()
        self.failed: Counter[str] = Counter()
        self.totals: Counter[str] = Counter()  # HITS, MISSES, LOOKUPS, LOOKUP_HITS
        self.histograms: dict[str, Histogram] = {s.name: Histogram(s.buckets) for s in self.series
                                                 if s.type == "histogram"}
        self.tree = TreeSize() if any(s.value in PER_MODEL for s in self.series) else None

    def observe(self, routed: Routed) -> None:
        with self._lock:
            self.decisions[routed.worker] += 1
            if not routed.accepted:
                self.failed[routed.worker] += 1
            lk = routed.lookup
            if lk is None:
                return
            self.totals[LOOKUPS] += 1
            self.totals[HITS if lk.pick_matched else MISSES] += 1
            self.totals[LOOKUP_HITS] += lk.any_matched
            if self.tree is not None:
                self.tree.insert(lk.model, routed.worker, lk.new_chars, lk.at)
            for s in self.series:
                if s.type == "histogram":
                    raw = lk.predicted_ratio if s.value == PREDICTED_RATIO else lk.walk_s
                    self.histograms[s.name].observe(raw * s.scale)

    def _worker_values(self, value: str, health: Mapping[str, bool]) -> dict[str, float]:
        if value == HEALTHY:
            return {w: float(ok) for w, ok in health.items()}
        if value == DECISIONS:
            return {w: float(n) for w, n in self.decisions.items()}
        if value == DECISIONS_FAILED:
            return {w: float(n) for w, n in self.failed.items() if n}
        return {w: float(n - self.failed[w]) for w, n in self.decisions.items() if n > self.failed[w]}

    def render(self, health: Mapping[str, bool], policy: str = "topology-aware",
               worker_label: Callable[[str], str] = str, prefix_aware: bool = True) -> str:
        """The page: ``health`` is the router's pool (worker -> healthy), ``worker_label`` names a
        worker as the router labels it (its URL); ``prefix_aware``: the policy walks the index."""
        pol = policy_label(policy)
        shown = [s for s in self.series if prefix_aware or s.signal not in PREFIX_SIGNALS]
        lines: list[str] = []
        with self._lock:
            for name in dict.fromkeys(s.name for s in shown):
                rows = [s for s in shown if s.name == name]
                samples: list[str] = []
                for s in rows:
                    samples += self._samples(s, health, pol, worker_label)
                if samples:
                    lines += [f"# HELP {name} {rows[0].help}", f"# TYPE {name} {rows[0].type}", *samples]
        return "\n".join(lines) + "\n" if lines else ""

    def _samples(self, s: RouterSeries, health: Mapping[str, bool], policy: str,
                 worker_label: Callable[[str], str]) -> list[str]:
        def labels(worker: str | None = None, extra: str = "", model: str = "") -> str:
            parts = [f'{lb.name}="{_escape(_value(lb.value, worker, policy, worker_label, model))}"'
                     for lb in s.labels]
            if extra:
                parts.append(extra)
            return "{" + ",".join(parts) + "}" if parts else ""

        if s.type == "histogram":
            h = self.histograms[s.name]
            out = [f"{s.name}_bucket{labels(extra=_le(b))} {c}" for b, c in h.cumulative()]
            return [*out, f"{s.name}_sum{labels()} {_num(h.sum)}", f"{s.name}_count{labels()} {h.count}"]
        if s.value in PER_WORKER:
            values = self._worker_values(s.value, health)
            return [f"{s.name}{labels(w)} {_num(v)}" for w, v in sorted(values.items())]
        if s.value in PER_MODEL:  # set at the tree's eviction passes: absent before the first
            reported = self.tree.reported if self.tree is not None else {}
            return [f"{s.name}{labels(model=m)} {n if s.value == TREE_CHARS else 0}" for m, n in sorted(reported.items())]
        n = self.totals[s.value]
        if s.labels and not n:
            return []  # a labelled series exists once its label set was used
        return [f"{s.name}{labels()} {n}"]


def _value(value: str, worker: str | None, policy: str, worker_label: Callable[[str], str], model: str = "") -> str:
    if value == WORKER:
        assert worker is not None
        return worker_label(worker)
    if value == MODEL:
        return model
    return policy if value == POLICY else value


def _num(v: float) -> str:
    f = float(v)
    if math.isinf(f):
        return "+Inf" if f > 0 else "-Inf"
    return str(int(f)) if f.is_integer() and abs(f) < 1e15 else repr(f)


def _le(bound: float) -> str:
    return f'le="{_num(bound)}"'


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
