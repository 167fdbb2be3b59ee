# ---- a histogram's observations: MetricStore.observe and MetricStore.observe_many ----------------
# Part of ``_records_core.pyx`` (one observation per record: TTFT, cold prefill, miss cost) and of
# ``_kv_batch_core.pyx`` (a batch's eviction ages per label), which each ``include`` it: the one
# compiled copy of the write, so the two modules cannot come to disagree with each other or with
# the store. The same writes in the same order on the same objects as the Python methods: the
# cumulative row (``store.cum.histograms[metric][labels]``: a count per bucket, +Inf last, then the
# running sum), the window's slot row and its counts (``WindowedBuckets.observe_in``), then the
# baseline, if the metric has one, through its own ``observe`` of each value. Values stay Python
# objects, so the sum adds the same terms in the same order. tests/exporter/core/test_histogram_write.py
# holds both modules' copies and their callers to the Python methods.

from bisect import bisect_left


cdef object _slot_rows(slots, ts):
    """``_Slots.slot_for(ts).rows``, its common case inline: the slot of the latest event, which
    most events join. Any other slot (a new one, which lowers the wake; a late event's) comes from
    ``slot_for`` itself."""
    tail = slots.tail
    if tail is not None and tail.lo <= ts < tail.hi:
        if ts > tail.last:
            tail.last = ts
        return tail.rows
    return slots.slot_for(ts).rows


cdef tuple _histogram_rows(store, hw, ts, metric, labels, Py_ssize_t width):
    """The three rows one histogram write bumps, each made at zero on first use, in the store's
    order: the cumulative one (``width`` buckets and the sum), the window slot's at ``ts`` and the
    window's counts."""
    histograms = <dict>store.cum.histograms
    series = histograms.get(metric)
    if series is None:
        series = histograms[metric] = {}
    row = (<dict>series).get(labels)
    if row is None:
        row = (<dict>series)[labels] = [0.0] * (width + 1)
    rows = <dict>_slot_rows(hw._slots, ts)
    slot_row = rows.get(labels)
    if slot_row is None:
        slot_row = rows[labels] = [0] * width
    counts = <dict>hw.counts
    crow = counts.get(labels)
    if crow is None:
        crow = counts[labels] = [0] * width
    return (row, slot_row, crow)


cdef inline object _baseline(store, metric):
    """The metric's baseline, or None. The store hands it each observation, after the window has
    it, through the baseline's own ``observe`` (a late one goes to its older slot; a healthy
    baseline also tallies its class): so do both callers below."""
    return (<dict>store.baselines).get(metric)


cpdef int observe_histogram(store, ts, metric, labels, value) except -1:
    """``MetricStore.observe(ts, metric, labels, value)``. A metric's first observation, which makes
    its window, goes through the method itself."""
    hw = (<dict>store.hwin).get(metric)
    if hw is None:
        store.observe(ts, metric, labels, value)
        return 0
    cdef tuple bounds = hw.bounds
    cdef Py_ssize_t width = len(bounds) + 1
    cdef Py_ssize_t i = bisect_left(bounds, value)  # the bucket, found once for the three rows
    row, slot_row, crow = _histogram_rows(store, hw, ts, metric, labels, width)
    cdef list r = <list>row
    r[i] += 1
    r[width] = r[width] + value
    (<list>slot_row)[i] += 1
    (<list>crow)[i] += 1
    lw = _baseline(store, metric)
    if lw is not None:
        lw.observe(ts, labels, value)
    return 0


cpdef int observe_histogram_many(store, ts, metric, labels, list values) except -1:
    """``MetricStore.observe_many(ts, metric, labels, values)``: each value's bucket found once for
    the three rows, the running sum added in order. Nothing happens for no values; a metric's first
    observations, which make its window, go through the method itself."""
    if not values:
        return 0
    hw = (<dict>store.hwin).get(metric)
    if hw is None:
        store.observe_many(ts, metric, labels, values)
        return 0
    cdef tuple bounds = hw.bounds
    cdef Py_ssize_t width = len(bounds) + 1, i
    row, slot_row, crow = _histogram_rows(store, hw, ts, metric, labels, width)
    cdef list r = <list>row, s = <list>slot_row, c = <list>crow
    total = r[width]
    for value in values:
        i = bisect_left(bounds, value)
        r[i] += 1
        s[i] += 1
        c[i] += 1
        total = total + value
    r[width] = total
    lw = _baseline(store, metric)
    if lw is not None:
        for value in values:
            lw.observe(ts, labels, value)
    return 0
