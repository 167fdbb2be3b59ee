"""The per-batch fast paths of KV ingest give the same results as the full work they skip.

``HealthIncreases.sample`` returns at once while no watched total moved and no sample can be
due; ``KvAccounting.count_evictions`` writes through label tuples built once per worker. Each
is compared here with the plain computation it replaces.
"""

from __future__ import annotations

import math
import random

import pytest

from exporter.core.baseline_window import HealthyBaseline, LaggedBuckets
from exporter.core.health import Health
from exporter.core.health_window import HealthIncreases
from exporter.core.index.eviction import BatchEvictions
from exporter.core.index.prefix_instability import EARLY_SPAN_BLOCKS, MIN_SHARED_BLOCKS, RootTracker
from exporter.core.input_time import InputTime
from exporter.core.kv_accounting import (
    _BLOCKS_EVICTED,
    _BLOCKS_RESTORED,
    _BLOCKS_STORED,
    _EVICTION_AGE,
    KV_APPLIED,
    KV_LAG,
    KV_LAST_TS,
    _KvLabels,
    reference_evictions,
    reference_stream_batch,
)
from exporter.core.metric_store import HEALTHY_HISTOGRAM, MetricStore
from exporter.core.state import ClusterState
from exporter.core.windows import Wake, WindowedSum
from exporter.model import BlockStored
from prefixscope.thresholds import load_thresholds

_NAMES = ("prefixscope_kv_event_missed_batches", "prefixscope_ingest_errors")
COLD = HEALTHY_HISTOGRAM  # the histogram whose baseline keeps its healthy windows apart


def _increases(window_s: float) -> tuple[Health, InputTime, HealthIncreases]:
    health = Health()
    clock = InputTime()
    return health, clock, HealthIncreases(health, clock, window_s, _NAMES)


def test_health_sample_skips_only_what_a_full_pass_would_not_change() -> None:
    rng = random.Random(3)
    fast_h, fast_t, fast = _increases(40.0)
    full_h, full_t, full = _increases(40.0)
    ts = 1000.0
    for step in range(3000):
        ts += rng.choice((0.01, 0.01, 0.3, 2.0, 9.5))
        for health, clock in ((fast_h, fast_t), (full_h, full_t)):
            clock.advance(ts)
            if step % 53 == 0:
                health.inc("prefixscope_kv_event_missed_batches", ("w0",), 2)
            if step % 211 == 0:
                health.error("kv", "bad_payload", "test")
        full._quiet_until = float("-inf")  # the reference always takes the full pass
        fast.sample()
        full.sample()
        assert {k: list(v) for k, v in fast._samples.items()} == {k: list(v) for k, v in full._samples.items()}
        for name in _NAMES:
            assert fast.increase(name) == full.increase(name)


def _count_evictions_reference(store: MetricStore, worker: str, ev: BatchEvictions, ts: float) -> None:
    """The eviction series of one batch, written one label tuple at a time."""
    lab = (worker,)
    if ev.stored:
        incs = [(_BLOCKS_STORED, lab, ev.stored), (_BLOCKS_RESTORED, lab, ev.restored)]
        if ev.evicted:
            incs.append((_BLOCKS_EVICTED, lab, ev.evicted))
        store.inc_many(ts, incs)
    elif ev.evicted:
        store.inc(ts, _BLOCKS_EVICTED, lab, ev.evicted)
    ages = ev.ages
    if ages:
        for flag in ((True, False) if ages[0][1] else (False, True)):
            store.observe_many(ts, _EVICTION_AGE, (worker, "true" if flag else "false"),
                               [age for age, reused in ages if reused is flag])


def test_eviction_series_match_the_plain_writes() -> None:
    rng = random.Random(5)
    st = ClusterState.build(Health(), load_thresholds(), window_s=30, clock=lambda: 0.0)
    ref = MetricStore(30.0)
    ts = 100.0
    for _ in range(2000):
        ts += rng.choice((0.01, 0.5, 7.0))
        worker = rng.choice(("w0", "w1", "w2"))
        ages = [(rng.random() * 50, rng.random() < 0.4) for _ in range(rng.choice((0, 0, 1, 3)))]
        ev = BatchEvictions(stored=rng.choice((0, 0, 4, 30)), restored=rng.choice((0, 1)),
                            evicted=rng.choice((0, 1, 5)), ages=ages)
        st.kv.count_evictions(worker, ev, ts)
        _count_evictions_reference(ref, worker, ev, ts)
        st.store.expire(ts)
        ref.expire(ts)
        assert st.store.cum.counters == ref.cum.counters
        assert st.store.cum.histograms == ref.cum.histograms
        assert st.store.win.sums == ref.win.sums
        assert {m: hw.counts for m, hw in st.store.hwin.items()} == {m: hw.counts for m, hw in ref.hwin.items()}


def test_the_compiled_eviction_series_are_the_reference_writes() -> None:
    """``_kv_batch_core.count_evictions`` against ``reference_evictions`` over random batches: every
    counter, window slot, key count, histogram row and sum, with late batches and writes held back
    inside the store's batch now and then."""
    count_evictions = pytest.importorskip("exporter.core._kv_batch_core", reason="the compiled core is not built"
                                          ).count_evictions

    rng = random.Random(17)
    fast, ref = MetricStore(30.0), MetricStore(30.0)
    labels = {w: _KvLabels(w) for w in ("w0", "w1", "w2")}
    ts = 1_700_000_000.0
    for step in range(3000):
        ts += rng.choice((0.0, 0.01, 0.5, 7.0))
        at = ts - rng.choice((0.0, 0.0, 2.0))
        ages = [(rng.random() * 50, rng.random() < 0.4) for _ in range(rng.choice((0, 0, 1, 3, 8)))]
        ev = BatchEvictions(stored=rng.choice((0, 0, 4, 30)), restored=rng.choice((0, 1)),
                            evicted=rng.choice((0, 1, 5)), ages=ages)
        kl = labels[rng.choice(tuple(labels))]
        if step % 11 == 0:
            for store, write in ((fast, count_evictions), (ref, reference_evictions)):
                with store.batch():
                    write(store, kl, at, ev, _EVICTION_AGE)
                    write(store, kl, at, ev, _EVICTION_AGE)
        else:
            count_evictions(fast, kl, at, ev, _EVICTION_AGE)
            reference_evictions(ref, kl, at, ev, _EVICTION_AGE)
        fast.expire(ts)
        ref.expire(ts)
        assert fast.cum.counters == ref.cum.counters and fast.cum.histograms == ref.cum.histograms
        assert fast.win.sums == ref.win.sums and fast.win._n == ref.win._n
        assert fast.win._slots.events == ref.win._slots.events
        assert [(s.first, s.last, s.rows) for s in fast.win._slots.slots] == \
            [(s.first, s.last, s.rows) for s in ref.win._slots.slots]
        assert {m: (hw.counts, [(s.last, s.rows) for s in hw._slots.slots]) for m, hw in fast.hwin.items()} == \
            {m: (hw.counts, [(s.last, s.rows) for s in hw._slots.slots]) for m, hw in ref.hwin.items()}
        assert [list(d) for d in (fast.win.sums, fast.cum.counters)] == [list(d) for d in (ref.win.sums, ref.cum.counters)]


def test_the_compiled_stream_writes_are_the_reference_update() -> None:
    """``_kv_batch_core.stream_batch`` against ``reference_stream_batch`` over random batches: every
    counter, total, gauge, change count and follower's changes, in the same order."""
    stream_batch = pytest.importorskip("exporter.core._kv_batch_core", reason="the compiled core is not built"
                                       ).stream_batch

    rng = random.Random(19)
    fast, ref = Health(), Health()
    follows = [(h, h.follow(KV_LAST_TS), h.follow(KV_LAG)) for h in (fast, ref)]
    labels = {w: _KvLabels(w) for w in ("w0", "w1", "w2")}
    ts = 1_700_000_000.0
    for step in range(3000):
        ts += rng.choice((0.0, 0.01, 0.5))
        kl = labels[rng.choice(tuple(labels))]
        lag = rng.choice((0.0, 0.0, 0.25, rng.random()))
        stored, removed = rng.choice((0, 1, 2)), rng.choice((0, 1))
        stream_batch(fast, kl, ts, lag, stored, removed, KV_APPLIED, KV_LAST_TS, KV_LAG)
        reference_stream_batch(ref, kl, ts, lag, stored, removed, KV_APPLIED, KV_LAST_TS, KV_LAG)
        assert fast.counters == ref.counters and fast.gauges == ref.gauges
        assert fast._totals == ref._totals and fast._gauge_writes == ref._gauge_writes
        assert [list(d) for d in fast.counters.values()] == [list(d) for d in ref.counters.values()]
        if step % 97 == 0:  # what each follower collected since the last look, in the same order
            (_f, f_last, f_lag), (_r, r_last, r_lag) = follows
            assert (fast.take(f_last), fast.take(f_lag)) == (ref.take(r_last), ref.take(r_lag))


def _expire_every_window(store: MetricStore, now: float) -> None:
    """MetricStore.expire without its early returns: every window and baseline asked in turn."""
    store.flush()
    store.win.expire(now)
    store.own.expire(now)
    for hw in store.hwin.values():
        hw.expire(now)
    _advance_every_baseline(store, now)


def _advance_every_baseline(store: MetricStore, now: float) -> None:
    """MetricStore.advance_baselines without its early return."""
    for lw in store.baselines.values():
        lw.advance(now)


def _baseline_state(lw: LaggedBuckets) -> dict[str, object]:
    """Everything a baseline holds (a healthy one's weights by slot, not by the slot's id)."""
    slots = [*lw._pending, *lw._active]
    out: dict[str, object] = {"pending": list(lw._pending), "active": list(lw._active), "counts": lw.counts,
                              "version": lw.version}
    if isinstance(lw, HealthyBaseline):
        out.update(window=lw.window, plain=lw.plain, healthy=lw.healthy, tick=lw._tick,
                   weights=[(idx, lw._weights.get(id(slot))) for idx, slot in slots])
    return out


def test_store_expiry_skips_only_when_no_window_has_a_slot_to_drop() -> None:
    rng = random.Random(7)
    fast, full = MetricStore(20.0), MetricStore(20.0)
    ts = 50.0
    for _ in range(3000):
        ts += rng.choice((0.01, 0.2, 1.5, 25.0))
        at = ts - rng.choice((0.0, 0.0, 3.0))  # now and then a late input
        kind, age = rng.random(), rng.random() * 30
        for store in (fast, full):
            if kind < 0.4:
                store.inc(at, _BLOCKS_STORED, ("w0",), 3)
            elif kind < 0.6:
                store.add_own(at, ("own", "w1"), 1.0)
            elif kind < 0.8:
                store.observe_many(at, _EVICTION_AGE, ("w0", "true"), [age])
        fast.expire(ts)
        _expire_every_window(full, ts)
        assert fast.win.sums == full.win.sums and fast.own.sums == full.own.sums
        assert {m: hw.counts for m, hw in fast.hwin.items()} == {m: hw.counts for m, hw in full.hwin.items()}
        assert [len(w) for w in (fast.win, fast.own)] == [len(w) for w in (full.win, full.own)]
        assert {m: b.counts for m, b in fast.baselines.items()} == {m: b.counts for m, b in full.baselines.items()}


def test_store_wake_skips_only_inputs_at_which_no_window_or_baseline_acts() -> None:
    """Windows and baselines (a healthy one among them) against the same store asked at every
    input: late observations open slots older than the rest, the clock crosses slot edges, window
    ends and baseline spans, and a reader advances the baselines to an earlier time."""
    rng = random.Random(13)
    thresholds = load_thresholds()
    fast, full = (MetricStore(20.0, baseline_s=90.0, thresholds=thresholds) for _ in range(2))
    assert any(isinstance(lw, HealthyBaseline) for lw in fast.baselines.values())
    now = 1_700_000_000.0
    skipped = 0
    for step in range(6000):
        now += rng.choice((0.001, 0.01, 0.2, 0.2, 1.5, 4.0, 15.0, 40.0))
        at = now - rng.choice((0.0, 0.0, 0.0, 0.5, 3.0, 16.0, 30.0, 120.0))  # now and then a late input
        kind, value = rng.random(), rng.random() * 30
        labels = ("m", rng.choice(("H100", "A100")), rng.choice(("0-1k", "1k-4k")))
        for store in (fast, full):
            if kind < 0.3:
                store.inc(at, _BLOCKS_STORED, ("w0",), 3)
            elif kind < 0.4:
                store.add_own(at, ("own", "w1"), 1.0)
            elif kind < 0.55:
                store.observe_many(at, _EVICTION_AGE, ("w0", "true"), [value])
            elif kind < 0.75:
                store.observe(at, COLD, labels, value / 10)
            elif kind < 0.8:
                store.baselines[COLD].observe(at, labels, value / 10)  # another shard's record
        before = fast.wake.at
        if step % 7 == 0:  # a reader asks for the baselines at an input's own (older) time
            fast.advance_baselines(at)
            _advance_every_baseline(full, at)
        fast.expire(now)
        _expire_every_window(full, now)
        skipped += now < before
        assert fast.win.sums == full.win.sums and fast.own.sums == full.own.sums
        assert {m: hw.counts for m, hw in fast.hwin.items()} == {m: hw.counts for m, hw in full.hwin.items()}
        assert [len(w) for w in (fast.win, fast.own)] == [len(w) for w in (full.win, full.own)]
        assert {m: sorted(hw._slots.by_step) for m, hw in fast.hwin.items()} == \
            {m: sorted(hw._slots.by_step) for m, hw in full.hwin.items()}
        assert {m: _baseline_state(b) for m, b in fast.baselines.items()} == \
            {m: _baseline_state(b) for m, b in full.baselines.items()}
    assert skipped > 1000  # (the skip is taken, not only allowed)


def test_the_wake_margin_covers_the_rounding_of_an_expiry_test() -> None:
    """Just before a slot's due time by the margin, the window's own test says not due yet."""
    for t in (0.0, 1e-3, 1.0, 86_400.0, 1.7e9, 4.1e9, 1e12):
        for window in (1.0, 20.0, 300.0, 86_400.0):
            wake = Wake()
            wake.set(math.inf)  # a pass found nothing to do
            w = WindowedSum(window, wake=wake)
            w.add(t, "k")
            assert w._slots.wake is not None
            before = w._slots.wake.at
            assert before < t + window and not w._slots.due(before)
            assert t + window - before < 1e-6 * (1.0 + t)  # a hair, never a step of the window
            assert w._slots.due(t + window + 1e-6 * (1.0 + t))


class _PlainKeys(RootTracker):
    """Content keys as each span's whole tail hashed on its own (what the nested digests replace)."""

    @staticmethod
    def _keys(opening: tuple[int, ...], blocks: int, bs: int) -> tuple[tuple[int, int, int], ...]:
        return tuple((s, blocks, hash(opening[s * bs:])) for s in range(1, EARLY_SPAN_BLOCKS + 1)
                     if blocks - s >= MIN_SHARED_BLOCKS)


def test_nested_root_digests_judge_roots_as_whole_tail_hashes_do() -> None:
    rng = random.Random(11)
    bs = 4
    templates = [[rng.randrange(50) for _ in range(40 * bs)] for _ in range(6)]
    fast, plain = RootTracker(30.0, max_roots=64), _PlainKeys(30.0, max_roots=64)
    ts, first = 0.0, 1
    for _ in range(3000):
        ts += rng.choice((0.1, 1.0, 12.0))
        blocks = rng.choice((3, 8, 9, 10, 12, 20, 32, 40))
        tokens = list(rng.choice(templates)[:blocks * bs])
        for i in range(rng.choice((0, 1, 2, 3)) * bs):  # an early span that differs (or none)
            if rng.random() < 0.5:
                tokens[i] = rng.randrange(50)
        if rng.random() < 0.05 and len(tokens) > 20 * bs:
            tokens[15 * bs] += 1  # a difference past the span: not a near-duplicate
        first = rng.choice((first, first + 1, rng.randrange(1, first + 2)))
        ev = BlockStored(tuple(range(first, first + blocks)), None, bs, len(tokens), "GPU", tuple(tokens))
        worker = rng.choice(("w0", "w1"))
        got, want = fast.apply(worker, [ev], ts), plain.apply(worker, [ev], ts)
        assert (got.roots, got.unstable) == (want.roots, want.unstable)
        assert fast.example == plain.example and len(fast) == len(plain)
        assert len(fast._by_key) == len(plain._by_key)
    assert fast.example is not None


def test_the_compiled_age_split_is_the_python_one() -> None:
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from exporter.core.kv_accounting import _split_ages, split_ages

    @settings(max_examples=200, deadline=None)
    @given(st.lists(st.tuples(st.floats(0, 1e6), st.booleans()), max_size=12))
    def check(ages: list) -> None:
        assert split_ages(ages) == _split_ages(ages)

    check()


def test_the_compiled_results_are_the_dataclasses_they_stand_for() -> None:
    """The compiled index and tracker fill their per-batch results' fields directly: the objects are
    equal to, and read like, the classes' own construction."""
    from exporter.core.index.eviction import EvictionTracker as Reference
    from exporter.core.index.prefix_index import EvictionTracker, PrefixIndex, ReferencePrefixIndex

    events = [BlockStored((1, 2, 3), None, 16)]
    got, want = PrefixIndex().apply("w", events), ReferencePrefixIndex().apply("w", events)
    assert got == want and vars(got) == vars(want) and type(got) is type(want)
    got_ev, want_ev = EvictionTracker(30.0).apply("w", events, 1.0), Reference(30.0).apply("w", events, 1.0)
    assert got_ev == want_ev and vars(got_ev) == vars(want_ev) and type(got_ev) is type(want_ev)
