"""The compiled per-record work (``exporter.core._records_core``) against its Python reference
(``record_slice.reference_apply_records``): randomized record streams — sessions new and
returning, re-keys, label values past their limits, adapters and tenants, a topology, pool
changes, malformed objects — through two states, one per implementation, leave the same
counters, windows, baselines, sessions, hit history, signals, errors, /metrics and API answers."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

import exporter.core.state as state_module
from exporter.config import Limits
from exporter.core import record_slice
from exporter.core.checks import evaluate
from exporter.core.health import Health
from exporter.core.state import ClusterState
from exporter.model import BlockRemoved, BlockStored, KvBatch
from exporter.web.api import ApiBuilders
from exporter.web.collector import PrefixscopeCollector
from prefixscope.records import RequestRecord
from prefixscope.thresholds import load_thresholds
from tests.exporter.core.test_record_batches import _Topo

pytestmark = pytest.mark.skipif(record_slice.CORE != "compiled", reason="the compiled core is not built")

# Chains that share prefixes (a system prompt), extend one another (a session's later turns) and
# do not (another family); a few long ones for the sessions' anchors past depth 16.
BASE = [(1, 2, 3, 4), (1, 2, 5), (1, 2, 3, 4, 6, 7), (8, 9), (1, 2, 3, 4, 6, 7, 10), (11,),
        tuple(range(100, 140)), tuple(range(100, 170)), (1, 2, 3, 4, 6, 7, 10, 12, 13)]
WORKERS = ("w0", "w1", "w2", "w3", "w4", "w5")


def _chain(rng: random.Random) -> list[int]:
    chain = list(rng.choice(BASE))
    if rng.random() < 0.3:  # a fresh tail: a new turn's blocks
        chain += [rng.randrange(1000, 1_000_000) for _ in range(rng.randrange(1, 6))]
    if rng.random() < 0.05:
        chain.append(2**64 - 1)  # the largest hash a record may carry
    return chain


def _record(rng: random.Random, ts: float, n: int) -> dict[str, Any]:
    prompt = rng.choice((16, 40, 64, 100, 3000))
    rec: dict[str, Any] = {"ts": ts, "request_id": f"r{n}", "worker": rng.choice(WORKERS), "prompt_tokens": prompt}
    maybe = {
        "model": lambda: rng.choice(("m1", "m2", "m3", None)),
        "session_key": lambda: f"s{rng.randrange(12)}" if rng.random() < 0.8 else f"new{n}",
        "block_hashes": lambda: _chain(rng),
        "block_size": lambda: rng.choice((16, 32, None)),
        "cached_tokens": lambda: rng.choice((0, 16, 32, prompt, None)),
        "predicted_cached_tokens": lambda: rng.choice((0, 16, 48)),
        "ttft_s": lambda: rng.random() / 2,
        "prefill_s": lambda: rng.random() * rng.choice((0.1, 3.0)),
        "queue_s": lambda: rng.choice((rng.random() / 7, None)),
        "migrate_s": lambda: rng.random() / 3,
        "migrated_from": lambda: rng.choice(("w0", "w2", None)),
        "migration_kind": lambda: rng.choice(("soft", "hard")),
        "walk_s": lambda: rng.random() / 1000,
        "async_wait_s": lambda: rng.random() / 11,
        "fallback_tier": lambda: rng.choice(("warm_pool", "re_sticky")),
        "expert_signature": lambda: rng.choice(("e1", "e2")),
        "admitted_by_affinity": lambda: rng.random() < 0.5,
        "segment": lambda: rng.choice(("web", "api", "batch", None)),
        "lora_name": lambda: rng.choice(("sql", "chat", None)),
        "tenant": lambda: rng.choice(("acme", "beta", "gamma", None)),
    }
    common = ("session_key", "block_hashes", "cached_tokens", "prefill_s", "model", "ttft_s")
    for name, make in maybe.items():
        if rng.random() < (0.85 if name in common else 0.25):
            rec[name] = make()
    if rng.random() < 0.04:  # a conversation's next turn under a new key (a re-key) or its own
        unique = [10**7 + 1000 * (n % 7) + i for i in range(120 + n % 3)]
        rec["block_hashes"] = unique[:rng.randrange(90, len(unique) + 1)]
        rec["session_key"] = f"k{n}" if rng.random() < 0.7 else f"c{n % 7}"
    if rng.random() < 0.01:
        del rec["worker"]  # unprocessable: counted and skipped, the rest of the slice goes on
    return rec


def _state(topology: bool) -> ClusterState:
    limits = Limits(models=2, segments=2, workers=4, label_idle=1.0, adapters=2, tenants=2)
    st = ClusterState.build(Health(), load_thresholds(), topology=_Topo() if topology else None,  # type: ignore[arg-type]
                            window_s=60, limits=limits, clock=lambda: 0.0, max_sessions=10)
    st.apply_kv_batch(KvBatch("w1", 0, 1.0, (BlockStored((1, 2, 3, 4), None, 16), BlockStored((6,), 4, 16))), 1.0)
    st.apply_kv_batch(KvBatch("w2", 0, 1.0, (BlockStored((1, 2, 5), None, 16),)), 1.0)
    st.apply_kv_batch(KvBatch("w0", 0, 1.0, (BlockStored(tuple(range(100, 130)), None, 16),)), 1.0)
    return st


def _held(st: ClusterState) -> Any:
    s, acc = st.store, st.accounting
    sessions = [(x.key, x.worker, x.first_ts, x.last_ts, x.segment, x.turn, x.followup_prompt, x.followup_cached,
                 x.first_chain_len, x.chain_len, x.anchors, x.pool_epoch) for x in st.sessions.sessions()]
    return [[(m, list(series.items())) for m, series in s.cum.counters.items()],
            [(m, list(series.items())) for m, series in s.cum.histograms.items()],
            list(s.win.sums.items()), list(s.own.sums.items()), dict(s.win._n), dict(s.own._n),
            [(slot.first, slot.last, list(slot.rows.items())) for slot in s.win._slots.slots],
            [(slot.first, slot.last, list(slot.rows.items())) for slot in s.own._slots.slots],
            [(m, list(hw.counts.items()), [(x.first, x.last, list(x.rows.items())) for x in hw._slots.slots])
             for m, hw in s.hwin.items()],
            s.win._slots.events, s.own._slots.events,
            sessions, list(st.sessions._held.items()), st.sessions.shared_depth, st.sessions.evicted,
            list(st.hotspots.hit_events), list(st.hotspots.session_events), st.hotspots._next_seq,
            dict(acc.field_seen), acc.keyed_record_ts, dict(acc.fallback_last), dict(acc._reshuffle_counted),
            [(b.label, list(b._last.items()), b.folded, b.due) for b in acc.labels.budgets],
            [(b.label, list(b._last.items()), b.folded) for b in (st.attribution.records.adapter,
                                                                  st.attribution.records.tenant)],
            st.attribution.records.named,
            sorted((w.name, w.last_seen, w.last_served) for w in st.worker_pool.workers.values()),
            {k: dict(v) for k, v in st.health.counters.items()}]


def _exposition(st: ClusterState) -> str:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(PrefixscopeCollector(st, st.health))
    return generate_latest(reg).decode()


def _answers(st: ClusterState, now: float) -> str:
    routes = ApiBuilders(st).routes()
    payload = {name: routes[name]({}) for name in ("groups", "hotspots", "workers", "changes", "sessions")
               if name in routes}
    payload["checks"] = repr(evaluate(st, now=now))
    return json.dumps(payload, sort_keys=True, default=repr)


def _ingest(st: ClusterState, records: list[Any], now: float, apply: Any) -> None:
    saved = state_module.apply_records
    state_module.apply_records = apply
    try:
        st.ingest_records(records, now)
    finally:
        state_module.apply_records = saved


@pytest.mark.parametrize("topology", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_compiled_records_equal_the_reference(seed: int, topology: bool) -> None:
    rng = random.Random(seed)
    compiled, reference = _state(topology), _state(topology)
    now, n = 10.0, 0
    while now < 500.0:
        now += rng.choice((0.0, 0.2, 0.7, 1.5, 9.0, 70.0 if rng.random() < 0.05 else 0.3))
        if rng.random() < 0.1:  # the index and the pool change under the records
            w = rng.choice(WORKERS)
            ev = (BlockStored(tuple(_chain(rng)), None, 16) if rng.random() < 0.6
                  else BlockRemoved((rng.choice((3, 4, 5, 120)),)))
            for st in (compiled, reference):
                st.apply_kv_batch(KvBatch(w, 0, now, (ev,)), now)
        records = []
        for _ in range(rng.randrange(1, 40)):
            n += 1
            records.append(_record(rng, now - rng.random() * rng.choice((0.0, 0.5, 3.0)), n))
        typed = rng.random() < 0.5  # the intake's typed records, or plain objects (replays, the lab)
        for st, apply in ((compiled, record_slice.apply_records), (reference, record_slice.reference_apply_records)):
            batch = [RequestRecord.from_json(r) if typed and "worker" in r else dict(r) for r in records]
            _ingest(st, batch, now, apply)
        assert _held(compiled) == _held(reference), (seed, now)
    assert _exposition(compiled) == _exposition(reference), seed
    assert _answers(compiled, now) == _answers(reference, now), seed
