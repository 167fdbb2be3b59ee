"""What one request record adds to which series.

A record feeds the reuse decomposition (prompt, achieved, predicted, available tokens), the
prefix index's hit counts and the hot-branch history, the session table (follow-ups, sticky
collisions, re-keys, reshuffles), migrations, cold-prefill time and cost, the miss cost of every
request that missed part of its available prefix (migrations included) and its SLO judgement,
router timings, fallbacks, MoE expert alignment and affinity admission. Each of those is one small step below, run in order
on a :class:`RecordView`; a step whose fields the record lacks adds nothing (a missing signal
is missing, never zero).

Which signals the records carry is remembered per field (``field_seen``), so the state can say
which signals are instrumented. Not thread-safe on its own: ``ClusterState`` calls it under its lock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from exporter.core.baseline_window import HealthyBaseline
from exporter.core.block_tokens import blocks_of, tokens_of
from exporter.core.cardinality import RecordLabels
from exporter.core.health import Health
from exporter.core.hotspots import Hotspots
from exporter.core.index.prefix_index import PrefixIndex
from exporter.core.index.tiers import GPU
from exporter.core.input_time import InputTime
from exporter.core.metric_store import MetricStore
from exporter.core.moe_alignment import ExpertSignatures
from exporter.core.sessions import SessionTable
from exporter.core.windows import LabelValues, histogram_quantile
from exporter.core.worker_pool import DEFAULT_BLOCK_SIZE, WorkerPool
from exporter.model import Limits, SessionStore
from prefixscope import catalog
from prefixscope.records import InvalidRecord, RequestRecord
from prefixscope.thresholds import Thresholds
from prefixscope.topology import Topology, WorkerTopo

P = catalog.NAMESPACE
UNKNOWN = "unknown"
_MODEL_LABELS_KEPT = 1024
# A KV store naming a session goes on with one of its requests when its parent ended one of the
# session's stores this recently: the rule placement uses for a request's first store.
KV_TURN_CONTINUATION_S = catalog.PLACEMENT_CONTINUATION_S  # model values are bounded (limits.models) before they get here

# Record field -> the signal it feeds (catalog.SIGNALS); a field counts once any record carried it.
RECORD_FIELD_SIGNALS: dict[str, str] = {
    "session_key": "session_key",
    "block_hashes": "block_hashes",
    "cached_tokens": "cached_tokens",
    "predicted_cached_tokens": "predicted_cached_tokens",
    "prefill_s": "prefill_timing",
    "async_wait_s": "async_prefill",
    "walk_s": "walk_latency",
    "migrated_from": "migrations",
    "migration_kind": "migrations",
    "expert_signature": "expert_signature",
    "admitted_by_affinity": "affinity_admission",
    "lora_name": "attribution",
    "tenant": "attribution",
}

# Fields that describe an event (a migration, an async-prefill wait): a producer that writes the
# key with null is saying "it did not happen", so the signal is instrumented. Measurement fields
# (cached_tokens, prefill_s, ...) stay missing when null — an engine that leaves cached_tokens null
# (vLLM without --enable-prompt-tokens-details) has not measured it.
EVENT_FIELDS = frozenset({"migrated_from", "migration_kind", "async_wait_s"})
MIGRATION_KINDS = ("soft", "hard")
DEFAULT_MISS_COST_FACTOR = 1.5  # the seed's "P95 ≤ 1.5 × cold-prefill baseline" (§7)
# The miss-cost SLO judges each missed request against the baseline's p95 (the SLO bounds the P95).
MISS_COST_BASELINE_Q = 0.95
_COLD_PREFILL = f"{P}_cold_prefill_seconds"
_COLD_LABELS = catalog.METRICS_BY_NAME[_COLD_PREFILL].labels  # (model, gpu_class, prompt_class)
_COLD_MODEL_AT, _COLD_CLASS_AT = _COLD_LABELS.index("model"), _COLD_LABELS.index("prompt_class")


def _m(name: str) -> str:
    """A catalogue metric's full name (a name the catalogue lacks fails here, at import)."""
    return catalog.METRICS_BY_NAME[f"{P}_{name}"].name


# The series the steps write, named once (not formatted per record).
_ASYNC_PREFILL_WAIT_SECONDS = _m("async_prefill_wait_seconds")
_BATCH_ADMISSIONS = _m("batch_admissions")
_BATCH_AFFINITY_ADMISSIONS = _m("batch_affinity_admissions")
_COLD_PREFILL_COST_USD = _m("cold_prefill_cost_usd")
_COLD_PREFILL_GPU_SECONDS = _m("cold_prefill_gpu_seconds")
_COLD_REQUESTS = _m("cold_requests")
_CROSS_NODE_MIGRATIONS = _m("cross_node_migrations")
_FALLBACK_REQUESTS = _m("fallback_requests")
_FOLLOWUP_REQUESTS = _m("followup_requests")
_INDEX_STALENESS_TOKENS = _m("index_staleness_tokens")
_MISSED_REQUESTS = _m("missed_requests")
_MISSED_REQUESTS_WITHIN_BASELINE = _m("missed_requests_within_baseline")
_MOE_EXPERT_ALIGNED_HITS = _m("moe_expert_aligned_hits")
_MOE_PREFIX_HITS = _m("moe_prefix_hits")
_PLACEMENT_DECISIONS = _m("placement_decisions")
_PLACEMENT_DOMAIN_HITS = _m("placement_domain_hits")
_PREFIX_MISS_COST_SECONDS = _m("prefix_miss_cost_seconds")
_REQUEST_PROMPT_TOKENS = _m("request_prompt_tokens")
_REQUESTS = _m("requests")
_REUSE_ACHIEVED_TOKENS = _m("reuse_achieved_tokens")
_REUSE_AVAILABLE_TOKENS = _m("reuse_available_tokens")
_REUSE_PREDICTED_TOKENS = _m("reuse_predicted_tokens")
_ROUTER_TREE_WALK_SECONDS = _m("router_tree_walk_seconds")
_SESSION_FOLLOWUP_CACHED_TOKENS = _m("session_followup_cached_tokens")
_SESSION_FOLLOWUP_PROMPT_TOKENS = _m("session_followup_prompt_tokens")
_SESSION_MIGRATIONS = _m("session_migrations")
_SESSION_REKEYS = _m("session_rekeys")
_STICKY_COLLISIONS = _m("sticky_collisions")
_WORKER_REQUESTS = _m("worker_requests")
_WORKER_TTFT_SECONDS = _m("worker_ttft_seconds")


def count_unprocessable(health: Health, rec: object, exc: Exception) -> None:
    """Count a record whose accounting failed half-way (``records``/``unprocessable``), named by its
    request id; the slice's other records go on."""
    rid = rec.request_id if isinstance(rec, RequestRecord) else rec.get("request_id")  # type: ignore[attr-defined]
    detail = str(exc) if isinstance(exc, InvalidRecord) else repr(exc)
    health.error("records", "unprocessable", f"{detail} in record {rid!r}")


def _cold_labels(model: str, wt: WorkerTopo | None, rec: RequestRecord) -> tuple[str, str, str]:
    """The cold-prefill histogram's labels (``_COLD_LABELS``) of a record served on ``wt``."""
    return model, wt.gpu_class if wt else UNKNOWN, catalog.prompt_class(rec.prompt_tokens)


def miss_cost_factor(thresholds: Thresholds) -> float:
    """The miss-cost SLO's baseline factor from the thresholds (the seed's 1.5 without an entry)."""
    entry = thresholds.checks.get("slo_prefix_miss_cost")
    factor = entry.baseline_factor if entry is not None else None
    return DEFAULT_MISS_COST_FACTOR if factor is None else factor


@dataclass(slots=True)
class RecordView:
    """One record with what its worker's context adds: model label, block size, the worker's hit."""

    rec: RequestRecord
    model: str
    block_size: int
    hashes: tuple[int, ...] | None
    ml: LabelValues  # (model,): the label values of the per-model series, one tuple per model
    hit_on_worker: int = 0  # leading blocks of the prompt resident on the serving worker
    available_blocks: int | None = None  # longest match on any worker the router could use (None: unknown)


@dataclass(frozen=True, slots=True)
class _Plan:
    signals: tuple[tuple[str, str, bool], ...]
    steps: tuple[Callable[[RecordView], None], ...]


class RecordAccounting:
    """Applies request records to the metric store, the index, the sessions and the hotspots."""

    def __init__(self, time: InputTime, store: MetricStore, pool: WorkerPool, index: PrefixIndex,
                 sessions: SessionTable, hotspots: Hotspots, topology: Topology | None,
                 cold_reuse_share: float, labels: RecordLabels | None = None,
                 miss_cost_factor: float = DEFAULT_MISS_COST_FACTOR) -> None:
        self.time = time
        self.store = store
        self.pool = pool
        self.index = index
        self.sessions = sessions
        self.hotspots = hotspots
        self.topology: Topology | None = None
        self._domain_workers: dict[str, list[str]] = {}  # NVLink domain -> its workers (placement)
        self.set_topology(topology)
        self.cold_reuse_share = cold_reuse_share
        # model, segment and worker values are bounded before any step sees them
        self.labels = labels if labels is not None else RecordLabels(Limits(), store.window_s)
        self.miss_cost_factor = miss_cost_factor
        self.field_seen: dict[str, float] = {}  # signal -> newest record that carried it
        self.keyed_record_ts = float("-inf")  # newest record (or span) with a session key
        self.fallback_last: dict[str, float] = {}  # fallback tier -> newest record that used it
        self.moe_signatures = ExpertSignatures()  # first block -> its recent expert signatures
        self._reshuffle_counted: dict[str, int] = {}  # session key -> pool epoch it was counted for
        self._steps: tuple[Callable[[RecordView], None], ...] = (
            self._reuse, self._prefix, self._session, self._migration, self._prefill, self._miss,
            self._router_timings, self._fallback, self._moe, self._admission)
        # The fields without which a step adds nothing (it returns at once when all are null):
        # a record that carries none of them skips the step.
        self._step_fields: dict[Callable[[RecordView], None], frozenset[str]] = {
            self._prefix: frozenset({"block_hashes"}), self._session: frozenset({"session_key"}),
            self._migration: frozenset({"migrated_from"}), self._prefill: frozenset({"prefill_s"}),
            self._miss: frozenset({"prefill_s"}), self._router_timings: frozenset({"async_wait_s", "walk_s"}),
            self._fallback: frozenset({"fallback_tier"}), self._moe: frozenset({"expert_signature"}),
            self._admission: frozenset({"admitted_by_affinity"})}
        self._plans: dict[frozenset[str], _Plan] = {}
        self._model_labels: dict[str, LabelValues] = {}
        # (model, prompt class) -> cold-prefill baseline, for the baseline's version under None
        self._baselines: dict[tuple[str, str] | None, float | int | None] = {}

    def _plan(self, carried: frozenset[str]) -> _Plan:
        """What a record carrying ``carried`` needs: the signal fields it may report, as
        (field, signal, counts even when null), and the steps its fields can feed.

        A record read from JSON or a span carries every optional field it has a value for (and
        the explicit nulls), so only those are looked at; records of one producer carry the same
        fields, so this is worked out once. A record built without ``carried`` gets everything."""
        plan = self._plans.get(carried)
        if plan is None:
            signals = tuple((fld, signal, fld in EVENT_FIELDS and fld in carried)
                            for fld, signal in RECORD_FIELD_SIGNALS.items() if fld in carried or not carried)
            steps = tuple(step for step in self._steps
                          if not carried or step not in self._step_fields or self._step_fields[step] & carried)
            plan = _Plan(signals, steps)
            if len(self._plans) < 1024:
                self._plans[carried] = plan
        return plan

    def set_topology(self, topology: Topology | None) -> None:
        """Judge placement by ``topology`` from now on (the caller holds the state lock)."""
        domains: dict[str, list[str]] = {}
        for t in topology.workers if topology is not None else ():
            domains.setdefault(t.nvlink_domain, []).append(t.name)
        self.topology, self._domain_workers = topology, domains

    def topo(self, worker: str) -> WorkerTopo | None:
        topo = self.topology
        return topo.worker(worker) if topo is not None and worker in topo else None

    def account(self, rec: RequestRecord) -> str:
        """Everything one record adds (the caller holds the state lock); returns the worker's
        name as accounted (``other`` past the worker limit)."""
        now, labels = self.time.now, self.labels
        model_b, segment_b, worker_b = labels.budgets
        if now >= model_b.due or now >= segment_b.due or now >= worker_b.due:
            self.expire_labels(now)  # a slot freed by now is free for this record's values
        rec = labels.bound(rec)
        ts = rec.ts
        # the clock is the exporter's (the intake advanced it to the receive time): a record's ts
        # places it in the windows but never moves them
        # Newest record per signal: a late (or wrongly stamped) record must not age a signal out.
        seen = self.field_seen
        plan = self._plans.get(rec.carried) or self._plan(rec.carried)
        for fld, signal, event in plan.signals:
            if (event or getattr(rec, fld) is not None) and ts > seen.get(signal, -1.0):
                seen[signal] = ts
        if ts > seen.get("records", -1.0):
            seen["records"] = ts
        w = self.pool.served(rec.worker, ts)
        model = rec.model or UNKNOWN
        ml = self._model_labels.get(model) or self._model_label(model)
        view = RecordView(rec, model, int(rec.block_size or w.block_size or DEFAULT_BLOCK_SIZE),
                          rec.block_hashes or None, ml)
        for step in plan.steps:
            step(view)
        return rec.worker

    # ---- the steps -----------------------------------------------------------------------------
    def _reuse(self, v: RecordView) -> None:
        """Prompt, achieved and predicted tokens of the reuse decomposition; index staleness."""
        rec, store, ml = v.rec, self.store, v.ml
        ts, prompt, cached, predicted = rec.ts, rec.prompt_tokens, rec.cached_tokens, rec.predicted_cached_tokens
        store.inc(ts, _REQUESTS, ml)
        store.inc(ts, _REQUEST_PROMPT_TOKENS, ml, prompt)
        # per worker: what the records (and the spans that became records) carried
        wl = (rec.worker,)
        store.inc(ts, _WORKER_REQUESTS, wl)
        if rec.ttft_s is not None:
            store.observe(ts, _WORKER_TTFT_SECONDS, wl, rec.ttft_s)
        if cached is not None:
            store.inc(ts, _REUSE_ACHIEVED_TOKENS, ml, cached)
            store.add_own(ts, ("record_cached", rec.worker), cached)
            store.add_own(ts, ("record_prompt", rec.worker), prompt)
        if predicted is not None:
            store.inc(ts, _REUSE_PREDICTED_TOKENS, ml, predicted)
            if cached is not None:
                store.inc(ts, _INDEX_STALENESS_TOKENS, ml, max(0, predicted - cached))

    def _prefix(self, v: RecordView) -> None:
        """Available tokens and placement from the index; the hits it records."""
        hashes = v.hashes
        if not hashes:
            return
        rec, store, ml, bs, topo = v.rec, self.store, v.ml, v.block_size, self.topology
        ts, worker, cached = rec.ts, rec.worker, rec.cached_tokens
        match = self.index.longest_match(hashes)
        v.hit_on_worker = match.depth_on(worker)
        # Availability and placement are judged by what the router faced. A record arrives
        # after its response, when the chosen worker already holds this request's own blocks,
        # so its depth is the cached tokens the engine reported at admission (the other
        # workers' are unaffected). A worker that left the pool holds nothing the router could
        # use, whatever its last view says. The match answers per worker (no per-worker dict).
        prompt = rec.prompt_tokens
        cached_blocks = blocks_of(cached, prompt, len(hashes), bs) if cached is not None else None
        own = v.hit_on_worker if cached_blocks is None else cached_blocks
        left = self.pool.left_workers()  # kept by the pool between changes (no walk per record)
        best = max(own, match.best_depth_besides(worker, left))  # the chosen worker counts with ``own``
        # what the engine reused was available, whatever the block rounding: achieved ≤ available
        available = max(tokens_of(best, prompt, bs), min(cached or 0, prompt))
        v.available_blocks = best
        store.inc(ts, _REUSE_AVAILABLE_TOKENS, ml, available)
        if topo is not None and best > 0 and worker in topo:
            store.inc(ts, _PLACEMENT_DECISIONS, ml)
            store.zero(_PLACEMENT_DOMAIN_HITS, ml)
            if own == best or any(match.depth_on(x) == best for x in self._domain_workers[topo.domain_of(worker)]
                                  if x != worker and x not in left):
                store.inc(ts, _PLACEMENT_DOMAIN_HITS, ml)
        hit_blocks = own  # the blocks the engine reused (its own report, else the worker's view)
        if hit_blocks:
            self.index.record_hits(hashes, hit_blocks, bs)
            tokens = float(cached) if cached is not None else float(hit_blocks * bs)
            self.hotspots.hit(ts, hashes, hit_blocks, tokens, rec.session_key)

    def _session(self, v: RecordView) -> None:
        """Follow-ups, sticky collisions, re-keys, and sessions reshuffled by a pool change."""
        rec = v.rec
        key = rec.session_key
        if not key:
            return
        if rec.ts > self.keyed_record_ts:
            self.keyed_record_ts = rec.ts
        self._session_turn(key, rec.ts, rec.worker, v.hashes, rec.segment or UNKNOWN, v.ml, rec.cached_tokens,
                           rec.prompt_tokens, rec.migrated_from)

    def kv_sessions(self, worker: str, stores: tuple[SessionStore, ...], ts: float) -> None:
        """KV stores that name their session (vLLM >= 0.30): a request's first local GPU store is one
        turn of its session on ``worker`` — the follow-ups, sticky collisions, migrations and
        reshuffles records count, with no record at all. Stores that go on with one of the
        session's requests (their parent ended one of its stores on the worker within
        ``PLACEMENT_CONTINUATION_S``) are the same turn; offload and remote stores are no turn.
        While records or spans carry session keys (within the window) they alone count turns: they
        are per request, and counted once. What the events cannot say stays missing: cached tokens
        (the per-session hit rate), segments (``unknown``), re-keys (no prompt chain)."""
        if ts - self.keyed_record_ts <= self.store.window_s:
            return
        sessions, pool = self.sessions, self.pool
        ml: LabelValues | None = None
        for key, parent, last, medium in stores:
            if medium is not None and medium != GPU:
                continue
            if sessions.kv_continues(key, worker, parent, ts, KV_TURN_CONTINUATION_S):
                sessions.kv_stored(key, worker, last, ts)
                continue
            if ml is None:
                ml = self._model_label(self.pool.model_of(worker) or UNKNOWN)
            prev = sessions.get(key)
            before = prev.worker if prev is not None else None
            moved = before if before is not None and before != worker and not pool.is_healthy(before) else None
            seen = self.field_seen
            for signal in ("session_key", "migrations"):
                if ts > seen.get(signal, -1.0):
                    seen[signal] = ts
            self._session_turn(key, ts, worker, None, UNKNOWN, ml, None, 0, moved)
            self._migrated(ts, worker, moved, "hard", True)
            sessions.kv_stored(key, worker, last, ts)

    def _model_label(self, model: str) -> LabelValues:
        ml = self._model_labels.get(model)
        if ml is None:  # the same tuple for every record of a model: the store's lookups find it by identity
            if len(self._model_labels) >= _MODEL_LABELS_KEPT:
                self._model_labels.clear()
            ml = self._model_labels[model] = (model,)
        return ml

    def _session_turn(self, key: str, ts: float, worker: str, hashes: tuple[int, ...] | None, segment: str,
                      ml: LabelValues, cached: float | None, prompt: float, migrated_from: str | None) -> None:
        store = self.store
        pool = self.pool
        turn = self.sessions.observe(key, ts, worker, hashes, segment, pool.epoch)
        prev = turn.previous_worker
        if turn.turn == 1:
            self.hotspots.new_session(ts, segment, turn.rekey_of is not None)
            store.zero(_SESSION_REKEYS, (segment,))
            if turn.rekey_of is None:
                return
            store.inc(ts, _SESSION_REKEYS, (segment,))
            # A re-keyed conversation's turn is a follow-up of the session it continues: sticky
            # routing should have sent it back to that session's worker.
            continued = self.sessions.get(turn.rekey_of)
            prev = continued.worker if continued is not None else None
        store.inc(ts, _FOLLOWUP_REQUESTS, ml)
        store.zero(_STICKY_COLLISIONS, ml)
        if prev is not None and prev != worker and not migrated_from and pool.is_healthy(prev):
            store.inc(ts, _STICKY_COLLISIONS, ml)
        if cached is not None:
            store.inc(ts, _SESSION_FOLLOWUP_PROMPT_TOKENS, ml, prompt)
            store.inc(ts, _SESSION_FOLLOWUP_CACHED_TOKENS, ml, cached)
            turn.session.followup_prompt += prompt
            turn.session.followup_cached += cached
        # Reshuffle: sessions served before the last pool change and again after it.
        if pool.changes and turn.previous_epoch is not None and turn.previous_epoch < pool.epoch:
            change = pool.changes[-1]
            if self._reshuffle_counted.get(turn.session.key) != change.epoch:
                self._reshuffle_counted[turn.session.key] = change.epoch
                change.seen_both += 1
                change.moved += prev != worker
                if len(self._reshuffle_counted) > self.sessions.max_sessions:
                    self._reshuffle_counted.clear()

    def _migration(self, v: RecordView) -> None:
        rec = v.rec
        self._migrated(rec.ts, rec.worker, rec.migrated_from, rec.migration_kind or "hard", rec.reports("migrated_from"))

    def _migrated(self, ts: float, worker: str, src: str | None, kind: str, reports: bool) -> None:
        store = self.store
        if reports:
            # A producer that reports migrations (even "none this time") gets both kinds at 0, so
            # the per-minute rates read 0 rather than "no data" until the first migration.
            for k in MIGRATION_KINDS:
                store.zero(_SESSION_MIGRATIONS, (k,))
                if self.topology is not None:
                    store.zero(_CROSS_NODE_MIGRATIONS, (k,))
        if not src:
            return
        store.inc(ts, _SESSION_MIGRATIONS, (kind,))
        store.add_own(ts, ("migrated_away", src, kind), 1.0)  # /api/v1/workers: whose sessions moved
        a, b = self.topo(src), self.topo(worker)
        if a is not None and b is not None:
            store.zero(_CROSS_NODE_MIGRATIONS, (kind,))
            if a.node != b.node:
                store.inc(ts, _CROSS_NODE_MIGRATIONS, (kind,))

    def is_cold(self, rec: RequestRecord) -> bool:
        return rec.cached_tokens is not None and rec.cached_tokens <= self.cold_reuse_share * rec.prompt_tokens

    def _prefill(self, v: RecordView) -> None:
        """Cold prefill time (by GPU class and prompt-length class) and its cost."""
        rec, store, ml = v.rec, self.store, v.ml
        prefill, ts = rec.prefill_s, rec.ts
        if prefill is None or not self.is_cold(rec):
            return
        wt = self.topo(rec.worker)
        store.inc(ts, _COLD_REQUESTS, ml)
        store.observe(ts, _COLD_PREFILL, _cold_labels(v.model, wt, rec), prefill)
        gpu_s = prefill * (wt.gpus if wt else 1)
        store.inc(ts, _COLD_PREFILL_GPU_SECONDS, ml, gpu_s)
        if wt is not None:
            store.inc(ts, _COLD_PREFILL_COST_USD, ml, gpu_s * wt.price_per_gpu_hour / 3600.0)

    def missed(self, v: RecordView) -> bool | None:
        """Did the request miss part of its available prefix (None: cannot tell)?

        A migrated request always did (its KV had to move or be recomputed, seed §5). Otherwise,
        with block hashes: some worker the router could use held more leading blocks than the
        engine reused; without them, the request was cold (the best available proxy).
        """
        rec = v.rec
        if rec.migrated_from:
            return True
        if rec.cached_tokens is None:
            return None
        if v.available_blocks is not None:
            return v.available_blocks > rec.cached_tokens // v.block_size
        return self.is_cold(rec)

    def _miss(self, v: RecordView) -> None:
        """Miss cost T_prefill + T_queue + T_migrate of a missed request, and the SLO's judgement of
        it against the cold-prefill baseline of its model and prompt-length class."""
        rec, store, ml, ts = v.rec, self.store, v.ml, v.rec.ts
        if rec.prefill_s is None or not self.missed(v):
            return
        cost = rec.prefill_s + (rec.queue_s or 0.0) + (rec.migrate_s or 0.0)
        store.observe(ts, _PREFIX_MISS_COST_SECONDS, ml, cost)
        baseline = self.cold_baseline(ts, v.model, catalog.prompt_class(rec.prompt_tokens))
        if baseline is None:
            return  # no baseline for this class yet: not judged (missing, never good or bad)
        store.inc(ts, _MISSED_REQUESTS, ml)
        store.zero(_MISSED_REQUESTS_WITHIN_BASELINE, ml)
        if cost <= self.miss_cost_factor * baseline:
            store.inc(ts, _MISSED_REQUESTS_WITHIN_BASELINE, ml)

    def observe_cold_baseline(self, rec: RequestRecord) -> None:
        """A record another shard keeps (exporter.core.sharding): its cold prefill joins this shard's
        cold-prefill baseline and nothing else, so the baseline is the cluster's. Its model is
        taken as written (a model past the label limit is "other" only where it was counted)."""
        if rec.prefill_s is None or not self.is_cold(rec):
            return
        lagged = self.store.baselines.get(_COLD_PREFILL)
        if lagged is None:
            return
        lagged.observe(rec.ts, _cold_labels(rec.model or UNKNOWN, self.topo(rec.worker), rec), rec.prefill_s)

    def cold_baseline(self, ts: float, model: str, prompt_class: str) -> float | None:
        """The long-window cold-prefill p95 of a model and prompt-length class, ending one window ago
        (over its healthy windows: a slowdown does not become the baseline it is judged against)."""
        lagged = self.store.baselines.get(_COLD_PREFILL)
        if lagged is None:
            return None
        self.store.advance_baselines(ts)
        # The baseline changes only when a slot enters or leaves it: between, one quantile per class.
        cache = self._baselines
        if cache.get(None) != lagged.version:
            cache.clear()
            cache[None] = lagged.version
        key = (model, prompt_class)
        if key in cache:
            return cache[key]
        if isinstance(lagged, HealthyBaseline):  # the healthy windows only (or every one, where none is)
            counts: list[int] = lagged.baseline_of(key) or []
        else:
            m, c = _COLD_MODEL_AT, _COLD_CLASS_AT
            counts = lagged.merged(lambda labels: labels[m] == model and labels[c] == prompt_class)  # type: ignore[index]
        value = cache[key] = histogram_quantile(MISS_COST_BASELINE_Q, lagged.bounds, counts) if counts else None
        return value

    def _router_timings(self, v: RecordView) -> None:
        rec = v.rec
        if rec.async_wait_s is not None:
            self.store.observe(rec.ts, _ASYNC_PREFILL_WAIT_SECONDS, v.ml, rec.async_wait_s)
        if rec.walk_s is not None:
            self.store.observe(rec.ts, _ROUTER_TREE_WALK_SECONDS, (), rec.walk_s)

    def _fallback(self, v: RecordView) -> None:
        tier, ts = v.rec.fallback_tier, v.rec.ts
        if tier:
            self.store.inc(ts, _FALLBACK_REQUESTS, (tier,))
            self.fallback_last[tier] = max(ts, self.fallback_last.get(tier, 0.0))

    def _moe(self, v: RecordView) -> None:
        """A hit whose expert signature matches its first block's recent majority is aligned."""
        rec, sig, hashes = v.rec, v.rec.expert_signature, v.hashes
        if sig is None or not hashes:
            return
        first = hashes[0]
        expected = self.moe_signatures.expected(first)
        cached = rec.cached_tokens
        is_hit = (cached > 0) if cached is not None else v.hit_on_worker > 0
        if expected is not None and is_hit:
            self.store.inc(rec.ts, _MOE_PREFIX_HITS, v.ml)
            self.store.zero(_MOE_EXPERT_ALIGNED_HITS, v.ml)
            if sig == expected:
                self.store.inc(rec.ts, _MOE_EXPERT_ALIGNED_HITS, v.ml)
        self.moe_signatures.observe(first, sig)

    def _admission(self, v: RecordView) -> None:
        admitted = v.rec.admitted_by_affinity
        if admitted is None:
            return
        self.store.inc(v.rec.ts, _BATCH_ADMISSIONS, v.ml)
        self.store.zero(_BATCH_AFFINITY_ADMISSIONS, v.ml)
        if admitted:
            self.store.inc(v.rec.ts, _BATCH_AFFINITY_ADMISSIONS, v.ml)

    def expire_labels(self, now: float) -> None:
        """Drop the series of label values records stopped bringing (and forget such workers)."""
        for label, value in self.labels.expire(now):
            self.store.drop_label_value(label, value)
            if label == "worker":
                self.pool.forget(value)

    # ---- reads ---------------------------------------------------------------------------------
    def fallback_active(self) -> dict[str, float]:
        """1 for each fallback tier used inside the window, 0 for one used before it."""
        cutoff = self.time.now - self.store.window_s
        return {tier: 1.0 if ts > cutoff else 0.0 for tier, ts in self.fallback_last.items()}
