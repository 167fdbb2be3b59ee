# cython: language_level=3
"""The compiled side of ``exporter.core.record_slice``: the per-record work of a slice of request
records (``apply_records``).

``record_slice.reference_apply_records`` and ``RecordAccounting.account`` with its steps are the
definition. This module runs the same steps in the same order on the same objects: the common
ones (the reuse decomposition, the index's answer and hits, session turns, cold prefill, miss
cost) compiled, with the small writes they make inlined — counter adds held back for the store's
batch (``PendingSums.add``), histogram observations (``MetricStore.observe``), a session's later
turn (``SessionTable.observe``), the hit history (``Hotspots.hit``) and the label budgets
(``LabelBudget.admit``) — and every rarer path (a new session, a re-key, a step of a field few
producers send, a write outside a batch) through the Python method itself. Values stay Python
objects, so every sum adds the same terms in the same order and every dictionary gets its keys
in the same order (tests/exporter/core/test_records_core.py compares the two over randomized
record streams: every counter, window slot, session, hit and API answer).

The histogram observation is not this file's: it lives in ``_histogram_write.pxi``, ``include``d
here and by ``_kv_batch_core.pyx`` (whose eviction ages write the same rows), and
tests/exporter/core/test_histogram_write.py holds it to ``MetricStore.observe`` and ``observe_many``.
"""

from dataclasses import replace

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.long cimport PyLong_AsUnsignedLongLong
from libc.stdint cimport uint64_t
from libc.string cimport memcpy

from exporter.core import attribution as _attribution
from exporter.core import hotspots as _hotspots
from exporter.core import record_accounting as _ra
from exporter.core import sessions as _sessions
from exporter.core.worker_pool import DEFAULT_BLOCK_SIZE
from prefixscope import catalog
from prefixscope.records import RequestRecord

cdef object UNKNOWN = _ra.UNKNOWN
cdef object RecordView = _ra.RecordView
cdef object _prompt_class_py = catalog.prompt_class
cdef tuple PROMPT_CLASSES = tuple(catalog.PROMPT_CLASSES)
cdef object from_json = RequestRecord.from_json
cdef object _packed_py = _hotspots._packed
cdef Py_ssize_t MAX_CHAIN_KEPT = _hotspots.MAX_CHAIN_KEPT
cdef Py_ssize_t MAX_INTERNED = _hotspots.MAX_INTERNED
cdef Py_ssize_t MAX_CHAIN = _sessions.MAX_CHAIN
cdef object _DEPTHS = _sessions._DEPTHS
cdef object _depths = _sessions._depths
cdef object Session = _sessions.Session

cdef object _REQUESTS = _ra._REQUESTS
cdef object _REQUEST_PROMPT_TOKENS = _ra._REQUEST_PROMPT_TOKENS
cdef object _WORKER_REQUESTS = _ra._WORKER_REQUESTS
cdef object _WORKER_TTFT_SECONDS = _ra._WORKER_TTFT_SECONDS
cdef object _REUSE_ACHIEVED_TOKENS = _ra._REUSE_ACHIEVED_TOKENS
cdef object _REUSE_PREDICTED_TOKENS = _ra._REUSE_PREDICTED_TOKENS
cdef object _INDEX_STALENESS_TOKENS = _ra._INDEX_STALENESS_TOKENS
cdef object _REUSE_AVAILABLE_TOKENS = _ra._REUSE_AVAILABLE_TOKENS
cdef object _PLACEMENT_DECISIONS = _ra._PLACEMENT_DECISIONS
cdef object _PLACEMENT_DOMAIN_HITS = _ra._PLACEMENT_DOMAIN_HITS
cdef object _SESSION_REKEYS = _ra._SESSION_REKEYS
cdef object _FOLLOWUP_REQUESTS = _ra._FOLLOWUP_REQUESTS
cdef object _STICKY_COLLISIONS = _ra._STICKY_COLLISIONS
cdef object _SESSION_FOLLOWUP_PROMPT_TOKENS = _ra._SESSION_FOLLOWUP_PROMPT_TOKENS
cdef object _SESSION_FOLLOWUP_CACHED_TOKENS = _ra._SESSION_FOLLOWUP_CACHED_TOKENS
cdef object _COLD_REQUESTS = _ra._COLD_REQUESTS
cdef object _COLD_PREFILL = _ra._COLD_PREFILL
cdef object _COLD_PREFILL_GPU_SECONDS = _ra._COLD_PREFILL_GPU_SECONDS
cdef object _COLD_PREFILL_COST_USD = _ra._COLD_PREFILL_COST_USD
cdef object _PREFIX_MISS_COST_SECONDS = _ra._PREFIX_MISS_COST_SECONDS
cdef object _MISSED_REQUESTS = _ra._MISSED_REQUESTS
cdef object _MISSED_REQUESTS_WITHIN_BASELINE = _ra._MISSED_REQUESTS_WITHIN_BASELINE
cdef object ADAPTER_QUERIED = _attribution.ADAPTER_QUERIED
cdef object ADAPTER_HIT = _attribution.ADAPTER_HIT
cdef object TENANT_QUERIED = _attribution.TENANT_QUERIED
cdef object TENANT_HIT = _attribution.TENANT_HIT
cdef object ATTR_NONE = _attribution.NONE

# The steps of RecordAccounting, by their place in ``RecordAccounting._steps``.
cdef enum:
    S_REUSE = 0
    S_PREFIX = 1
    S_SESSION = 2
    S_PREFILL = 4
    S_MISS = 5

_STEP_NAMES = ("_reuse", "_prefix", "_session", "_migration", "_prefill", "_miss", "_router_timings",
               "_fallback", "_moe", "_admission")
cdef dict _plan_steps = {}  # carried -> (the plan's signals, its steps' places)


cdef tuple _plan_of(acc, object carried):
    got = _plan_steps.get(carried)
    if got is not None:
        return <tuple>got
    plan = acc._plans.get(carried) or acc._plan(carried)
    names = [getattr(step, "__name__", None) for step in acc._steps]
    if tuple(names) != _STEP_NAMES:
        raise RuntimeError(f"RecordAccounting's steps changed: {names}")
    places = tuple([acc._steps.index(step) for step in plan.steps])
    got = (plan.signals, places)
    if len(_plan_steps) < 1024:
        _plan_steps[carried] = got
    return <tuple>got


cdef object prompt_class(prompt):
    """catalog.prompt_class: the first class whose bound is above the prompt."""
    for bound, label in PROMPT_CLASSES:
        if prompt < bound:
            return label
    return _prompt_class_py(prompt)  # past every bound: the catalogue's own answer (its error)


# ---- the store's writes (MetricStore, PendingSums, WindowedBuckets) ------------------------------
cdef inline bint _padd(pending, ts, key, value) except -1:
    """PendingSums.add."""
    if ts != pending.ts:
        pending.at(ts)
    cur = <dict>pending.cur
    vals = cur.get(key)
    if vals is not None:
        (<list>vals).append(value)
        return False
    cur[key] = [value]
    sums = <dict>pending.win.sums
    if key not in sums:
        sums[key] = 0.0
    return True


cdef inline int _zero(store, metric, labels) except -1:
    """MetricStore.zero."""
    counters = <dict>store.cum.counters
    series = counters.get(metric)
    if series is None:
        series = counters[metric] = {}
    if labels not in series:
        series[labels] = 0.0
    return 0


cdef inline int _inc(store, ts, metric, labels, value) except -1:
    """MetricStore.inc."""
    pending = store._pending
    if pending is None:
        store.inc(ts, metric, labels, value)
        return 0
    if not _padd(pending, ts, (metric, labels), value):
        return 0
    return _zero(store, metric, labels)  # the series exists from its first pending add, as in MetricStore.inc


cdef inline int _add_own(store, ts, key, value) except -1:
    """MetricStore.add_own."""
    pending = store._pending_own
    if pending is not None:
        _padd(pending, ts, key, value)
    else:
        store.own.add(ts, key, value)
    return 0


include "_histogram_write.pxi"  # observe_histogram: MetricStore.observe, shared with _kv_batch_core


# ---- label budgets (LabelBudget.admit, RecordLabels.bound) --------------------------------------
cdef object _admit(budget, value, ts):
    if value in budget.pinned:
        return value
    last = budget._last
    seen = last.get(value)
    if seen is not None:
        if ts >= seen:
            last[value] = ts
            last.move_to_end(value)
            if value == budget._first:
                first = budget._first = next(iter(last))
                budget.due = last[first] + budget.idle_s
        return value
    return budget.admit(value, ts)  # a value new to the budget: admitted or folded there


cdef object _bound(labels, rec):
    ts = rec.ts
    worker = _admit(labels.worker, rec.worker, ts)
    model = rec.model if rec.model is None else _admit(labels.model, rec.model, ts)
    segment = rec.segment if rec.segment is None else _admit(labels.segment, rec.segment, ts)
    if worker is rec.worker and model is rec.model and segment is rec.segment:
        return rec
    return replace(rec, worker=worker, model=model, segment=segment)


# ---- the hit history (Hotspots.hit) --------------------------------------------------------------
cdef object _pack(chain, Py_ssize_t n):
    """``hotspots._packed(chain[:n])``: 8 bytes a block in native order, else the Python answer."""
    cdef Py_ssize_t i
    cdef uint64_t v
    if type(chain) is not tuple:
        return _packed_py(chain[:n])
    if n > len(<tuple>chain):
        n = len(<tuple>chain)
    out = PyBytes_FromStringAndSize(NULL, n * 8)
    cdef char* buf = PyBytes_AS_STRING(out)
    for i in range(n):
        item = (<tuple>chain)[i]
        if type(item) is not int or item < 0:
            return _packed_py(chain[:n])
        try:
            v = PyLong_AsUnsignedLongLong(item)
        except OverflowError:
            return _packed_py(chain[:n])
        memcpy(buf + i * 8, &v, 8)
    return out


cdef int _hit(h, ts, chain, hit_blocks, tokens, session) except -1:
    cdef Py_ssize_t n = min(<Py_ssize_t>hit_blocks, MAX_CHAIN_KEPT)
    packed = _pack(chain, n)
    interned = <dict>h._interned
    shared = interned.get(packed)
    if shared is None:
        if len(interned) >= MAX_INTERNED:
            interned.clear()
        shared = interned[packed] = packed
    events, window = h.hit_events, h._window
    if window is not None and len(events) == events.maxlen:
        window.drop(h._first_seq)
    events.append((ts, shared, tokens, session))
    if window is not None:
        window.add(h._next_seq, ts, shared, tokens)
        if len(window.pending) > len(events) // 2 + 1024:
            h._window = None
    h._next_seq += 1
    return 0


# ---- the steps ------------------------------------------------------------------------------------
cdef int _reuse(acc, rec, ml) except -1:
    store = acc.store
    ts, prompt, cached, predicted = rec.ts, rec.prompt_tokens, rec.cached_tokens, rec.predicted_cached_tokens
    _inc(store, ts, _REQUESTS, ml, 1.0)
    _inc(store, ts, _REQUEST_PROMPT_TOKENS, ml, prompt)
    worker = rec.worker
    wl = (worker,)
    _inc(store, ts, _WORKER_REQUESTS, wl, 1.0)
    ttft = rec.ttft_s
    if ttft is not None:
        observe_histogram(store, ts, _WORKER_TTFT_SECONDS, wl, ttft)
    if cached is not None:
        _inc(store, ts, _REUSE_ACHIEVED_TOKENS, ml, cached)
        _add_own(store, ts, ("record_cached", worker), cached)
        _add_own(store, ts, ("record_prompt", worker), prompt)
    if predicted is not None:
        _inc(store, ts, _REUSE_PREDICTED_TOKENS, ml, predicted)
        if cached is not None:
            _inc(store, ts, _INDEX_STALENESS_TOKENS, ml, max(0, predicted - cached))
    return 0


cdef int _prefix(acc, view, rec, ml, bs) except -1:
    hashes = view.hashes
    if not hashes:
        return 0
    store, topo = acc.store, acc.topology
    ts, worker, cached = rec.ts, rec.worker, rec.cached_tokens
    match = acc.index.longest_match(hashes)
    hit_on_worker = match.depth_on(worker)
    view.hit_on_worker = hit_on_worker
    prompt = rec.prompt_tokens
    if cached is not None:  # block_tokens.blocks_of
        if cached >= prompt:
            cached_blocks = len(hashes)
        else:
            cached_blocks = min(len(hashes), max(0, cached) // bs)
        own = cached_blocks
    else:
        own = hit_on_worker
    pool = acc.pool
    if not pool._up_changes and pool._left is not None and pool.time.now < pool._left_until:
        left = pool._left_workers  # WorkerPool.left_workers between changes
    else:
        left = pool.left_workers()
    best = max(own, match.best_depth_besides(worker, left))
    available = max(min(prompt, max(0, best) * bs), min(cached or 0, prompt))  # block_tokens.tokens_of
    view.available_blocks = best
    _inc(store, ts, _REUSE_AVAILABLE_TOKENS, ml, available)
    if topo is not None and best > 0 and worker in topo:
        _inc(store, ts, _PLACEMENT_DECISIONS, ml, 1.0)
        _zero(store, _PLACEMENT_DOMAIN_HITS, ml)
        if own == best or any(match.depth_on(x) == best for x in acc._domain_workers[topo.domain_of(worker)]
                              if x != worker and x not in left):
            _inc(store, ts, _PLACEMENT_DOMAIN_HITS, ml, 1.0)
    hit_blocks = own
    if hit_blocks:
        acc.index.record_hits(hashes, hit_blocks, bs)
        tokens = float(cached) if cached is not None else float(hit_blocks * bs)
        _hit(acc.hotspots, ts, hashes, hit_blocks, tokens, rec.session_key)
    return 0


cdef int _served(sessions, s) except -1:
    """SessionTable._served."""
    active = sessions._active
    if active is None:
        return 0
    key = s.key
    (<dict>active).pop(key, None)
    if s.last_ts > sessions._cutoff:
        (<dict>active)[key] = s
    return 0


cdef object _rekey_source(sessions, key, tuple chain, ts):
    """SessionTable._rekey_source."""
    held = <dict>sessions._held
    cdef Py_ssize_t depth = len(chain)
    while depth and chain[depth - 1] not in held:
        depth -= 1
    if depth == 0:
        return None
    owner = held[chain[depth - 1]]
    if not isinstance(owner, str):
        return None
    src = (<object>sessions._sessions).get(owner)
    if src is None or src.key == key or ts - src.last_ts > sessions.rekey_horizon_s:
        return None
    extends = len(chain) > depth or depth == MAX_CHAIN
    if extends and depth > sessions.shared_depth and depth >= src.first_chain_len:
        return src.key
    return None


cdef int _unregister(dict held, anchors, key) except -1:
    """SessionTable._unregister."""
    for h in anchors:
        v = held.get(h)
        if v is None:
            continue
        if isinstance(v, str):
            if v == key:
                del held[h]
        elif v <= 1:
            del held[h]
        else:
            held[h] = v - 1
    return 0


cdef bint _reregister(sessions, s, chain, tuple depths, tuple anchors, tuple old) except -1:
    """SessionTable._reregister."""
    key, held, shared = s.key, <dict>sessions._held, sessions.shared_depth
    if anchors == old:
        if len(set(old)) != len(old):
            return False
        for depth, h in zip(depths, anchors):
            other = held.get(h)
            if other is None:
                held[h] = key
            elif type(other) is int:
                if other <= 1:
                    held[h] = key
                elif depth > shared:
                    shared = depth
            elif other != key:
                held[h] = 2
                if depth > shared:
                    shared = depth
        sessions.shared_depth = shared
        s.chain_len = len(chain)
        return True
    kept = set(old)
    new = set(anchors)
    if len(kept) != len(old) or len(new) != len(anchors):
        return False
    for h in old:
        if h not in new:
            v = held.get(h)
            if v is None:
                continue
            if type(v) is str:
                if v == key:
                    del held[h]
            elif v <= 1:
                del held[h]
            else:
                held[h] = v - 1
    for depth, h in zip(depths, anchors):
        other = held.get(h)
        if other is None:
            held[h] = key
        elif other == key:
            continue
        elif h in kept:
            if type(other) is str:
                held[h] = 2
                if depth > shared:
                    shared = depth
            elif other <= 1:
                held[h] = key
            elif depth > shared:
                shared = depth
        else:
            held[h] = 2 if type(other) is str else other + 1
            if depth > shared:
                shared = depth
    sessions.shared_depth = shared
    s.anchors, s.chain_len = anchors, len(chain)
    return True


cdef int _register(sessions, s, chain, related) except -1:
    """SessionTable._register."""
    cdef Py_ssize_t length = len(chain)
    got = (<dict>_DEPTHS).get((length, s.first_chain_len))
    if got is None:
        got = _depths(length, s.first_chain_len)
    depths, pick = got
    old = s.anchors
    if old:
        anchors_t = pick(chain)
        if type(anchors_t) is not tuple:
            anchors_t = tuple(anchors_t)
        if _reregister(sessions, s, chain, depths, anchors_t, old):
            return 0
    key = s.key
    held = <dict>sessions._held
    _unregister(held, old, key)
    anchors = []
    for depth in depths:
        h = chain[depth - 1]
        anchors.append(h)
        other = held.get(h)
        if other is None:
            held[h] = key
            continue
        if other not in (key, related):
            sessions.shared_depth = max(sessions.shared_depth, depth)
        held[h] = (2 if isinstance(other, str) else other + 1) if other != key else other
    s.anchors, s.chain_len = tuple(anchors), len(chain)
    return 0


cdef tuple _observe_turn(sessions, key, ts, worker, chain, segment, epoch):
    """SessionTable.observe, as (session, turn, previous worker, previous epoch, re-key source)."""
    table = sessions._sessions
    chain_t = chain[:MAX_CHAIN] if chain else ()
    if type(chain_t) is not tuple:
        turn = sessions.observe(key, ts, worker, chain, segment, epoch)
        return (turn.session, turn.turn, turn.previous_worker, turn.previous_epoch, turn.rekey_of)
    s = table.get(key)
    if s is None:
        rekey_of = _rekey_source(sessions, key, chain_t, ts) if chain_t else None
        s = Session(key, worker, ts, ts, segment, first_chain_len=len(chain_t), pool_epoch=epoch)
        table[key] = s
        _served(sessions, s)
        _register(sessions, s, chain_t, rekey_of)
        if len(table) > sessions.max_sessions:
            sessions._evict()
        return (s, 1, None, None, rekey_of)
    table.move_to_end(key)
    prev_worker, prev_epoch = s.worker, s.pool_epoch
    n = s.turn + 1
    s.turn = n
    if worker != s.worker:
        s.kv_tails = None
    last = s.last_ts
    s.worker, s.last_ts, s.pool_epoch = worker, max(last, ts), epoch
    _served(sessions, s)
    if segment:
        s.segment = segment
    if chain_t:
        _register(sessions, s, chain_t, None)
    return (s, n, prev_worker, prev_epoch, None)


cdef int _session(acc, rec, hashes, ml) except -1:
    key = rec.session_key
    if not key:
        return 0
    ts = rec.ts
    if ts > acc.keyed_record_ts:
        acc.keyed_record_ts = ts
    worker, segment, cached, prompt = rec.worker, rec.segment or UNKNOWN, rec.cached_tokens, rec.prompt_tokens
    store, pool = acc.store, acc.pool
    session, n, prev, previous_epoch, rekey_of = _observe_turn(acc.sessions, key, ts, worker, hashes, segment,
                                                               pool.epoch)
    if n == 1:
        acc.hotspots.new_session(ts, segment, rekey_of is not None)
        _zero(store, _SESSION_REKEYS, (segment,))
        if rekey_of is None:
            return 0
        _inc(store, ts, _SESSION_REKEYS, (segment,), 1.0)
        continued = acc.sessions.get(rekey_of)
        prev = continued.worker if continued is not None else None
    _inc(store, ts, _FOLLOWUP_REQUESTS, ml, 1.0)
    _zero(store, _STICKY_COLLISIONS, ml)
    if prev is not None and prev != worker and not rec.migrated_from and pool.is_healthy(prev):
        _inc(store, ts, _STICKY_COLLISIONS, ml, 1.0)
    if cached is not None:
        _inc(store, ts, _SESSION_FOLLOWUP_PROMPT_TOKENS, ml, prompt)
        _inc(store, ts, _SESSION_FOLLOWUP_CACHED_TOKENS, ml, cached)
        session.followup_prompt += prompt
        session.followup_cached += cached
    changes = pool.changes
    if changes and previous_epoch is not None and previous_epoch < pool.epoch:
        change = changes[-1]
        counted = acc._reshuffle_counted
        if counted.get(session.key) != change.epoch:
            counted[session.key] = change.epoch
            change.seen_both += 1
            change.moved += prev != worker
            if len(counted) > acc.sessions.max_sessions:
                counted.clear()
    return 0


cdef inline bint _is_cold(acc, rec) except -1:
    cached = rec.cached_tokens
    return cached is not None and cached <= acc.cold_reuse_share * rec.prompt_tokens


cdef int _prefill(acc, rec, model, ml) except -1:
    prefill = rec.prefill_s
    if prefill is None or not _is_cold(acc, rec):
        return 0
    store, topo, worker, ts = acc.store, acc.topology, rec.worker, rec.ts
    wt = topo.worker(worker) if topo is not None and worker in topo else None
    _inc(store, ts, _COLD_REQUESTS, ml, 1.0)
    observe_histogram(store, ts, _COLD_PREFILL, (model, wt.gpu_class if wt else UNKNOWN, prompt_class(rec.prompt_tokens)),
             prefill)
    gpu_s = prefill * (wt.gpus if wt else 1)
    _inc(store, ts, _COLD_PREFILL_GPU_SECONDS, ml, gpu_s)
    if wt is not None:
        _inc(store, ts, _COLD_PREFILL_COST_USD, ml, gpu_s * wt.price_per_gpu_hour / 3600.0)
    return 0


cdef int _miss(acc, view, rec, model, ml, bs) except -1:
    prefill = rec.prefill_s
    if prefill is None:
        return 0
    # RecordAccounting.missed
    if rec.migrated_from:
        missed = True
    elif rec.cached_tokens is None:
        missed = None
    else:
        available = view.available_blocks
        if available is not None:
            missed = available > rec.cached_tokens // bs
        else:
            missed = _is_cold(acc, rec)
    if not missed:
        return 0
    store, ts = acc.store, rec.ts
    cost = prefill + (rec.queue_s or 0.0) + (rec.migrate_s or 0.0)
    observe_histogram(store, ts, _PREFIX_MISS_COST_SECONDS, ml, cost)
    baseline = acc.cold_baseline(ts, model, prompt_class(rec.prompt_tokens))
    if baseline is None:
        return 0
    _inc(store, ts, _MISSED_REQUESTS, ml, 1.0)
    _zero(store, _MISSED_REQUESTS_WITHIN_BASELINE, ml)
    if cost <= acc.miss_cost_factor * baseline:
        _inc(store, ts, _MISSED_REQUESTS_WITHIN_BASELINE, ml, 1.0)
    return 0


cdef object _served_by(pool, name, ts):
    """WorkerPool.served."""
    if not pool._records_seen:
        pool.records_seen = True
    w = (<dict>pool.workers).get(name)
    if w is None:
        w = pool.worker(name, ts)
    elif ts > w.last_seen:
        w.last_seen = ts
    if ts > w.last_served:
        pool._traffic(name, w, ts)
    return w


cdef object _account(acc, rec):
    """RecordAccounting.account."""
    now, labels = acc.time.now, acc.labels
    model_b, segment_b, worker_b = labels.budgets
    if now >= model_b.due or now >= segment_b.due or now >= worker_b.due:
        acc.expire_labels(now)
    rec = _bound(labels, rec)
    ts = rec.ts
    seen = <dict>acc.field_seen
    signals, places = _plan_of(acc, rec.carried)
    for fld, signal, event in <tuple>signals:
        if (event or getattr(rec, fld) is not None) and ts > seen.get(signal, -1.0):
            seen[signal] = ts
    if ts > seen.get("records", -1.0):
        seen["records"] = ts
    w = _served_by(acc.pool, rec.worker, ts)
    model = rec.model or UNKNOWN
    ml = (<dict>acc._model_labels).get(model) or acc._model_label(model)
    bs = int(rec.block_size or w.block_size or DEFAULT_BLOCK_SIZE)
    hashes = rec.block_hashes or None
    view = RecordView(rec, model, bs, hashes, ml)
    cdef int place
    steps = None
    for p in <tuple>places:
        place = p
        if place == S_REUSE:
            _reuse(acc, rec, ml)
        elif place == S_PREFIX:
            _prefix(acc, view, rec, ml, bs)
        elif place == S_SESSION:
            _session(acc, rec, hashes, ml)
        elif place == S_PREFILL:
            _prefill(acc, rec, model, ml)
        elif place == S_MISS:
            _miss(acc, view, rec, model, ml, bs)
        else:
            if steps is None:
                steps = acc._steps
            steps[place](view)
    return rec.worker


cdef int _attribute(attr, rec, now) except -1:
    """RecordAttribution.account."""
    adapter_b, tenant_b = attr.adapter, attr.tenant
    if not (now < adapter_b.due and now < tenant_b.due):
        attr.expire(now)
    lora, tenant = rec.lora_name, rec.tenant
    if lora is not None or tenant is not None:
        attr.named = True
    cached = rec.cached_tokens
    if not attr.named or cached is None:
        return 0
    store, ts = attr.store, rec.ts
    adapter = _admit(adapter_b, lora or ATTR_NONE, ts)
    tenant_v = _admit(tenant_b, tenant or ATTR_NONE, ts)
    prompt = rec.prompt_tokens
    hit = float(min(cached, prompt))
    _inc(store, ts, ADAPTER_QUERIED, (adapter,), float(prompt))
    _inc(store, ts, ADAPTER_HIT, (adapter,), hit)
    _inc(store, ts, TENANT_QUERIED, (tenant_v,), float(prompt))
    _inc(store, ts, TENANT_HIT, (tenant_v,), hit)
    return 0


def apply_records(acc, attr, evictions, pool, health, records, now, set unchanged, set judge):
    """``record_slice.reference_apply_records``, compiled (see the module's notes)."""
    for rec in records:
        try:
            record = rec if isinstance(rec, RequestRecord) else from_json(rec)
            worker = _account(acc, record)
            _attribute(attr, record, now)
            hashes, cached = record.block_hashes, record.cached_tokens
            if hashes and cached:
                name = record.worker
                w = (<dict>pool.workers).get(name)
                bs = w.block_size if w is not None else None
                if not bs:
                    bs = pool.worker_block_size(name)
                evictions.hits(name, hashes[:cached // bs])
        except (TypeError, ValueError, KeyError) as exc:
            _ra.count_unprocessable(health, rec, exc)
            continue
        if worker not in unchanged:
            (unchanged if pool.unchanged_for(worker) else judge).add(worker)


# ---- a decoded record line into its value (exporter.sources.records' typed decoder) -------------
from cpython.object cimport PyObject_GenericSetAttr


cdef class RecordBuilder:
    """The values of a decoded line, in the record's field order (``UNSET`` for an absent optional
    field), into a :class:`RequestRecord` — what ``records._compile_typed``'s Python conversion
    does: each slot set directly (the frozen dataclass's ``__init__`` less its call), absent and
    null both ``None``, and the optional fields present as ``carried``. None when a block hash is
    past ``hashes_max`` (the decoder cannot hold that bound)."""
    cdef tuple names
    cdef tuple optional
    cdef object unset
    cdef object cls
    cdef object new
    cdef Py_ssize_t n_required
    cdef Py_ssize_t hashes_at
    cdef object hashes_max
    cdef object carried_name
    cdef dict carried_of
    cdef Py_ssize_t max_shapes

    def __init__(self, cls, tuple names, Py_ssize_t n_required, unset, Py_ssize_t hashes_at, hashes_max,
                 str carried_name, Py_ssize_t max_shapes):
        if len(names) - n_required > 63:
            raise ValueError("more optional fields than a shape's bit mask holds")
        self.cls, self.names, self.n_required, self.unset = cls, names, n_required, unset
        self.optional = names[n_required:]
        self.hashes_at, self.hashes_max = hashes_at, hashes_max
        self.carried_name, self.carried_of, self.max_shapes = carried_name, {}, max_shapes
        self.new = object.__new__

    def build(self, tuple values):
        cdef Py_ssize_t i, n = len(self.names)
        cdef unsigned long long mask = 0
        if len(values) != n:
            raise ValueError(f"{len(values)} values for {n} fields")
        unset = self.unset
        hashes = values[self.hashes_at]
        if self.hashes_max is not None and hashes is not unset and hashes:
            for h in <tuple>hashes:
                if h > self.hashes_max:
                    return None
        for i in range(self.n_required, n):
            if values[i] is unset:
                mask |= 1ULL << (i - self.n_required)
        key = mask
        carried = self.carried_of.get(key)
        if carried is None:
            carried = frozenset([name for j, name in enumerate(self.optional) if not (mask >> j) & 1])
            if len(self.carried_of) < self.max_shapes:
                self.carried_of[key] = carried
        o = self.new(self.cls)
        for i in range(n):
            v = values[i]
            PyObject_GenericSetAttr(o, self.names[i], None if v is unset else v)
        PyObject_GenericSetAttr(o, self.carried_name, carried)
        return o


def ascii_only(record, tuple names):
    """Whether each of the record's fields ``names`` is None or an ASCII string."""
    for name in names:
        v = getattr(record, name)
        if v is not None and (type(v) is not str or not (<str>v).isascii()):
            return False
    return True


cdef class SlotSetter:
    """Builds a frozen slotted dataclass (``cls``, whose fields are ``names`` in order and whose
    ``__init__`` only sets them) by setting each slot directly: the leading fields from a tuple,
    the others from a mapping (None where it has none), the last one given on its own."""
    cdef object cls
    cdef tuple names
    cdef object new

    def __init__(self, cls, tuple names):
        self.cls, self.names, self.new = cls, names, object.__new__

    def make(self, tuple leading, dict rest, last):
        cdef Py_ssize_t i, n = len(self.names) - 1, k = len(leading)
        o = self.new(self.cls)
        for i in range(k):
            PyObject_GenericSetAttr(o, self.names[i], leading[i])
        for i in range(k, n):
            name = self.names[i]
            PyObject_GenericSetAttr(o, name, rest.get(name))
        PyObject_GenericSetAttr(o, self.names[n], last)
        return o
