# cython: language_level=3
"""The compiled side of a KV batch's bookkeeping: ``KvAccounting.count_evictions``' common batch (no
root branches, no placements), whose Python is ``exporter.core.kv_accounting.reference_evictions``,
and ``KvAccounting.settle``'s stream-health writes for a batch that needs no other, whose Python is
``exporter.core.kv_accounting.reference_stream_batch`` (``Health.update``, under the Health's lock).

The same writes in the same order on the same objects — the counters through ``MetricStore.inc_keyed``
(cumulative, then the window's slot, key count and sum), the ages through ``MetricStore.observe_many``
(the cumulative row, the window's slot row and counts, each age's bucket found once, then the
baseline if the histogram has one) — with values kept as Python objects, so every sum adds the
same terms in the same order. The ages' write and the window slot lookup are not this file's:
they live in ``_histogram_write.pxi``, ``include``d here and by ``_records_core.pyx``. Counters
held back (inside ``MetricStore.batch``) or a histogram without its window yet go through the
Python method itself. tests/exporter/core/test_ingest_fast_paths.py compares each pair over random
batches, tests/exporter/core/test_histogram_write.py the histogram write.
"""

from exporter.core.index._prefix_core import split_ages


include "_histogram_write.pxi"  # observe_histogram_many and the slot lookup (_slot_rows), shared


cdef int _inc(dict counters, dict rows, dict sums, n, tuple key, value) except -1:
    """One item of ``MetricStore.inc_keyed`` outside a batch."""
    metric, labels = key
    series = counters.get(metric)
    if series is None:
        series = counters[metric] = {}
    (<dict>series)[labels] = (<dict>series).get(labels, 0.0) + value
    if key in rows:
        rows[key] = rows[key] + value
    else:
        rows[key] = value
        n[key] += 1
    sums[key] = sums.get(key, 0.0) + value
    return 0


def count_evictions(store, kl, ts, ev, age_metric):
    """The eviction series of a common batch: ``reference_evictions(store, kl, ts, ev, age_metric)``."""
    stored, evicted, ages = ev.stored, ev.evicted, ev.ages
    if not (stored or evicted or ages):
        return
    cdef tuple items
    if stored or evicted:
        if stored:
            items = (((kl.stored, stored), (kl.restored, ev.restored), (kl.evicted, evicted)) if evicted
                     else ((kl.stored, stored), (kl.restored, ev.restored)))
        else:
            items = ((kl.evicted, evicted),)
        if store._pending is not None:  # held back for the store's batch: its own method
            store.inc_keyed(ts, items)
        else:
            win = store.win
            slots = win._slots
            rows = <dict>_slot_rows(slots, ts)
            counters, sums, n = <dict>store.cum.counters, <dict>win.sums, win._n
            for key, value in items:
                _inc(counters, rows, sums, n, <tuple>key, value)
            slots.events += len(items)
    if ages:
        reused_first, reused, fresh = split_ages(ages)
        if reused_first:
            observe_histogram_many(store, ts, age_metric, kl.reused_true, reused)
            if fresh:
                observe_histogram_many(store, ts, age_metric, kl.reused_false, fresh)
        else:
            observe_histogram_many(store, ts, age_metric, kl.reused_false, fresh)
            if reused:
                observe_histogram_many(store, ts, age_metric, kl.reused_true, reused)


from exporter.core.health import _ABSENT as _absent

cdef object ABSENT = _absent


cdef int _add(counters, dict totals, metric, labels, n) except -1:
    """One increment of ``Health.update`` (``counters`` the defaultdict: a new metric gets its dict)."""
    series = <dict>counters[metric]
    series[labels] = series.get(labels, 0.0) + n
    totals[metric] = totals.get(metric, 0.0) + n
    return 0


cdef int _put(gauges, dict writes, dict followers, metric, labels, value) except -1:
    """One gauge set of ``Health.update``: a change is counted and told to the gauge's followers."""
    series = <dict>gauges[metric]
    if series.get(labels, ABSENT) != value:
        series[labels] = value
        writes[metric] = writes.get(metric, 0) + 1
        if metric in followers:
            for changes in followers[metric]:
                changes.add(labels)
    return 0


def stream_batch(health, kl, received_at, lag, stored_events, removed_events, applied, last_ts, lag_metric):
    """A worker's stream-health writes for a batch after its first that needs no other: ``Health.update``
    of ``[kl.batches, (applied, kl.applied_stored, stored_events), (applied, kl.applied_removed,
    removed_events)]`` (each count only when not 0) and ``[(last_ts, kl.lab, received_at),
    (lag_metric, kl.lab, lag)]``, checked — what ``KvAccounting.settle`` hands it, without the lists."""
    lock = health._lock
    lock.acquire()
    try:
        counters, totals = health.counters, <dict>health._totals
        metric, labels, n = <tuple>kl.batches
        _add(counters, totals, metric, labels, n)
        if stored_events:
            _add(counters, totals, applied, kl.applied_stored, stored_events)
        if removed_events:
            _add(counters, totals, applied, kl.applied_removed, removed_events)
        gauges, writes, followers = health.gauges, <dict>health._gauge_writes, <dict>health._followers
        lab = kl.lab
        _put(gauges, writes, followers, last_ts, lab, received_at)
        _put(gauges, writes, followers, lag_metric, lab, lag)
    finally:
        lock.release()
