"""Records applied in slices with counter writes held back to the slice's end (and cold-prefill
baselines kept between their changes) read exactly as records applied one write at a time: the
same /metrics, the same API answers, the same windows."""

from __future__ import annotations

import contextlib
import json
import random
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

from exporter.config import Limits
from exporter.core.checks import evaluate
from exporter.core.health import Health
from exporter.core.state import ClusterState
from exporter.model import BlockStored, KvBatch
from exporter.web.api import ApiBuilders
from exporter.web.collector import PrefixscopeCollector
from prefixscope.thresholds import load_thresholds


class _Topo:
    """Two nodes, one NVLink domain each; w3 is not in the topology."""

    class W:
        def __init__(self, name: str, node: str) -> None:
            self.name, self.node, self.nvlink_domain, self.gpu_class = name, node, node + "-d", "H100"
            self.gpus, self.price_per_gpu_hour, self.warm_pool, self.kv_blocks, self.max_concurrency = 2, 3.7, True, 100, 8

    def __init__(self) -> None:
        self.block_size = 16
        self._w = {n: self.W(n, node) for n, node in (("w0", "n0"), ("w1", "n0"), ("w2", "n1"))}
        self.warm_pool = ("w0",)
        self.workers = tuple(self._w.values())

    def __contains__(self, n: str) -> bool:
        return n in self._w

    def worker(self, n: str) -> Any:
        return self._w[n]

    def domain_of(self, n: str) -> str:
        return self._w[n].nvlink_domain


CHAINS = [(1, 2, 3, 4), (1, 2, 5), (1, 2, 3, 4, 6, 7), (8, 9), (1, 2, 3, 4, 6, 7, 10), (11,)]


def _record(rng: random.Random, ts: float, n: int) -> dict[str, Any]:
    prompt = rng.choice((16, 40, 64, 100, 3000))
    rec: dict[str, Any] = {"ts": ts, "request_id": f"r{n}", "worker": f"w{rng.randrange(5)}", "prompt_tokens": prompt}
    maybe = {
        "model": lambda: rng.choice(("m1", "m2", "m3")),
        "session_key": lambda: f"s{rng.randrange(8)}",
        "block_hashes": lambda: list(rng.choice(CHAINS)),
        "block_size": lambda: rng.choice((16, 32)),
        "cached_tokens": lambda: rng.choice((0, 16, 32, prompt, None)),
        "predicted_cached_tokens": lambda: rng.choice((0, 16, 48)),
        "prefill_s": lambda: rng.random() * rng.choice((0.1, 3.0)),
        "queue_s": lambda: rng.random() / 7,
        "migrate_s": lambda: rng.random() / 3,
        "migrated_from": lambda: rng.choice(("w0", "w2", None)),
        "migration_kind": lambda: rng.choice(("soft", "hard")),
        "walk_s": lambda: rng.random() / 1000,
        "async_wait_s": lambda: rng.random() / 11,
        "fallback_tier": lambda: rng.choice(("warm_pool", "random")),
        "expert_signature": lambda: rng.choice(("e1", "e2")),
        "admitted_by_affinity": lambda: rng.random() < 0.5,
        "segment": lambda: rng.choice(("web", "api", "batch")),
        "lora_name": lambda: rng.choice(("sql", None)),
        "tenant": lambda: rng.choice(("acme", "beta", None)),
    }
    for name, make in maybe.items():
        if rng.random() < 0.6:
            rec[name] = make()
    return rec


def _states() -> tuple[ClusterState, ClusterState]:
    limits = Limits(models=2, segments=2, workers=4, label_idle=1.0, adapters=2, tenants=2)
    out = []
    for _ in range(2):
        st = ClusterState.build(Health(), load_thresholds(), topology=_Topo(), window_s=60, limits=limits,  # type: ignore[arg-type]
                          clock=lambda: 0.0)
        st.apply_kv_batch(KvBatch("w1", 0, 1.0, (BlockStored((1, 2, 3, 4), None, 16), BlockStored((6,), 4, 16))), 1.0)
        st.apply_kv_batch(KvBatch("w2", 0, 1.0, (BlockStored((1, 2, 5), None, 16),)), 1.0)
        out.append(st)
    batched, one_by_one = out
    one_by_one.store.batch = contextlib.nullcontext  # type: ignore[method-assign]
    one_by_one.accounting._baselines = _Forgetful()  # every missed request's baseline derived afresh
    return batched, one_by_one


class _Forgetful(dict):  # type: ignore[type-arg]
    """A cache that keeps nothing."""

    def __setitem__(self, key: object, value: object) -> None:
        pass


def _exposition(st: ClusterState) -> str:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(PrefixscopeCollector(st, st.health))
    return generate_latest(reg).decode()


def _held(st: ClusterState) -> list[Any]:
    """The store's contents in their order (a float sum depends on the order of its terms)."""
    s = st.store
    return [[(m, list(series.items())) for m, series in s.cum.counters.items()],
            list(s.win.sums.items()), list(s.own.sums.items()), dict(s.win._n), dict(s.own._n),
            [(slot.first, slot.last, list(slot.rows.items())) for slot in s.win._slots.slots],
            [(slot.first, slot.last, list(slot.rows.items())) for slot in s.own._slots.slots],
            s.win._slots.events, s.own._slots.events]


def _answers(st: ClusterState, now: float) -> str:
    routes = ApiBuilders(st).routes()
    payload = {name: routes[name]({}) for name in ("groups", "hotspots", "workers", "changes")}
    payload["checks"] = repr(evaluate(st, now=now))
    return json.dumps(payload, sort_keys=True, default=repr)


def test_batched_slices_equal_writes_one_at_a_time() -> None:
    for seed in range(3):
        rng = random.Random(seed)
        batched, one_by_one = _states()
        now, n = 10.0, 0
        while now < 400.0:
            now += rng.choice((0.0, 0.2, 0.7, 1.5, 9.0, 70.0 if rng.random() < 0.05 else 0.3))
            records = []
            for _ in range(rng.randrange(1, 40)):
                n += 1
                records.append(_record(rng, now - rng.random() * rng.choice((0.0, 0.5, 3.0)), n))
            for st in (batched, one_by_one):
                st.ingest_records([dict(r) for r in records], now)
            assert _held(batched) == _held(one_by_one), (seed, now)
        assert _exposition(batched) == _exposition(one_by_one), seed
        assert _answers(batched, now) == _answers(one_by_one, now), seed
