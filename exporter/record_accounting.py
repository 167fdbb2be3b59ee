"""What one request record adds to which series.

A record feeds the reuse decomposition (prompt, achieved, predicted, available tokens), the
prefix index's hit counts and the hot-branch history, the session table (follow-ups, sticky
collisions, re-keys, reshuffles), migrations, cold-prefill cost, router timings, fallbacks, MoE
expert alignment and affinity admission. Each of those is one small step below, run in order
on a :class:`RecordView`; a step whose fields the record lacks adds nothing (a missing signal
is missing, never zero).

Which signals the records carry is remembered per field (``field_seen``), so the state can say
which signals are instrumented. Not thread-safe on its own: ``ClusterState`` calls it under its lock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from exporter.block_tokens import blocks_of, tokens_of
from exporter.cardinality import RecordLabels
from exporter.config import Limits
from exporter.hotspots import Hotspots
from exporter.input_time import InputTime
from exporter.metric_store import MetricStore
from exporter.moe_alignment import ExpertSignatures
from exporter.prefix_index import PrefixIndex
from exporter.sessions import SessionTable
from exporter.windows import LabelValues
from exporter.worker_pool import WorkerPool
from prefixscope import catalog
from prefixscope.records import RequestRecord
from prefixscope.topology import Topology, WorkerTopo

P = catalog.NAMESPACE
DEFAULT_BLOCK_SIZE = 16  # vLLM's default, used only when neither the record nor the worker says
UNKNOWN = "unknown"

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
}

# Fields that describe an event (a migration, an async-prefill wait): a producer that writes the
# key with null is saying "it did not happen", so the signal is instrumented. Measurement fields
# (cached_tokens, prefill_s, ...) stay missing when null — an engine that leaves cached_tokens null
# (vLLM without --enable-prompt-tokens-details) has not measured it.
EVENT_FIELDS = frozenset({"migrated_from", "migration_kind", "async_wait_s"})
MIGRATION_KINDS = ("soft", "hard")


@dataclass(slots=True)
class RecordView:
    """One record with what its worker's context adds: model label, block size, the worker's hit."""

    rec: RequestRecord
    model: str
    block_size: int
    hashes: tuple[int, ...] | None
    hit_on_worker: int = 0  # leading blocks of the prompt resident on the serving worker

    @property
    def ml(self) -> LabelValues:
        return (self.model,)


class RecordAccounting:
    """Applies request records to the metric store, the index, the sessions and the hotspots."""

    def __init__(self, time: InputTime, store: MetricStore, pool: WorkerPool, index: PrefixIndex,
                 sessions: SessionTable, hotspots: Hotspots, topology: Topology | None,
                 cold_reuse_share: float, labels: RecordLabels | None = None) -> None:
        self.time = time
        self.store = store
        self.pool = pool
        self.index = index
        self.sessions = sessions
        self.hotspots = hotspots
        self.topology = topology
        self.cold_reuse_share = cold_reuse_share
        self._domain_workers: dict[str, list[str]] = {}  # NVLink domain -> its workers (placement)
        for t in topology.workers if topology is not None else ():
            self._domain_workers.setdefault(t.nvlink_domain, []).append(t.name)
        # model, segment and worker values are bounded before any step sees them
        self.labels = labels if labels is not None else RecordLabels(Limits(), store.window_s)
        self.field_seen: dict[str, float] = {}  # signal -> newest record that carried it
        self.fallback_last: dict[str, float] = {}  # fallback tier -> newest record that used it
        self.moe_signatures = ExpertSignatures()  # first block -> its recent expert signatures
        self._reshuffle_counted: dict[str, int] = {}  # session key -> pool epoch it was counted for
        self._steps: tuple[Callable[[RecordView], None], ...] = (
            self._reuse, self._prefix, self._session, self._migration, self._prefill,
            self._router_timings, self._fallback, self._moe, self._admission)

    def topo(self, worker: str) -> WorkerTopo | None:
        topo = self.topology
        return topo.worker(worker) if topo is not None and worker in topo else None

    def account(self, rec: RequestRecord) -> str:
        """Everything one record adds (the caller holds the state lock); returns the worker's
        name as accounted (``other`` past the worker limit)."""
        self.expire_labels(self.time.now)  # a slot freed by now is free for this record's values
        rec = self.labels.bound(rec)
        ts = rec.ts
        # the clock is the exporter's (the intake advanced it to the receive time): a record's ts
        # places it in the windows but never moves them
        # Newest record per signal: a late (or wrongly stamped) record must not age a signal out.
        seen = self.field_seen
        for fld, signal in RECORD_FIELD_SIGNALS.items():
            if (getattr(rec, fld) is not None or (fld in EVENT_FIELDS and fld in rec.carried)) \
                    and ts > seen.get(signal, -1.0):
                seen[signal] = ts
        if ts > seen.get("records", -1.0):
            seen["records"] = ts
        w = self.pool.served(rec.worker, ts)
        view = RecordView(rec, rec.model or UNKNOWN, int(rec.block_size or w.block_size or DEFAULT_BLOCK_SIZE),
                          rec.block_hashes or None)
        for step in self._steps:
            step(view)
        return rec.worker

    # ---- the steps -----------------------------------------------------------------------------
    def _reuse(self, v: RecordView) -> None:
        """Prompt, achieved and predicted tokens of the reuse decomposition; index staleness."""
        rec, store, ml = v.rec, self.store, v.ml
        ts, prompt, cached, predicted = rec.ts, rec.prompt_tokens, rec.cached_tokens, rec.predicted_cached_tokens
        store.inc(ts, f"{P}_request_prompt_tokens", ml, prompt)
        if cached is not None:
            store.inc(ts, f"{P}_reuse_achieved_tokens", ml, cached)
            store.add_own(ts, ("record_cached", rec.worker), cached)
            store.add_own(ts, ("record_prompt", rec.worker), prompt)
        if predicted is not None:
            store.inc(ts, f"{P}_reuse_predicted_tokens", ml, predicted)
            if cached is not None:
                store.inc(ts, f"{P}_index_staleness_tokens", ml, max(0, predicted - cached))

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
        own = v.hit_on_worker if cached is None else blocks_of(cached, prompt, len(hashes), bs)
        others_out = {t for t, kind in self.pool.left_pool_targets() if kind == "worker"}
        others_out.add(worker)  # the chosen worker counts with ``own``
        best = max(own, match.best_depth(others_out))
        # what the engine reused was available, whatever the block rounding: achieved ≤ available
        available = max(tokens_of(best, prompt, bs), min(cached or 0, prompt))
        store.inc(ts, f"{P}_reuse_available_tokens", ml, available)
        if topo is not None and best > 0 and worker in topo:
            store.inc(ts, f"{P}_placement_decisions", ml)
            store.zero(f"{P}_placement_domain_hits", ml)
            if own == best or any(match.depth_on(x) == best for x in self._domain_workers[topo.domain_of(worker)]
                                  if x not in others_out):
                store.inc(ts, f"{P}_placement_domain_hits", ml)
        hit_blocks = blocks_of(cached, prompt, len(hashes), bs) if cached is not None else v.hit_on_worker
        if hit_blocks:
            self.index.record_hits(hashes, hit_blocks, bs)
            tokens = float(cached) if cached is not None else float(hit_blocks * bs)
            self.hotspots.hit(ts, hashes, hit_blocks, tokens, rec.session_key)

    def _session(self, v: RecordView) -> None:
        """Follow-ups, sticky collisions, re-keys, and sessions reshuffled by a pool change."""
        rec, store, ml = v.rec, self.store, v.ml
        key = rec.session_key
        if not key:
            return
        ts, worker, cached = rec.ts, rec.worker, rec.cached_tokens
        segment = rec.segment or UNKNOWN
        pool = self.pool
        turn = self.sessions.observe(key, ts, worker, v.hashes, segment, pool.epoch)
        prev = turn.previous_worker
        if turn.turn == 1:
            self.hotspots.new_session(ts, segment, turn.rekey_of is not None)
            store.zero(f"{P}_session_rekeys", (segment,))
            if turn.rekey_of is None:
                return
            store.inc(ts, f"{P}_session_rekeys", (segment,))
            # A re-keyed conversation's turn is a follow-up of the session it continues: sticky
            # routing should have sent it back to that session's worker.
            continued = self.sessions.get(turn.rekey_of)
            prev = continued.worker if continued is not None else None
        store.inc(ts, f"{P}_followup_requests", ml)
        store.zero(f"{P}_sticky_collisions", ml)
        if prev is not None and prev != worker and not rec.migrated_from and pool.is_healthy(prev):
            store.inc(ts, f"{P}_sticky_collisions", ml)
        if cached is not None:
            store.inc(ts, f"{P}_session_followup_prompt_tokens", ml, rec.prompt_tokens)
            store.inc(ts, f"{P}_session_followup_cached_tokens", ml, cached)
            turn.session.followup_prompt += rec.prompt_tokens
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
        rec, store = v.rec, self.store
        if rec.reports("migrated_from"):
            # A producer that reports migrations (even "none this time") gets both kinds at 0, so
            # the per-minute rates read 0 rather than "no data" until the first migration.
            for k in MIGRATION_KINDS:
                store.zero(f"{P}_session_migrations", (k,))
                if self.topology is not None:
                    store.zero(f"{P}_cross_node_migrations", (k,))
        src = rec.migrated_from
        if not src:
            return
        kind = rec.migration_kind or "hard"
        store.inc(rec.ts, f"{P}_session_migrations", (kind,))
        a, b = self.topo(src), self.topo(rec.worker)
        if a is not None and b is not None:
            store.zero(f"{P}_cross_node_migrations", (kind,))
            if a.node != b.node:
                store.inc(rec.ts, f"{P}_cross_node_migrations", (kind,))

    def _prefill(self, v: RecordView) -> None:
        """Prefill time per token (cold or warm path); the cost of cold prefills and of misses."""
        rec, store, ml = v.rec, self.store, v.ml
        prefill, cached, prompt, ts = rec.prefill_s, rec.cached_tokens, rec.prompt_tokens, rec.ts
        if prefill is None or cached is None:
            return
        cold = cached <= self.cold_reuse_share * prompt
        per_token = prefill / max(1, prompt - cached)
        store.observe(ts, f"{P}_prefill_seconds_per_token", (v.model, "cold" if cold else "warm"), per_token)
        if not cold:
            return
        wt = self.topo(rec.worker)
        store.inc(ts, f"{P}_cold_requests", ml)
        store.observe(ts, f"{P}_cold_prefill_seconds", (v.model, wt.gpu_class if wt else UNKNOWN), prefill)
        gpu_s = prefill * (wt.gpus if wt else 1)
        store.inc(ts, f"{P}_cold_prefill_gpu_seconds", ml, gpu_s)
        if wt is not None:
            store.inc(ts, f"{P}_cold_prefill_cost_usd", ml, gpu_s * wt.price_per_gpu_hour / 3600.0)
        miss = prefill + (rec.queue_s or 0.0) + (rec.migrate_s or 0.0)
        store.observe(ts, f"{P}_prefix_miss_cost_seconds", ml, miss)

    def _router_timings(self, v: RecordView) -> None:
        rec = v.rec
        if rec.async_wait_s is not None:
            self.store.observe(rec.ts, f"{P}_async_prefill_wait_seconds", v.ml, rec.async_wait_s)
        if rec.walk_s is not None:
            self.store.observe(rec.ts, f"{P}_router_tree_walk_seconds", (), rec.walk_s)

    def _fallback(self, v: RecordView) -> None:
        tier, ts = v.rec.fallback_tier, v.rec.ts
        if tier:
            self.store.inc(ts, f"{P}_fallback_requests", (tier,))
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
            self.store.inc(rec.ts, f"{P}_moe_prefix_hits", v.ml)
            self.store.zero(f"{P}_moe_expert_aligned_hits", v.ml)
            if sig == expected:
                self.store.inc(rec.ts, f"{P}_moe_expert_aligned_hits", v.ml)
        self.moe_signatures.observe(first, sig)

    def _admission(self, v: RecordView) -> None:
        admitted = v.rec.admitted_by_affinity
        if admitted is None:
            return
        self.store.inc(v.rec.ts, f"{P}_batch_admissions", v.ml)
        self.store.zero(f"{P}_batch_affinity_admissions", v.ml)
        if admitted:
            self.store.inc(v.rec.ts, f"{P}_batch_affinity_admissions", v.ml)

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
