"""Real sglang-router and vllm-router in front of simulated workers that export vLLM's OTLP spans:
the checklist lit with no request record posted at all, each value against the fleet's own truth.

The stack is what an operator runs: vLLM workers with ``--otlp-traces-endpoint`` pointed at the
exporter (one ``llm_request`` span per request, ``service.instance.id`` naming the worker), an
unmodified router, a topology file (nodes, NVLink domains, GPU prices, the warm pool), and an
application instrumented with OpenTelemetry's GenAI client conventions: its ``chat MODEL`` span
carries the conversation (``gen_ai.conversation.id``) and, from the response's usage, the cached
tokens (``gen_ai.usage.cache_read.input_tokens``); its ``traceparent`` goes through the router
(both forward it), so vLLM's span is its child and the exporter joins the two by trace.

Traffic: five conversations on distinct long prefixes (a baseline phase), then — a window and a
baseline slot later, so the first phase is the cold-prefill baseline and out of the window —
a follow-up of each, the kill of a worker serving some of them, and further follow-ups that
migrate off it. Ground truth is the engines' own results (each request's worker, prompt, cached
tokens and prefill time, joined to its conversation by the trace), the engines' counters and
caches, the kill and the topology file.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import yaml

from exporter.codecs import otlp
from exporter.config import OtlpTraces
from exporter.core.baseline_window import SLOT_S
from exporter.core.windows import bucket_index, histogram_quantile
from exporter.sources.otlp_spans import SpanResult
from fleet.engine import EngineResult
from fleet.spans import FleetSpans, GenAiClient
from fleet.worker_http import WORKER_HEADER
from fleet.workers import Placement
from prefixscope import catalog
from prefixscope.catalog import PLACEMENT_CONTINUATION_S
from prefixscope.thresholds import load_thresholds
from tests.e2e.router_stack import (
    CAPACITY_BLOCKS,
    COUNTERS,
    FED_BY_SPANS_AND_TOPOLOGY,
    MODEL,
    TOKEN,
    Stack,
    StackOptions,
    open_stack,
    settle,
)
from tests.e2e.routers import ENDPOINT, KINDS, TOPICS, post
from tests.support import free_port, wait_for

P = catalog.NAMESPACE
WINDOW_S = 60.0
SESSIONS = len(TOPICS)
COLD_SHARE = load_thresholds().cold_reuse_share  # a "cold" request reused at most this share
CONVERSATION = "gen_ai.conversation.id"
CLOCK_READS_S = 0.005  # the router's latency timer and its span's end are two reads of the clock
# The checklist: steps 1-5 without the two checks added beyond it.
CHECKLIST = tuple(c.key for c in catalog.CHECKS if c.kind == "checklist" and c.group in (1, 2, 3, 4, 5)
                  and c.key not in ("prefix_cache_thrash", "prefix_root_instability"))
# What no source of this stack carries: the router's tree-walk time (sglang-router's own spans do
# not time it either: the last test below), async KV-load waits, MoE expert routing and batch
# admission reasons, and block residency (the simulated engines run without vLLM's
# --kv-cache-metrics). (Placement has no prompt block hashes either: it is judged from KV events.)
DARK = {"prefix_tree_walk_latency", "async_prefill_wait_time_p99", "prefix_cache_retention",
        "moe_expert_alignment_rate", "continuous_batching_affinity_admission_rate"}

# The operator's topology: two nodes, w0 and w1 share node-a (w0 the warm pool), w2 is on node-b.
TOPOLOGY = {
    "schema": "prefixscope.topology/v1", "model": MODEL, "block_size": 16,
    "gpu_classes": {
        "H100": {"prefill_tps": 20000, "decode_tps": 100, "kv_blocks": CAPACITY_BLOCKS, "intra_node_gbps": 450,
                 "inter_node_gbps": 50, "price_per_gpu_hour": 4.0, "max_concurrency": 32},
        "A100": {"prefill_tps": 8000, "decode_tps": 60, "kv_blocks": CAPACITY_BLOCKS, "intra_node_gbps": 300,
                 "inter_node_gbps": 25, "price_per_gpu_hour": 2.0, "max_concurrency": 32},
    },
    "workers": [
        {"name": "w0", "node": "node-a", "nvlink_domain": "node-a/nvl0", "gpu_class": "H100", "gpus": 2,
         "warm_pool": True},
        {"name": "w1", "node": "node-a", "nvlink_domain": "node-a/nvl0", "gpu_class": "H100", "gpus": 2},
        {"name": "w2", "node": "node-b", "nvlink_domain": "node-b/nvl0", "gpu_class": "A100", "gpus": 1},
    ],
}


# ---- ground truth: the engines' results, joined to their conversation by the trace --------------
@dataclass(frozen=True)
class Served:
    end: float  # when the engine finished it (the span's end: the record's time)
    session: str
    worker: str
    prompt: int
    cached: int
    prefill_s: float
    hashes: tuple[int, ...]
    request_id: str = ""


class Truth:
    """Every request the engines served, with the conversation its client span named."""

    def __init__(self) -> None:
        self.results: list[tuple[EngineResult, str]] = []  # (result, trace id)
        self.sessions: dict[str, str] = {}  # trace id -> conversation

    def on_request(self, r: EngineResult, headers: Mapping[str, str], _path: str) -> None:
        self.results.append((r, headers.get("traceparent", "").split("-")[1] if "traceparent" in headers else ""))

    def served(self) -> list[Served]:
        out = [Served(r.arrival + r.e2e_s, self.sessions[t], r.worker, r.prompt_tokens, r.cached_tokens,
                      r.prefill_s, tuple(r.block_hashes), r.request_id) for r, t in self.results]
        return sorted(out, key=lambda s: s.end)


def turn(client: GenAiClient, truth: Truth, base: str, endpoint: str, session: int, i: int) -> str:
    """One turn of conversation ``session`` through the router → the worker that served it."""
    with client.call(MODEL, f"conv-{session}") as (span, headers):
        truth.sessions[f"{span.get_span_context().trace_id:032x}"] = f"conv-{session}"
        r = post(f"{base}", endpoint, session, i, headers=headers)
        assert r.status_code == 200, r.text
        client.record_usage(span, r.json()["usage"])
    return r.headers[WORKER_HEADER]


@dataclass(frozen=True)
class Moves:
    followups: int
    collisions: int
    migrations: int
    cross_node: int
    followup_prompt: int
    followup_cached: int


def session_moves(served: list[Served], since: float, down: Mapping[str, float], node: Mapping[str, str]) -> Moves:
    """Follow-ups served after ``since``: moved off a healthy worker (a collision) or off one that
    was down (``down``: worker -> when it died) — a migration, cross-node when the nodes differ."""
    last: dict[str, str] = {}
    n = coll = mig = cross = prompt = cached = 0
    for s in served:
        prev = last.get(s.session)
        last[s.session] = s.worker
        if prev is None or s.end <= since:
            continue
        n += 1
        prompt += s.prompt
        cached += s.cached
        if prev != s.worker:
            if prev in down and down[prev] < s.end:
                mig += 1
                cross += node[prev] != node[s.worker]
            else:
                coll += 1
    return Moves(n, coll, mig, cross, prompt, cached)


def cold_p99_ratio(window: list[Served], baseline: list[Served]) -> float | None:
    """max over prompt classes of p99(cold prefill in the window) / p99(cold prefill in the baseline),
    on the exporter's bucket layout (as the recording rules read it)."""
    bounds = catalog.METRICS_BY_NAME[f"{P}_cold_prefill_seconds"].buckets
    assert bounds is not None

    def p99s(served: list[Served]) -> dict[str, float]:
        rows: dict[str, list[int]] = defaultdict(lambda: [0] * (len(bounds) + 1))
        for s in served:
            if s.cached <= COLD_SHARE * s.prompt:
                rows[catalog.prompt_class(s.prompt)][bucket_index(bounds, s.prefill_s)] += 1
        return {k: q for k, row in rows.items() if (q := histogram_quantile(0.99, bounds, row)) is not None}

    now, base = p99s(window), p99s(baseline)
    ratios = [now[k] / base[k] for k in now if base.get(k)]
    return max(ratios) if ratios else None


def cold_cost_per_request(window: list[Served]) -> float | None:
    """Σ cold prefill × GPUs × the GPU class's hourly price / cold requests (the topology's prices)."""
    workers = {w["name"]: w for w in TOPOLOGY["workers"]}
    cold = [s for s in window if s.cached <= COLD_SHARE * s.prompt]
    if not cold:
        return None
    usd = sum(s.prefill_s * workers[s.worker]["gpus"]
              * TOPOLOGY["gpu_classes"][workers[s.worker]["gpu_class"]]["price_per_gpu_hour"] / 3600.0 for s in cold)
    return usd / len(cold)


def kv_placement_ratio(window: list[Served], placements: Mapping[str, Placement]) -> float | None:
    """Σ in-domain / Σ judged over the requests that stored blocks (each publishes one BlockStored:
    the fleet does not chunk, and no turn follows its worker's last store of the conversation
    within the continuation window) while some live worker held a prefix of their prompt: judged
    where the fleet's own caches held the longest prefix when the request was admitted."""
    domain = {w["name"]: w["nvlink_domain"] for w in TOPOLOGY["workers"]}
    judged = [p for s in window if (p := placements[s.request_id]).stores and p.holders]
    if not judged:
        return None
    return sum(domain[p.worker] in {domain[h] for h in p.holders} for p in judged) / len(judged)


def outside_its_domain(s: Stack, served: list[Served]) -> tuple[int, str]:
    """A conversation and a worker of an NVLink domain that holds none of the workers with the
    longest cached prefix of its last prompt (the fleet's caches; conversations share a first
    block or two, so only the deepest holders say where the conversation lives)."""
    domain = {w["name"]: w["nvlink_domain"] for w in TOPOLOGY["workers"]}
    last = {x.session: x for x in served}
    for session, x in sorted(last.items()):
        depth = {w.name: w.engine.cache.match(x.hashes) for w in s.fleet}
        holders = {domain[w] for w, d in depth.items() if d == max(depth.values())}
        for away in ("w2", "w0"):
            if domain[away] not in holders:
                return int(session.split("-")[1]), away
    raise AssertionError(f"every conversation's prefix is cached in every domain: {sorted(last)}")


def radix_leaf_depth_p99(chains: list[tuple[int, ...]], resident: set[int]) -> float | None:
    """p99 of the leaves' radix depth (runs without a branch count once) of the tree the resident
    blocks form, on the exporter's depth buckets."""
    children: dict[int | None, set[int]] = defaultdict(set)
    for chain in chains:
        parent: int | None = None
        for h in chain:
            if h not in resident:
                break
            children[parent].add(h)
            parent = h
    depths: Counter[int] = Counter()
    stack: list[tuple[int | None, int]] = [(None, 0)]
    while stack:
        node, depth = stack.pop()
        kids = children.get(node, set())
        if node is not None and not kids:
            depths[depth] += 1
        for k in kids:
            # a new radix node starts under the root and under every branching block
            stack.append((k, depth + 1 if node is None or len(kids) > 1 else depth))
    bounds = catalog.DEPTH_BUCKETS
    row = [0] * (len(bounds) + 1)
    for d, n in depths.items():
        row[bucket_index(bounds, d)] += n
    return histogram_quantile(0.99, bounds, row)


def test_radix_leaf_depth_counts_runs_once() -> None:
    # a -> b -> c and a -> b -> d, plus x alone: leaves c and d at radix depth 2, x at 1
    resident = {1, 2, 3, 4, 9}
    p99 = radix_leaf_depth_p99([(1, 2, 3), (1, 2, 4), (9,), (1, 2, 5)], resident)
    bounds = catalog.DEPTH_BUCKETS
    row = [0] * (len(bounds) + 1)
    row[bucket_index(bounds, 2)] += 2
    row[bucket_index(bounds, 1)] += 1
    assert p99 == histogram_quantile(0.99, bounds, row)


def test_session_moves_tell_migrations_from_collisions() -> None:
    def s(end: float, session: str, worker: str, cached: int = 0) -> Served:
        return Served(end, session, worker, 100, cached, 0.1, ())

    served = [s(1, "a", "w0"), s(2, "b", "w1"), s(3, "a", "w0", 90), s(11, "a", "w2"), s(12, "b", "w0"),
              s(13, "b", "w0", 50)]
    node = {"w0": "n1", "w1": "n1", "w2": "n2"}
    # a: stays, then leaves w0 (dead at 10) for w2 — a cross-node migration; b: leaves healthy w1 — a collision
    assert session_moves(served, 0, {"w0": 10.0}, node) == Moves(4, 1, 1, 1, 400, 140)
    assert session_moves(served, 10.5, {}, node) == Moves(3, 2, 0, 0, 300, 50)


# ---- the stack ------------------------------------------------------------------------------------
@dataclass
class SpanStack:
    stack: Stack
    truth: Truth
    client: GenAiClient
    spans: FleetSpans

    def flush(self) -> None:
        self.spans.flush()
        self.client.flush()


@pytest.fixture(params=KINDS)
def span_stack(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SpanStack]:
    topology = tmp_path / "topology.yaml"
    topology.write_text(yaml.safe_dump(TOPOLOGY))
    truth = Truth()
    auth = {"Authorization": f"Bearer {TOKEN}"}  # the exporter's intake token, as OTEL_EXPORTER_OTLP_TRACES_HEADERS
    spans = FleetSpans("", headers=auth)  # the exporter's address is known once it runs; exports start lazily

    def on_request(r: EngineResult, headers: Mapping[str, str], path: str) -> None:
        truth.on_request(r, headers, path)
        spans(r, headers, path)

    options = StackOptions(otlp=OtlpTraces(session_attributes=(CONVERSATION,), session_wait=2.0),
                           topology=topology, window=WINDOW_S, on_request=on_request, track_placement=True)
    with open_stack(request.param, tmp_path, options) as s:
        spans.endpoint = s.runtime.url + "/v1/traces"
        client = GenAiClient(s.runtime.url + "/v1/traces", headers=auth)
        try:
            yield SpanStack(s, truth, client, spans)
        finally:
            client.close()
            spans.close()


def counters(s: Stack) -> dict[str, float]:
    return {fld: sum(getattr(w.engine.counters, fld) for w in s.fleet) for fld in COUNTERS.values()}


def wait_for_records(ss: SpanStack) -> None:
    """Every request the engines served has reached the exporter as a record built from spans."""
    ss.flush()
    wait_for(lambda: ss.stack.value(f"{P}_records_ingested_total", transport="otlp") == len(ss.truth.results),
             "every served request's span to become a record", timeout=60)


# ---- the end-to-end test --------------------------------------------------------------------------
@pytest.mark.slow
def test_spans_light_the_checklist_with_no_records(span_stack: SpanStack) -> None:
    ss = span_stack
    s, truth = ss.stack, ss.truth
    base, endpoint = s.router.url, ENDPOINT[s.kind]

    def turns(pairs: list[tuple[int, int]], in_flight: int = 4) -> list[str]:
        with ThreadPoolExecutor(in_flight) as pool:
            return list(pool.map(lambda p: turn(ss.client, truth, base, endpoint, *p), pairs))

    # Phase 1, the baseline: every conversation's first turn at once (they spread), then a follow-up.
    turns([(g, 0) for g in range(SESSIONS)], in_flight=SESSIONS)
    turns([(g, 1) for g in range(SESSIONS)])
    settle(s)
    wait_for_records(ss)
    split = time.time()
    before = counters(s)
    # The window must hold none of phase 1, and the baseline all of it (whole slots, one window ago).
    time.sleep(WINDOW_S + SLOT_S + 2.0)

    # Phase 2: a follow-up of every conversation, one more turn of one of them sent by hand to a
    # worker of an NVLink domain that holds none of its prefix (a placement outside the domain:
    # the routers keep prefixes where they are cached), then the kill.
    phase2 = time.time()
    turns([(g, 2) for g in range(SESSIONS)])
    away_session, away = outside_its_domain(s, truth.served())
    turn(ss.client, truth, s.fleet[away].url, endpoint, away_session, 5)
    bypassed = {away: 1}  # the router did not decide it
    settle(s, bypassed)
    wait_for_records(ss)
    served = truth.served()
    last_worker = {x.session: x.worker for x in served}
    # the tree's depth: the resident blocks of every worker, chained as the engines hashed them
    resident = set().union(*(w.engine.cache.resident() for w in s.fleet))
    assert resident <= {h for x in served for h in x.hashes}
    depth = radix_leaf_depth_p99([x.hashes for x in served], resident)
    # the tree statistics are refreshed in the background (tree_stats_interval)
    wait_for(lambda: s.checks()["prefix_tree_depth_p99"]["value"] == pytest.approx(depth),
             f"the tree's leaf-depth p99 to reach {depth}")

    # kill a worker that holds conversations: w2 (alone on node-b, so they all move across nodes)
    # if it holds any, else w1, else the warm pool's w0
    holders = Counter(last_worker.values())
    victim = next(w for w in ("w2", "w1", "w0") if holders[w])
    moving = sorted(int(k.split("-")[1]) for k, w in last_worker.items() if w == victim)
    s.fleet.kill(victim)
    died = time.time()
    # the router stops routing to it (its health check), and the exporter's pool loses it
    wait_for(lambda: s.value(f"{P}_router_worker_healthy", router=s.kind, worker=victim) == 0.0,
             f"{s.kind} to report {victim} unhealthy")
    wait_for(lambda: s.value(f"{P}_worker_pool_size") == 2.0, "the healthy pool to shrink to 2")
    moved = turns([(g, 3) for g in moving])
    assert victim not in moved
    # the next turns come later than a request's own next store would (a turn on the worker that
    # stored the last one within PLACEMENT_CONTINUATION_S reads as that request going on)
    time.sleep(PLACEMENT_CONTINUATION_S + 0.5)
    turns([(g, 4) for g in range(SESSIONS)])
    settle(s, bypassed)
    wait_for_records(ss)
    assert time.time() < phase2 + WINDOW_S, "phase 2 outlasted the window: the checks below would miss part of it"

    served = truth.served()
    window = [x for x in served if x.end > split]
    baseline = [x for x in served if x.end <= split]
    nodes = {w["name"]: w["node"] for w in TOPOLOGY["workers"]}
    moves = session_moves(served, split, {victim: died}, nodes)
    assert moves.migrations == len(moving) > 0
    assert victim != "w2" or moves.cross_node == moves.migrations
    now = counters(s)
    delta = {k: now[k] - before[k] for k in now}
    data = s.groups()
    checks = {c["key"]: c for st in data["steps"] for c in st["checks"]}

    # no record was posted: everything below came from scrapes, KV events, spans and the topology file
    assert s.value(f"{P}_records_ingested_total", transport="http") is None
    expected = {
        "prefix_hit_rate_total": delta["prefix_hits"] / delta["prefix_queries"],
        "prefix_block_count_per_worker": 0.0,  # far from full: no cache thrashes
        "prefix_hit_rate_per_session": moves.followup_cached / moves.followup_prompt,
        "sticky_session_collision_rate": moves.collisions / moves.followups,
        "warm_pool_utilization": s.fleet["w0"].engine.kv_usage,  # idle: KV usage, not running/concurrency
        "session_migration_count_per_minute": moves.migrations / WINDOW_S * 60.0,
        "cold_prefill_time_p99": cold_p99_ratio(window, baseline),
        "cold_prefill_cost_per_request": cold_cost_per_request(window),
        "cross_node_migration_count_per_minute": moves.cross_node / WINDOW_S * 60.0,
        # judged from the KV events' stored chains against the topology's NVLink domains
        "topology_aware_placement_hit_rate": kv_placement_ratio(window, s.fleet.placements),
        "speculative_decoding_acceptance_rate": delta["spec_accepted_tokens"] / delta["spec_draft_tokens"],
    }
    assert 0 < expected["topology_aware_placement_hit_rate"] < 1  # the turn sent by hand missed its domain
    assert max(len(w.engine.cache.resident()) for w in s.fleet) < 0.9 * CAPACITY_BLOCKS
    for key, want in expected.items():
        got = checks[key]
        assert got["status"] != "not_instrumented" and got["value"] is not None, (key, got)
        assert want is not None and got["value"] == pytest.approx(want), (key, got["value"], want)
    for sig in catalog.SIGNALS:  # fed exactly as docs/routers.md's last column says
        assert data["signals"][sig] is (sig in FED_BY_SPANS_AND_TOPOLOGY), sig
    lit = {k for k in CHECKLIST if checks[k]["status"] != "not_instrumented" and checks[k]["value"] is not None}
    # (the worker outlier reads the engines' counters, the cold-prefill budget the spans' prefill
    # times: both light here; their values are checked against the rules in tests/alerts)
    assert lit == set(expected) | {"prefix_tree_depth_p99", "prefix_hit_rate_worker_outlier", "cold_prefill_budget"}, \
        sorted(lit)
    assert set(CHECKLIST) - lit == DARK
    for key in DARK:  # missing, never 0
        assert checks[key]["value"] is None and checks[key]["missing_signals"], checks[key]
    print(f"{s.kind}: victim {victim}, {moves}; values {expected}")
    print(f"{s.kind}: {len(lit)} of {len(CHECKLIST)} checklist checks lit from spans: {sorted(lit)}")


# ---- the router's own spans -----------------------------------------------------------------------
@pytest.mark.slow
def test_sglang_router_spans_reach_the_grpc_receiver_and_time_no_worker_selection(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """sglang-router's ``--enable-trace`` exports over OTLP/gRPC to ``otlp.grpc_listen_address``: one
    root ``http_request`` span per request, timing the whole request — nothing that measures its
    cache-aware tree walk, so ``prefix_tree_walk_latency`` stays missing. The spans are skipped
    (not requests), nothing is rejected. Its spans are INFO-level tracing spans: the router exports
    them only at ``--log-level info`` or below."""
    port = free_port()
    # the router's OTLP exporter (Rust opentelemetry-otlp) reads the standard header variable
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_HEADERS", f"authorization=Bearer%20{TOKEN}")
    options = StackOptions(otlp=OtlpTraces(grpc_listen_address=f"127.0.0.1:{port}", session_wait=0.0),
                           router_args=("--log-level", "info", "--enable-trace", "--otlp-traces-endpoint",
                                        f"127.0.0.1:{port}"))
    received: list[tuple[list[otlp.Span], SpanResult]] = []
    served: dict[str, EngineResult] = {}  # the engine's request id -> its result
    options = replace(options, on_request=lambda r, _h, _p: served.__setitem__(r.request_id, r))
    with open_stack("sglang-router", tmp_path, options) as s:
        assert s.runtime.grpc is not None
        intake = s.runtime.grpc.intake
        ingest = intake.ingest

        def recording(raw: bytes, content_type: str | None, content_encoding: str | None = None,
                      admitted: bool = False) -> SpanResult:
            result = ingest(raw, content_type, content_encoding, admitted=admitted)
            received.append((otlp.decode(raw, content_type), result))
            return result

        intake.ingest = recording  # type: ignore[method-assign]
        ids: dict[str, str] = {}  # the router's request id -> the engine's
        for g in range(3):
            r = post(s.router.url, ENDPOINT[s.kind], g, 0)
            assert r.status_code == 200, r.text
            ids[r.headers["x-request-id"]] = r.json()["id"]

        def completions() -> dict[str, otlp.Span]:
            return {str(sp.attributes.get("request_id")): sp for spans, _ in received for sp in spans
                    if sp.attributes.get("uri") == "/v1/completions"}

        wait_for(lambda: set(ids) <= set(completions()), "the router's spans of the three requests", timeout=30)
        spans = [sp for batch, _ in received for sp in batch]
        assert {sp.name for sp in spans} == {"http_request"}
        assert all(sp.parent_span_id == "" and sp.resource.get("service.name") == "smg" for sp in spans)
        for rid, engine_id in ids.items():
            span = completions()[rid]
            duration_s = (span.end_ns - span.start_ns) / 1e9
            # the whole request: the worker's time is inside it, and so is the router's `latency` (µs),
            # give or take the gap between the router's two clock reads (its latency timer and the
            # span's end are read a moment apart: 0.3 ms on a loaded machine)
            assert duration_s >= served[engine_id].e2e_s
            assert int(str(span.attributes["latency"])) / 1e6 <= duration_s + CLOCK_READS_S
        assert all(result.accepted == result.rejected == 0 for _, result in received)
        assert s.runtime.health.total(f"{P}_ingest_errors") is None
        walk = s.checks()["prefix_tree_walk_latency"]
        assert walk["value"] is None and "walk_latency" in walk["missing_signals"], walk
