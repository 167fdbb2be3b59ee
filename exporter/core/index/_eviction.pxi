# ---- eviction lifecycle ---------------------------------------------------------------------------
# Part of ``_prefix_core.pyx``, which ``include``s it: one extension module, its names the module's
# (the DEFs, structs and types it uses are declared in the files included before it).
#
# The semantics of ``exporter.core.index.eviction.EvictionTracker`` (the reference; read its docstring for the
# rule) in C. Per worker, two rings of recent evictions (every one, and a sample reaching further)
# and one ordered table of sampled resident blocks, each holding at most ``memory`` entries and
# indexed by an open-addressing hash table (linear probing, backward-shift deletion, at most half
# full) whose slots keep 32 bits of the mixed key beside the entry: a lookup reads its slots'
# cache line and only the entry whose bits match, so a hash the table does not hold (most of a
# cluster's stores) reads no entry, and a removal shifts slots without reading one.
#
# A ring of evictions is a log in eviction order: an eviction is written at its end, next to the
# one before, so the blocks of one removal lie side by side, and a store that finds one (a block
# evicted, then wanted again) marks it dead where it lies rather than unlinking it from an order
# list whose neighbours are anywhere in memory. The oldest live entry goes when ``memory`` are
# held or the window passes it. The log doubles before more than half of it would be live (so it
# is at most twice ``memory`` long, and its hash index, as many slots as the log has entries, at
# most half full); when it reaches its end, it is compacted. The table of sampled
# resident blocks (one in ``sample_every``: few) keeps a doubly linked order list.
# The batch's counts and sampled ages become Python objects once per batch.

DEF EV_FIRST_CAP = 64  # entries of a table's first allocation (grown by doubling up to ``memory``)


cdef struct EvEntry:
    uint64_t key
    double t         # recent: evicted at; live: stored at
    uint64_t child   # live: the first child seen (valid when has_child)
    int32_t prev     # order list: older neighbour
    int32_t next     # order list: newer neighbour (on the free list: the next free entry)
    uint8_t has_child
    uint8_t reused


cdef struct EvSlot:
    uint32_t tag     # the low 32 bits of the key's ``_mix`` (its home slot is ``tag & smask``)
    int32_t e        # the entry (-1: an empty slot)


cdef struct OrderedTable:
    EvEntry* e
    EvSlot* slots
    uint32_t cap      # entries allocated
    uint32_t smask    # slots - 1 (slots: a power of two, at least twice ``cap``)
    uint32_t n        # entries in use
    uint32_t used     # entries ever handed out from the pool (the rest are above ``used``)
    int32_t head      # oldest
    int32_t tail      # newest
    int32_t free      # freed entries, linked through ``next``


cdef void _ot_init(OrderedTable* t) noexcept nogil:
    t.e, t.slots = NULL, NULL
    t.cap = t.smask = t.n = t.used = 0
    t.head = t.tail = t.free = -1


cdef void _ot_free(OrderedTable* t) noexcept nogil:
    free(t.e)
    free(t.slots)
    _ot_init(t)


cdef void _ot_clear(OrderedTable* t) noexcept nogil:
    """Empty the table, keeping its allocation (it is bounded by ``memory``)."""
    if t.slots != NULL:
        memset(t.slots, 0xFF, (<size_t>t.smask + 1) * sizeof(EvSlot))
    t.n = t.used = 0
    t.head = t.tail = t.free = -1


cdef inline int32_t _ot_find(const OrderedTable* t, uint64_t key) noexcept nogil:
    cdef uint32_t tag, i
    cdef int32_t k
    if t.n == 0:
        return -1
    tag = <uint32_t>_mix(key)
    i = tag & t.smask
    while True:
        k = t.slots[i].e
        if k < 0:
            return -1
        if t.slots[i].tag == tag and t.e[k].key == key:
            return k
        i = (i + 1) & t.smask


cdef inline void _ot_prefetch_slot(const OrderedTable* t, uint64_t key) noexcept nogil:
    if t.n:
        __builtin_prefetch(&t.slots[<uint32_t>_mix(key) & t.smask])


cdef inline void _ot_place(OrderedTable* t, uint32_t tag, int32_t k) noexcept nogil:
    """Put entry ``k`` (bits ``tag``) in the first empty slot of its run."""
    cdef uint32_t i = tag & t.smask
    while t.slots[i].e >= 0:
        i = (i + 1) & t.smask
    t.slots[i].tag = tag
    t.slots[i].e = k


cdef void _ot_unslot(OrderedTable* t, int32_t k) noexcept nogil:
    """Take entry ``k`` out of the hash index; the slots after it shift back (their homes are in
    their bits: no entry is read)."""
    cdef uint32_t tag = <uint32_t>_mix(t.e[k].key)
    cdef uint32_t i = tag & t.smask
    cdef uint32_t j, home
    while t.slots[i].e != k:
        i = (i + 1) & t.smask
    j = i
    while True:
        j = (j + 1) & t.smask
        if t.slots[j].e < 0:
            break
        home = t.slots[j].tag & t.smask
        # move slot j back to the hole at i unless its home lies cyclically in (i, j]
        if (j > i and (home <= i or home > j)) or (j < i and (home <= i and home > j)):
            t.slots[i] = t.slots[j]
            i = j
    t.slots[i].e = -1
    t.slots[i].tag = 0xFFFFFFFFu


cdef void _ot_unlink(OrderedTable* t, int32_t i) noexcept nogil:
    """Take entry ``i`` out of the hash index and the order list, onto the free list."""
    _ot_unslot(t, i)
    if t.e[i].prev >= 0:
        t.e[t.e[i].prev].next = t.e[i].next
    else:
        t.head = t.e[i].next
    if t.e[i].next >= 0:
        t.e[t.e[i].next].prev = t.e[i].prev
    else:
        t.tail = t.e[i].prev
    t.e[i].next = t.free
    t.free = i
    t.n -= 1


cdef inline void _ot_append(OrderedTable* t, int32_t i) noexcept nogil:
    """Put entry ``i`` (out of the order list) at the newest end."""
    t.e[i].prev, t.e[i].next = t.tail, -1
    if t.tail >= 0:
        t.e[t.tail].next = i
    else:
        t.head = i
    t.tail = i


cdef int _ot_grow(OrderedTable* t, uint32_t limit) except -1:
    """Double the pool (up to ``limit``) and rebuild the hash index for it (from the old slots'
    bits: no entry is read)."""
    cdef uint32_t cap = EV_FIRST_CAP if t.cap == 0 else t.cap * 2
    cdef uint64_t ns = 2
    cdef uint32_t i
    cdef EvEntry* e
    cdef EvSlot* slots
    cdef EvSlot* old = t.slots
    cdef uint64_t nold = 0 if old == NULL else <uint64_t>t.smask + 1
    if cap > limit:
        cap = limit
    while ns < 2 * <uint64_t>cap:
        ns <<= 1
    e = <EvEntry*>realloc(t.e, cap * sizeof(EvEntry))
    if e == NULL:
        raise MemoryError()
    t.e = e
    slots = <EvSlot*>malloc(ns * sizeof(EvSlot))
    if slots == NULL:
        raise MemoryError()
    memset(slots, 0xFF, ns * sizeof(EvSlot))
    t.slots, t.smask, t.cap = slots, <uint32_t>(ns - 1), cap
    for i in range(nold):
        if old[i].e >= 0:
            _ot_place(t, old[i].tag, old[i].e)
    free(old)
    return 0


cdef int32_t _ot_add(OrderedTable* t, uint64_t key, double ts, uint32_t limit) except -2:
    """A new newest entry for ``key`` (not in the table); the oldest goes when ``limit`` are held."""
    cdef int32_t i
    if t.n >= limit:
        _ot_unlink(t, t.head)
    elif t.n == t.cap:
        _ot_grow(t, limit)
    if t.free >= 0:
        i = t.free
        t.free = t.e[i].next
    else:
        i = <int32_t>t.used
        t.used += 1
    t.e[i].key, t.e[i].t = key, ts
    t.e[i].child, t.e[i].has_child, t.e[i].reused = 0, 0, 0
    _ot_place(t, <uint32_t>_mix(key), i)
    _ot_append(t, i)
    t.n += 1
    return i


cdef struct RingEntry:
    uint64_t key
    double t         # evicted at; RING_DEAD once the block is stored again (or the entry dropped)


cdef struct Ring:
    RingEntry* e
    EvSlot* slots    # key -> entry index (``tag``: the low 32 bits of the key's ``_mix``)
    uint32_t cap     # entries of the log: a power of two (0 before the first eviction)
    uint32_t smask   # slots - 1 (slots: ``cap``; the log doubles before more than half of it is live)
    uint32_t n       # live entries
    uint32_t head    # the oldest entry's position (a running count: its index is ``head & (cap - 1)``)
    uint32_t tail    # where the next eviction goes (``tail - head`` entries in the log, dead ones too)


cdef extern from *:
    """
    #define PFX_RING_DEAD (-1.0e308)
    """
    # A dead entry's time: below any input time, so an expiry pass would drop it anyway.
    const double RING_DEAD "PFX_RING_DEAD"


cdef void _ring_init(Ring* r) noexcept nogil:
    r.e, r.slots = NULL, NULL
    r.cap = r.smask = r.n = r.head = r.tail = 0


cdef void _ring_free(Ring* r) noexcept nogil:
    free(r.e)
    free(r.slots)
    _ring_init(r)


cdef void _ring_clear(Ring* r) noexcept nogil:
    """Empty the ring, keeping its allocation (it is bounded by ``memory``)."""
    if r.slots != NULL:
        memset(r.slots, 0xFF, (<size_t>r.smask + 1) * sizeof(EvSlot))
    r.n = r.head = r.tail = 0


cdef inline int32_t _ring_find(const Ring* r, uint64_t key) noexcept nogil:
    cdef uint32_t tag, i
    cdef int32_t k
    if r.n == 0:
        return -1
    tag = <uint32_t>_mix(key)
    i = tag & r.smask
    while True:
        k = r.slots[i].e
        if k < 0:
            return -1
        if r.slots[i].tag == tag and r.e[k].key == key:
            return k
        i = (i + 1) & r.smask


cdef inline void _ring_prefetch_slot(const Ring* r, uint64_t key) noexcept nogil:
    if r.n:
        __builtin_prefetch(&r.slots[<uint32_t>_mix(key) & r.smask])


cdef inline void _ring_place(Ring* r, uint32_t tag, int32_t k) noexcept nogil:
    """Put entry ``k`` (bits ``tag``) in the first empty slot of its run."""
    cdef uint32_t i = tag & r.smask
    while r.slots[i].e >= 0:
        i = (i + 1) & r.smask
    r.slots[i].tag = tag
    r.slots[i].e = k


cdef void _ring_unslot(Ring* r, int32_t k) noexcept nogil:
    """Take entry ``k`` out of the hash index (``_ot_unslot``'s backward shift)."""
    cdef uint32_t tag = <uint32_t>_mix(r.e[k].key)
    cdef uint32_t i = tag & r.smask
    cdef uint32_t j, home
    while r.slots[i].e != k:
        i = (i + 1) & r.smask
    j = i
    while True:
        j = (j + 1) & r.smask
        if r.slots[j].e < 0:
            break
        home = r.slots[j].tag & r.smask
        if (j > i and (home <= i or home > j)) or (j < i and (home <= i and home > j)):
            r.slots[i] = r.slots[j]
            i = j
    r.slots[i].e = -1
    r.slots[i].tag = 0xFFFFFFFFu


cdef inline void _ring_skip_dead(Ring* r) noexcept nogil:
    """Move ``head`` past dead entries to the oldest live one (or to ``tail``)."""
    cdef uint32_t m = r.cap - 1
    while r.head != r.tail and r.e[r.head & m].t == RING_DEAD:
        r.head += 1


cdef inline void _ring_kill(Ring* r, int32_t k) noexcept nogil:
    """Entry ``k`` leaves: out of the hash index, dead where it lies."""
    _ring_unslot(r, k)
    r.e[k].t = RING_DEAD
    r.n -= 1
    if <uint32_t>k == (r.head & (r.cap - 1)):
        _ring_skip_dead(r)


cdef inline void _ring_drop_oldest(Ring* r) noexcept nogil:
    _ring_kill(r, <int32_t>(r.head & (r.cap - 1)))  # (``head`` is live: dead ones are skipped as they die)


cdef int _ring_relay(Ring* r, uint32_t cap) except -1:
    """Lay the live entries out from index 0 of a log of ``cap`` entries (doubled or compacted), in
    order, and index them afresh."""
    cdef RingEntry* e = <RingEntry*>malloc(cap * sizeof(RingEntry))
    cdef EvSlot* slots
    cdef uint32_t m = r.cap - 1, pos, n = 0
    if e == NULL:
        raise MemoryError()
    slots = <EvSlot*>malloc(cap * sizeof(EvSlot))
    if slots == NULL:
        free(e)
        raise MemoryError()
    pos = r.head
    while pos != r.tail:
        if r.e[pos & m].t != RING_DEAD:
            e[n] = r.e[pos & m]
            n += 1
        pos += 1
    free(r.e)
    free(r.slots)
    r.e, r.slots, r.cap, r.smask = e, slots, cap, cap - 1
    r.head, r.tail = 0, n
    memset(slots, 0xFF, cap * sizeof(EvSlot))
    for pos in range(n):
        _ring_place(r, <uint32_t>_mix(e[pos].key), <int32_t>pos)
    return 0


cdef int32_t _ring_add(Ring* r, uint64_t key, double ts, uint32_t limit) except -2:
    """A new newest entry for ``key`` (not in the ring); the oldest goes when ``limit`` are held."""
    cdef int32_t k
    if r.n >= limit:
        _ring_drop_oldest(r)
    if 2 * (r.n + 1) > r.cap:  # at most half the log is live, so its slots are at most half full
        _ring_relay(r, EV_FIRST_CAP if r.cap == 0 else r.cap * 2)  # (``n`` ≤ ``memory``: it stops at twice that)
    elif r.tail - r.head == r.cap:  # the log reached its end: compact it (at least half of it is dead)
        _ring_relay(r, r.cap)
    k = <int32_t>(r.tail & (r.cap - 1))
    r.e[k].key, r.e[k].t = key, ts
    _ring_place(r, <uint32_t>_mix(key), k)
    r.tail += 1
    r.n += 1
    return k


cdef int _ring_evicted(Ring* r, uint64_t key, double ts, uint32_t limit) except -1:
    """An eviction of ``key`` at ``ts``: it becomes the newest entry (moved there when held)."""
    cdef int32_t k = _ring_find(r, key)
    if k >= 0:
        if <uint32_t>k == ((r.tail - 1) & (r.cap - 1)):  # already the newest
            r.e[k].t = ts
            return 0
        _ring_kill(r, k)
    _ring_add(r, key, ts, limit)
    return 0


cdef void _ring_expire(Ring* r, double cutoff) noexcept nogil:
    """Drop the entries evicted before ``cutoff`` (oldest first)."""
    while r.n and r.e[r.head & (r.cap - 1)].t < cutoff:
        _ring_drop_oldest(r)


cdef class _EvictionWorker:
    """One worker's recent evictions (every one, and a sample reaching further) and sampled
    resident blocks."""

    cdef Ring recent
    cdef Ring sampled
    cdef OrderedTable live
    cdef int64_t carry  # estimated restores not yet counted (a batch counts at most its stored blocks)
    cdef uint64_t far_mask  # the sampled ring keeps the evictions whose hash & far_mask is 0
    cdef int64_t capacity  # the capacity the far sample was sized for (-1: none yet, 0: unknown)

    def __cinit__(self):
        _ring_init(&self.recent)
        _ring_init(&self.sampled)
        _ot_init(&self.live)
        self.carry = 0
        self.far_mask = 0
        self.capacity = -1

    def __dealloc__(self):
        _ring_free(&self.recent)
        _ring_free(&self.sampled)
        _ot_free(&self.live)


cdef inline bint _is_gpu(object m):
    """vLLM's GPU pool says "GPU"; before 0.11 there was no medium (``eviction.is_gpu``)."""
    return m is None or m == "GPU" or m.upper() == "GPU"


cdef class CompiledEvictionTracker:
    """``exporter.core.index.eviction.EvictionTracker`` in C: same interface, same results (the equality
    tests apply random streams to both); ``apply`` once per KV batch, in each worker's order."""

    cdef readonly double window_s
    cdef readonly int memory
    cdef uint64_t mask
    cdef dict _workers
    cdef uint64_t* buf   # the hashes of the event being applied
    cdef Py_ssize_t bufcap

    def __cinit__(self):
        self.buf, self.bufcap = NULL, 0
        self._workers = {}

    def __dealloc__(self):
        free(self.buf)

    def __init__(self, window_s, memory=DEFAULT_EVICTION_MEMORY, sample_every=DEFAULT_SAMPLE_EVERY):
        if memory < 1:
            raise ValueError("eviction memory must be at least 1")
        if sample_every < 1 or sample_every & (sample_every - 1):
            raise ValueError("sample_every must be a power of two")
        if memory > 0x3FFFFFFF:  # (a ring's log is at most twice as long, its positions 32-bit)
            raise ValueError("eviction memory must be below 2^30")
        self.window_s = float(window_s)
        self.memory = memory
        self.mask = <uint64_t>(sample_every - 1)

    cdef _EvictionWorker _worker(self, str worker):
        cdef _EvictionWorker e
        w = self._workers.get(worker)
        if w is None:
            e = _EvictionWorker()
            e.far_mask = self.mask
            w = self._workers[worker] = e
        return <_EvictionWorker>w

    def size_for(self, str worker, capacity):
        """Size the worker's sampled eviction ring for its capacity (``eviction.EvictionTracker.size_for``)."""
        cdef _EvictionWorker w = self._worker(worker)
        cdef int64_t cap = capacity if capacity is not None and capacity > 0 else 0
        cdef uint64_t every
        if cap == w.capacity:
            return
        w.capacity = cap
        every = <uint64_t>far_sample(cap or None, self.memory, <object>(self.mask + 1))
        if every - 1 != w.far_mask:
            w.far_mask = every - 1
            _ring_clear(&w.sampled)

    def far_every(self, str worker):
        """The worker's far sample (``sample_every`` until it is sized)."""
        cdef _EvictionWorker w = self._workers.get(worker)
        return <object>((self.mask if w is None else w.far_mask) + 1)

    cdef Py_ssize_t _load(self, object hs) except -1:
        """The event's hashes into ``buf`` (ints folded to 64 bits, as the index reads them)."""
        cdef Py_ssize_t i, n
        cdef uint64_t* p
        if type(hs) is not tuple:
            hs = tuple(hs)
        n = PyTuple_GET_SIZE(hs)
        if n > self.bufcap:
            p = <uint64_t*>realloc(self.buf, n * sizeof(uint64_t))
            if p == NULL:
                raise MemoryError()
            self.buf, self.bufcap = p, n
        for i in range(n):
            self.buf[i] = _u64(<object>PyTuple_GET_ITEM(hs, i))
        return n

    def apply(self, str worker, events, ts):
        """Apply one batch's events received at ``ts``; the batch's ``BatchEvictions``."""
        cdef _EvictionWorker w = self._worker(worker)
        cdef double now = ts
        cdef int64_t stored = 0, restored = 0, evicted = 0
        cdef bint other_media = False
        cdef list ages = []
        cdef Py_ssize_t n
        cdef object parent
        for ev in events:
            kind = type(ev)
            if kind is BlockStored or (kind is not BlockRemoved and isinstance(ev, BlockStored)):
                if _is_gpu(ev.medium):
                    n = self._load(ev.hashes)
                    parent = ev.parent
                    self._stored(w, self.buf, n, parent is not None, _u64(parent) if parent is not None else 0,
                                 now, &stored, &restored)
                else:
                    other_media = True
            elif kind is BlockRemoved or isinstance(ev, BlockRemoved):
                if _is_gpu(ev.medium):
                    evicted += self._removed(w, self.buf, self._load(ev.hashes), now, ages)
                else:
                    other_media = True
            elif isinstance(ev, AllBlocksCleared):  # a reset, not eviction: nothing to learn from
                _ring_clear(&w.recent)
                _ring_clear(&w.sampled)
                _ot_clear(&w.live)
                w.carry = 0
        self._expire(w, now)
        return _batch_evictions(stored, restored, evicted, ages, other_media)

    def apply_scan(self, str worker, KvScan scan, ts):
        """``apply(worker, events, ts)`` for a batch read by :func:`scan_kv_batch` (the same
        result, from the scan's hash arrays)."""
        cdef _EvictionWorker w = self._worker(worker)
        cdef double now = ts
        cdef int64_t stored = 0, restored = 0, evicted = 0
        cdef bint other_media = False
        cdef list ages = []
        cdef int8_t gpu[SCAN_MAX_MEDIA]
        cdef Py_ssize_t i
        cdef int k
        cdef ScanEvent* e
        for k in range(SCAN_MAX_MEDIA):
            gpu[k] = -1
        # As the index does: the slots of every table a hash of the batch will be looked up in are
        # fetched ahead, so the misses of a cluster's thousands of workers' tables overlap instead
        # of queueing block by block (``_prefetch`` says why the entries are not).
        self._prefetch(w, scan.hashes, scan.nh)
        for i in range(scan.n):
            e = &scan.ev[i]
            if e.kind == SCAN_CLEARED:  # a reset, not eviction: nothing to learn from
                _ring_clear(&w.recent)
                _ring_clear(&w.sampled)
                _ot_clear(&w.live)
                w.carry = 0
                continue
            if gpu[e.medium] < 0:
                gpu[e.medium] = _is_gpu(scan.media[e.medium])
            if not gpu[e.medium]:
                other_media = True
            elif e.kind == SCAN_STORED:
                self._stored(w, scan.hashes + e.hoff, e.hn, e.has_parent, e.parent, now, &stored, &restored)
            else:
                evicted += self._removed(w, scan.hashes + e.hoff, e.hn, now, ages)
        self._expire(w, now)
        return _batch_evictions(stored, restored, evicted, ages, other_media)

    cdef void _prefetch(self, _EvictionWorker w, const uint64_t* hs, Py_ssize_t n) noexcept:
        """Fetch ahead the slots of the worker's tables that the batch's hashes ``hs`` will be
        looked up in (recent evictions for every hash, the samples for theirs), and when the
        ring of recent evictions is full, those of the oldest ones adding the batch's drops
        (``_ring_unslot`` finds each one's slot; the log is read in order, which the hardware
        fetches ahead itself). The entries are not: most lookups find nothing (a block stored
        again soon after its eviction is the exception), and a pass that reads the slots to find
        them waits for every slot's miss in turn."""
        cdef Py_ssize_t i, k = n
        cdef uint64_t h, mask = self.mask, far_mask = w.far_mask
        cdef Ring* r = &w.recent
        cdef uint32_t pos, m
        for i in range(n):
            h = hs[i]
            _ring_prefetch_slot(&w.recent, h)
            if not h & far_mask:
                _ring_prefetch_slot(&w.sampled, h)
            if not h & mask:
                _ot_prefetch_slot(&w.live, h)
        if r.n + n <= <uint32_t>self.memory:  # the ring has room: nothing old goes
            return
        m = r.cap - 1
        pos = r.head
        while k > 0 and pos != r.tail:
            if r.e[pos & m].t != RING_DEAD:
                __builtin_prefetch(&r.slots[<uint32_t>_mix(r.e[pos & m].key) & r.smask])
                k -= 1
            pos += 1

    cdef int _stored(self, _EvictionWorker w, const uint64_t* hs, Py_ssize_t n, bint has_parent,
                     uint64_t parent, double ts, int64_t* stored, int64_t* restored) except -1:
        cdef Py_ssize_t i
        cdef uint64_t mask = self.mask, p = parent, far_mask = w.far_mask
        cdef uint32_t limit = <uint32_t>self.memory
        cdef int32_t k
        cdef bint have_parent = has_parent, back
        cdef int64_t again = 0, counted
        cdef int64_t every = <int64_t>(far_mask + 1)
        cdef Ring* recent = &w.recent
        cdef Ring* sampled = &w.sampled
        cdef OrderedTable* live = &w.live
        if n == 0:
            return 0
        stored[0] += n
        if recent.n or sampled.n:  # stored again: evicted from this worker before (within the window: thrash)
            for i in range(n):
                back = False
                if recent.n:
                    k = _ring_find(recent, hs[i])
                    if k >= 0:
                        back = True
                        if ts - recent.e[k].t <= self.window_s:
                            again += 1
                        _ring_kill(recent, k)
                if sampled.n and not hs[i] & far_mask:
                    k = _ring_find(sampled, hs[i])
                    if k >= 0:
                        if not back and ts - sampled.e[k].t <= self.window_s:
                            again += every  # beyond the exact ring: stands for ``every`` blocks
                        _ring_kill(sampled, k)
        again += w.carry
        counted = again if again < n else n
        w.carry = again - counted
        restored[0] += counted
        for i in range(n):
            if hs[i] & mask:
                continue
            k = _ot_find(live, hs[i])
            if k >= 0:
                live.e[k].reused = 1  # announced again while resident: vLLM's full report mode on a hit
            else:
                _ot_add(live, hs[i], ts, limit)  # past ``memory``: removals lost on the way left it
        if live.n:
            for i in range(n):
                if have_parent and not p & mask:
                    k = _ot_find(live, p)
                    if k >= 0:
                        if not live.e[k].has_child:
                            live.e[k].child, live.e[k].has_child = hs[i], 1
                        elif live.e[k].child != hs[i]:
                            live.e[k].reused = 1  # a second, different child: two requests shared it
                p, have_parent = hs[i], True
        return 0

    cdef int64_t _removed(self, _EvictionWorker w, const uint64_t* hs, Py_ssize_t n, double ts,
                          list ages) except -1:
        cdef Py_ssize_t i
        cdef uint64_t mask = self.mask, far_mask = w.far_mask
        cdef uint32_t limit = <uint32_t>self.memory
        cdef int32_t k
        cdef double age
        cdef Ring* recent = &w.recent
        cdef Ring* sampled = &w.sampled
        cdef OrderedTable* live = &w.live
        for i in range(n):
            _ring_evicted(recent, hs[i], ts, limit)
            if not hs[i] & far_mask:
                _ring_evicted(sampled, hs[i], ts, limit)
            if not hs[i] & mask and live.n:
                k = _ot_find(live, hs[i])
                if k >= 0:
                    age = ts - live.e[k].t
                    ages.append((age if age > 0.0 else 0.0, live.e[k].reused != 0))
                    _ot_unlink(live, k)
        return n

    cdef void _expire(self, _EvictionWorker w, double now) noexcept:
        cdef double cutoff = now - self.window_s
        _ring_expire(&w.recent, cutoff)
        _ring_expire(&w.sampled, cutoff)

    def hits(self, str worker, hashes):
        """Blocks a request record says were served from this worker's cache: reuse seen."""
        cdef _EvictionWorker w = self._workers.get(worker)
        cdef uint64_t v
        cdef int32_t k
        if w is None or not w.live.n:
            return
        for h in hashes:
            if not isinstance(h, int) or h < 0 or h > 0xFFFFFFFFFFFFFFFF:
                continue  # not a block hash the decoder could have given: no resident block has it
            v = <uint64_t>PyLong_AsUnsignedLongLongMask(h)
            if v & self.mask:
                continue
            k = _ot_find(&w.live, v)
            if k >= 0:
                w.live.e[k].reused = 1

    def clear_worker(self, str worker):
        """The worker's cache is gone (restart) or its view is rebuilt: forget its history."""
        self._workers.pop(worker, None)

    def tracked(self, str worker):
        """(recent evictions in the larger of the two rings, sampled resident blocks) held for the
        worker (memory checks)."""
        cdef _EvictionWorker w = self._workers.get(worker)
        if w is None:
            return (0, 0)
        return (<object>(w.recent.n if w.recent.n > w.sampled.n else w.sampled.n), <object>w.live.n)
