"""The compiled histogram write (``exporter/core/_histogram_write.pxi``, ``include``d by
``_records_core`` and ``_kv_batch_core``) against ``MetricStore.observe`` and ``observe_many``.

Each module's copy, and each module's own caller of it (``count_evictions``, ``apply_records``), is
driven beside the Python methods over randomized inputs whose times cross window slots and
baseline slots (late ones among them), on histograms with a baseline (plain or healthy) and
without: every cumulative row and sum, window slot, window count, wake and baseline must match,
dictionaries in the same order."""

from __future__ import annotations

import random
from typing import Any

import pytest

from exporter.core import record_slice
from exporter.core.baseline_window import HealthyBaseline, LaggedBuckets
from exporter.core.index.eviction import BatchEvictions
from exporter.core.kv_accounting import _EVICTION_AGE, _KvLabels, reference_evictions
from exporter.core.metric_store import HEALTHY_HISTOGRAM, MetricStore
from exporter.core.record_accounting import _PREFIX_MISS_COST_SECONDS, _WORKER_TTFT_SECONDS
from prefixscope import catalog
from prefixscope.records import RequestRecord
from prefixscope.thresholds import load_thresholds
from tests.exporter.core.test_ingest_fast_paths import _baseline_state
from tests.exporter.core.test_records_core import _ingest, _record, _state

MODULES = ("exporter.core._records_core", "exporter.core._kv_batch_core")
# One histogram with a baseline (the cold-prefill one) and two without.
METRICS = (HEALTHY_HISTOGRAM, _WORKER_TTFT_SECONDS, _EVICTION_AGE)


def _compiled(name: str) -> Any:
    return pytest.importorskip(name, reason="the compiled core is not built")


def _held(store: MetricStore) -> Any:
    """Everything a histogram write can touch, in dictionary order."""
    return ([(m, list(series.items())) for m, series in store.cum.histograms.items()],
            [(m, list(hw.counts.items()), sorted(hw._slots.by_step), hw._slots.tail and hw._slots.tail.lo,
              [(s.first, s.last, s.lo, list(s.rows.items())) for s in hw._slots.slots])
             for m, hw in store.hwin.items()],
            {m: _baseline_state(lw) for m, lw in store.baselines.items()},
            store.wake.at)


def _value(rng: random.Random, bounds: tuple[float, ...]) -> float:
    """A value in some bucket: on a bound (``le`` takes it), between two, past the last, at or
    below zero, now and then an int."""
    kind = rng.random()
    if kind < 0.25:
        return rng.choice(bounds)
    if kind < 0.35:
        return rng.choice((0, 0.0, -1.0, bounds[-1] * 3, int(bounds[-1]) + 1))
    return rng.random() * bounds[-1] * 1.2


def _labels(rng: random.Random, metric: str) -> tuple[str, ...]:
    n = len(catalog.METRICS_BY_NAME[metric].labels)
    return tuple(f"v{rng.randrange(3)}" for _ in range(n))


@pytest.mark.parametrize("healthy", [False, True])
@pytest.mark.parametrize("module", MODULES)
def test_each_modules_histogram_write_is_the_stores(module: str, healthy: bool) -> None:
    """``observe_histogram`` and ``observe_histogram_many`` of one module against the store's
    methods: first observations (the window made by the method), single and batched values (none
    too), late inputs into older window and baseline slots, expiry and baseline advances."""
    core = _compiled(module)
    rng = random.Random(2 * MODULES.index(module) + healthy)
    thresholds = load_thresholds() if healthy else None
    fast, ref = (MetricStore(20.0, baseline_s=90.0, thresholds=thresholds) for _ in range(2))
    kind = HealthyBaseline if healthy else LaggedBuckets
    assert type(fast.baselines[HEALTHY_HISTOGRAM]) is kind and METRICS[1] not in fast.baselines
    now = 1_700_000_000.0
    for step in range(4000):
        now += rng.choice((0.0, 0.001, 0.3, 0.3, 0.9, 2.5, 15.0, 40.0))
        at = now - rng.choice((0.0, 0.0, 0.0, 0.6, 3.0, 16.0, 45.0))
        metric = rng.choice(METRICS)
        bounds = tuple(catalog.METRICS_BY_NAME[metric].buckets or ())
        labels = _labels(rng, metric)
        if rng.random() < 0.5:
            value = _value(rng, bounds)
            core.observe_histogram(fast, at, metric, labels, value)
            ref.observe(at, metric, labels, value)
        else:
            values = [_value(rng, bounds) for _ in range(rng.choice((0, 1, 2, 5, 12)))]
            core.observe_histogram_many(fast, at, metric, labels, values)
            ref.observe_many(at, metric, labels, values)
        if step % 5 == 0:
            for store in (fast, ref):
                store.expire(now)
        if step % 13 == 0:  # a reader's advance to an input's own (older) time
            for store in (fast, ref):
                store.advance_baselines(at)
        assert _held(fast) == _held(ref), step
    assert all(fast.hwin[m].counts for m in METRICS)
    assert fast.baselines[HEALTHY_HISTOGRAM].counts  # (slots did age into the baseline)


@pytest.mark.parametrize("baseline", [False, True])
def test_the_compiled_eviction_ages_are_the_stores_with_or_without_a_baseline(baseline: bool) -> None:
    """``_kv_batch_core.count_evictions`` against ``reference_evictions`` (``MetricStore.observe_many``)
    with the age histogram given a baseline of its own or not: the compiled write feeds it as the
    store does."""
    count_evictions = _compiled("exporter.core._kv_batch_core").count_evictions
    rng = random.Random(23 + baseline)
    fast, ref = MetricStore(20.0, baseline_s=60.0), MetricStore(20.0, baseline_s=60.0)
    if baseline:
        bounds = catalog.METRICS_BY_NAME[_EVICTION_AGE].buckets
        for store in (fast, ref):
            store.baselines[_EVICTION_AGE] = LaggedBuckets(60.0, 20.0, bounds, wake=store.wake)
    labels = {w: _KvLabels(w) for w in ("w0", "w1")}
    ts = 1_700_000_000.0
    for step in range(3000):
        ts += rng.choice((0.0, 0.01, 0.4, 1.1, 7.0, 16.0))
        at = ts - rng.choice((0.0, 0.0, 1.5, 20.0))
        ages = [(rng.random() * 400, rng.random() < 0.4) for _ in range(rng.choice((0, 1, 3, 9)))]
        ev = BatchEvictions(stored=rng.choice((0, 4)), restored=0, evicted=rng.choice((0, 1, 5)), ages=ages)
        kl = labels[rng.choice(tuple(labels))]
        count_evictions(fast, kl, at, ev, _EVICTION_AGE)
        reference_evictions(ref, kl, at, ev, _EVICTION_AGE)
        if step % 3 == 0:
            fast.expire(ts)
            ref.expire(ts)
        assert _held(fast) == _held(ref), step
    assert not baseline or fast.baselines[_EVICTION_AGE].counts


@pytest.mark.skipif(record_slice.CORE != "compiled", reason="the compiled core is not built")
def test_the_records_histograms_and_baselines_are_the_stores() -> None:
    """``_records_core.apply_records`` against ``reference_apply_records`` (``MetricStore.observe``),
    read for what the histogram write touches, baselines included: TTFT and miss cost (no baseline)
    and cold prefill (a healthy baseline), over record times that cross window and baseline slots."""
    rng = random.Random(31)
    compiled, reference = _state(False), _state(False)
    assert isinstance(compiled.store.baselines[HEALTHY_HISTOGRAM], HealthyBaseline)
    now, n = 10.0, 0
    while now < 400.0:
        now += rng.choice((0.0, 0.3, 0.7, 1.5, 9.0, 16.0))
        records = []
        for _ in range(rng.randrange(1, 30)):
            n += 1
            records.append(_record(rng, now - rng.random() * rng.choice((0.0, 0.5, 3.0, 20.0)), n))
        for st, apply in ((compiled, record_slice.apply_records), (reference, record_slice.reference_apply_records)):
            batch = [RequestRecord.from_json(r) if "worker" in r else dict(r) for r in records]
            _ingest(st, batch, now, apply)
        assert _held(compiled.store) == _held(reference.store), now
    held = compiled.store
    assert all(held.hwin[m].counts for m in (HEALTHY_HISTOGRAM, _WORKER_TTFT_SECONDS, _PREFIX_MISS_COST_SECONDS))
    assert held.baselines[HEALTHY_HISTOGRAM].counts

