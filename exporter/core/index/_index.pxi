# ---- the prefix index -----------------------------------------------------------------------------
# Part of ``_prefix_core.pyx``, which ``include``s it: one extension module, its names the module's
# (the DEFs, structs and types it uses are declared in the files included before it).
#
# ``CompiledPrefixIndex``: the semantics of ``prefix_index_ref`` in the layout ``_prefix_core.pyx``'s
# docstring describes.


cdef class CompiledPrefixIndex:
    """Per-(worker, medium) resident blocks over one shared block tree, in C arrays."""

    cdef Block* blocks
    cdef uint32_t nblocks      # high-water mark of used entries
    cdef uint32_t capblocks
    cdef uint64_t spanblocks   # entries' worth of address space mapped for the two entry arrays
    cdef int64_t free_head     # free entries chained through ``parent``
    cdef Table tb              # hash -> entry (``_index_table.pxi``)
    cdef uint64_t copied       # entries copied by growth of the entry arrays
    cdef uint64_t most_moved   # most entries one ``apply`` moved (copied, or out of a draining table)
    cdef int64_t live          # blocks in the tree
    cdef int64_t* res          # per worker: blocks held on any tier
    cdef int64_t* tres         # per worker * NMEDIA + medium
    cdef uint32_t* scratch     # two slots per worker: longest_match's survivors and their next step
    cdef uint32_t capworkers
    cdef list _workers
    cdef dict _wid
    cdef list _media
    cdef dict _medium_id
    cdef dict _hits
    # placement judgement (``exporter.core.index.prefix_index_ref``'s docstring): on while domains are set
    cdef bint pl_on
    cdef int pl_gpu            # tier id of the GPU medium (-1: not seen yet)
    cdef int64_t pl_decisions, pl_hits  # judged so far (a batch's result is the difference)
    cdef uint32_t pl_known     # workers the arrays below were built for
    cdef object pl_dom         # array("i"): per worker id, its domain id (-1: not in the topology)
    cdef object pl_out         # array("b"): per worker id, 1 when excluded (left the pool)
    cdef object pl_buf         # array("I"): two worker-id sets of the intersection walk
    cdef dict _pl_domain_ids   # worker -> domain id
    cdef frozenset _pl_excluded
    cdef object _pl_tails      # ChainTails: stores that continue a worker's own recent chain are not judged
    cdef public long version
    # statistics kept at apply time (see the statistics section below)
    cdef Tie* ties             # per entry: child list, depths
    cdef uint32_t root_head    # the child list of the root (entries with parent -1)
    cdef Vec st_reps           # int64: holders -> blocks in the tree
    cdef Vec st_fan            # int64: live children -> branching blocks in the tree with that many
    cdef int64_t st_root       # blocks in the tree whose parent is the root or out of the tree
    cdef int64_t st_fansum     # live children of the branching blocks in the tree
    cdef Vec st_leaf_e         # int64: depth in radix edges -> leaves
    cdef Vec st_leaf_b         # int64: depth in blocks -> leaves
    cdef set st_branch         # entries (in the tree or not) with two or more live children
    cdef Vec st_gone           # u32: holder-less entries (their orphans are root-level)
    cdef set st_cuts           # FLAG_CUT entries
    cdef dict st_deep          # entry -> (blocks, edges) for depths too large to pack
    cdef Vec st_stack          # u32: entries whose depths are to be settled
    cdef bint st_bulk          # a worker's clear: depths are rebuilt once at its end
    # ``longest_match``'s binary search: the open blocks (FLAG_OPEN) are those with a child held by a
    # worker that does not hold them (``_open``: entry -> such (worker, child) pairs) and the wide
    # ones (``_wide``, FLAG_WIDE: too many children to count through); elsewhere a child's holders
    # are a subset of its parent's, so along a chain they only shrink
    cdef dict _open
    cdef set _wide
    cdef uint64_t ov           # bumped when the open set or an open block's fingerprint changes
    cdef uint64_t ov_built     # ``ov`` the fingerprint table below was built at
    cdef uint32_t* o_fp        # the open blocks' path fingerprints, sorted
    cdef Py_ssize_t o_n
    cdef uint64_t* o_bits      # 65,536-bit filter of ``o_fp`` by their low 16 bits
    cdef int64_t pend_b        # a change to ``_open`` not made yet (-1: none): the removal of a
    cdef int64_t pend_d        # chain from its root opens each block's pair, then closes it

    def __cinit__(self):
        self.capblocks = 1024
        self.spanblocks = self.capblocks
        self.blocks = <Block*>_scratch_map(self.capblocks * sizeof(Block))
        self.ties = <Tie*>_scratch_map(self.capblocks * sizeof(Tie))
        _tb_init(&self.tb, 2048)
        self.capworkers = 64
        self.res = <int64_t*>calloc(self.capworkers, sizeof(int64_t))
        self.tres = <int64_t*>calloc(self.capworkers * NMEDIA, sizeof(int64_t))
        self.scratch = <uint32_t*>calloc(self.capworkers * 2, sizeof(uint32_t))
        if not (self.blocks and self.ties and self.tb.slots and self.res and self.tres and self.scratch):
            raise MemoryError()
        self.free_head = -1
        self._workers = []
        self._wid = {}
        self._media = []
        self._medium_id = {}
        self._hits = {}
        self.version = 0
        self.root_head = NONE
        _vec_init(&self.st_reps, sizeof(int64_t))
        _vec_init(&self.st_fan, sizeof(int64_t))
        _vec_init(&self.st_leaf_e, sizeof(int64_t))
        _vec_init(&self.st_leaf_b, sizeof(int64_t))
        _vec_init(&self.st_gone, sizeof(uint32_t))
        _vec_init(&self.st_stack, sizeof(uint32_t))
        self.st_branch, self.st_cuts, self.st_deep = set(), set(), {}
        self._open, self._wide = {}, set()
        self.o_bits = <uint64_t*>calloc(1024, sizeof(uint64_t))
        if not self.o_bits:
            raise MemoryError()
        self.ov = 1
        self.pend_b = -1

    def __dealloc__(self):
        cdef uint32_t i
        if self.blocks:
            for i in range(self.nblocks):
                if self.blocks[i].capx:
                    free(self.blocks[i].h.ext)
            _scratch_unmap(self.blocks, self.spanblocks * sizeof(Block))
        _scratch_unmap(self.ties, self.spanblocks * sizeof(Tie))
        _tb_free(&self.tb)
        free(self.res)
        free(self.tres)
        free(self.scratch)
        free(self.o_fp)
        free(self.o_bits)
        _vec_free(&self.st_reps)
        _vec_free(&self.st_fan)
        _vec_free(&self.st_leaf_e)
        _vec_free(&self.st_leaf_b)
        _vec_free(&self.st_gone)
        _vec_free(&self.st_stack)

    # ---- hash table and entries (``_index_table.pxi``: growth moves a bounded number per apply) ----
    cdef inline int64_t _find(self, uint64_t h) noexcept:
        return _tb_find(&self.tb, self.blocks, h)

    cdef int64_t _find_or_add(self, uint64_t h) except -2:
        """The entry of ``h``, created holder-less and root-level if it is new."""
        cdef uint64_t slot
        cdef int64_t b = _tb_probe(&self.tb, self.blocks, h, &slot)
        cdef Block* blk
        if b >= 0:
            return b
        if self.free_head >= 0:
            b = self.free_head
            self.free_head = self.blocks[b].parent
        else:
            if self.nblocks == self.capblocks:
                self.copied += _grow_entries(&self.blocks, &self.ties, &self.capblocks, &self.spanblocks,
                                             self.nblocks)
            b = self.nblocks
            self.nblocks += 1
        blk = &self.blocks[b]
        blk.hash = h
        blk.parent = -1
        blk.kids = 0
        blk.n = 0
        blk.capx = 0
        blk.flags = FLAG_NEW
        blk.next = NONE
        self.ties[b].first = NONE
        self.ties[b].prev = NONE
        self.ties[b].dep = 0
        self.ties[b].fp = 0
        if _tb_added(&self.tb, self.blocks, slot, <uint32_t>b):
            raise MemoryError()
        return b

    cdef inline uint64_t _moved(self) noexcept:
        return self.tb.moved + self.copied

    cdef inline void _applied(self, uint64_t moved0) noexcept:
        """The end of an ``apply``: a slice of the table's growth, and the most one apply moved."""
        _tb_tend(&self.tb, self.blocks)
        if self._moved() - moved0 > self.most_moved:
            self.most_moved = self._moved() - moved0

    def _growth(self):
        """How the storage has grown (tests and the bench): entry capacity and address space,
        table slots, whether an old table is draining, entries moved in all and by one apply."""
        return {"capacity": self.capblocks, "reserved": self.spanblocks, "slots": self.tb.mask + 1,
                "draining": self.tb.old != NULL, "moved": self._moved(), "most_moved_by_one_apply": self.most_moved}

    cdef void _unlink(self, int64_t b) noexcept:
        """Take entry ``b`` out of the table and onto the free list."""
        _tb_remove(&self.tb, self.blocks, <uint32_t>b)
        if self.blocks[b].capx:
            free(self.blocks[b].h.ext)
            self.blocks[b].capx = 0
        if self.blocks[b].flags & FLAG_GONE:
            self._gone_drop(<uint32_t>b)
        if self.pend_b >= 0:
            self._open_flush()
        if self.blocks[b].flags & FLAG_OPEN:
            self._open.pop(b, None)
            self._wide.discard(b)
            self.ov += 1
        self.blocks[b].flags = FLAG_FREE
        self.blocks[b].n = 0
        self.blocks[b].parent = <int32_t>self.free_head
        self.free_head = b

    cdef void _release(self, int64_t b) noexcept:
        """Free holder-less entries nobody names as parent (an empty child list), up the parent chain."""
        cdef int64_t p
        while b >= 0 and self.blocks[b].n == 0 and self.ties[b].first == NONE \
                and not self.blocks[b].flags & FLAG_FREE:
            p = self.blocks[b].parent
            _unlist_from(self.blocks, self.ties, &self.root_head, <uint32_t>b)
            self._unlink(b)
            b = p

    # ---- holders ---------------------------------------------------------------------------
    cdef inline int _slot_of(self, Block* blk, uint32_t wid) noexcept:
        """Position of the worker's entry in the block's sorted holders, or -(insertion point) - 1."""
        cdef uint32_t* e = _hold(blk)
        cdef int lo = 0, hi = blk.n, mid
        cdef uint32_t w
        while lo < hi:
            mid = (lo + hi) >> 1
            w = e[mid] >> 8
            if w == wid:
                return mid
            if w < wid:
                lo = mid + 1
            else:
                hi = mid
        return -lo - 1

    cdef int _insert(self, int64_t b, int pos, uint32_t entry) except -1:
        cdef Block* blk = &self.blocks[b]
        cdef uint32_t* e
        cdef uint32_t* grown
        cdef uint32_t cap = _capof(blk) if blk.capx else INLINE
        cdef uint8_t capx
        if blk.n == cap:
            if cap >= MAX_WORKERS:
                raise ValueError("more than 65535 workers hold one block")
            capx = 2 if not blk.capx else blk.capx + 1  # 4, 8, ..., 32768, then 65535
            cap = MAX_WORKERS if capx >= 16 else (1u << capx)
            grown = <uint32_t*>malloc(cap * sizeof(uint32_t))
            if not grown:
                raise MemoryError()
            memcpy(grown, _hold(blk), blk.n * sizeof(uint32_t))
            if blk.capx:
                free(blk.h.ext)
            blk.h.ext = grown
            blk.capx = capx
        e = _hold(blk)
        memmove(e + pos + 1, e + pos, (blk.n - pos) * sizeof(uint32_t))
        e[pos] = entry
        blk.n += 1
        self._st_holders_up(blk.n)  # statistics
        return 0

    cdef void _erase(self, int64_t b, int pos) noexcept:
        cdef Block* blk = &self.blocks[b]
        cdef uint32_t* e = _hold(blk)
        cdef uint32_t* ext
        memmove(e + pos, e + pos + 1, (blk.n - pos - 1) * sizeof(uint32_t))
        blk.n -= 1
        self._st_holders_down(blk.n)  # statistics
        if blk.capx and blk.n <= INLINE:  # back inline: no allocation for one or two holders
            ext = blk.h.ext
            memcpy(blk.h.inl, ext, blk.n * sizeof(uint32_t))
            free(ext)
            blk.capx = 0

    cdef int _leave(self, int64_t b) except -1:
        """Block ``b`` lost its last holder: it leaves the tree (its hits with it)."""
        self._st_leave(<uint32_t>b)  # statistics
        self.live -= 1
        if self.blocks[b].flags & FLAG_HIT:
            self.blocks[b].flags &= ~FLAG_HIT
            self._hits.pop(self.blocks[b].hash, None)
        self._release(b)
        return 0

    # ---- worker and medium tables ------------------------------------------------------------
    cdef int _worker_id(self, str worker) except -1:
        cdef object wid = self._wid.get(worker)
        cdef uint32_t cap
        cdef uint32_t n
        if wid is not None:
            return wid
        n = len(self._workers)
        if n >= MAX_WORKERS:
            raise ValueError(f"more than {MAX_WORKERS} workers")
        if n == self.capworkers:
            cap = self.capworkers * 2
            self.res = <int64_t*>realloc(self.res, cap * sizeof(int64_t))
            self.tres = <int64_t*>realloc(self.tres, cap * NMEDIA * sizeof(int64_t))
            self.scratch = <uint32_t*>realloc(self.scratch, cap * 2 * sizeof(uint32_t))
            if not (self.res and self.tres and self.scratch):
                raise MemoryError()
            memset(self.res + n, 0, (cap - n) * sizeof(int64_t))
            memset(self.tres + n * NMEDIA, 0, (cap - n) * NMEDIA * sizeof(int64_t))
            self.capworkers = cap
        self._workers.append(worker)
        self._wid[worker] = n
        return n

    cdef int _tier_id(self, object medium) except -1:
        if medium is None:
            medium = DEFAULT_MEDIUM
        t = self._medium_id.get(medium)
        if t is None:
            if len(self._media) >= NMEDIA:
                raise ValueError(f"more than {NMEDIA} cache media: {[*self._media, medium]}")
            t = len(self._media)
            self._media.append(medium)
            self._medium_id[medium] = t
        return t

    @property
    def workers(self):
        return list(self._workers)

    @property
    def media(self):
        return list(self._media)

    def resident_blocks(self, worker, medium=None):
        wid = self._wid.get(worker)
        if wid is None:
            return None
        if medium is None:
            return self.res[<int>wid]
        t = self._medium_id.get(medium)
        return 0 if t is None else self.tres[<int>wid * NMEDIA + <int>t]

    def resident_by_worker(self):
        cdef int i
        return {w: self.res[i] for i, w in enumerate(self._workers)}

    def resident_by_medium(self):
        cdef int i, t
        return {w: {m: self.tres[i * NMEDIA + t] for t, m in enumerate(self._media)}
                for i, w in enumerate(self._workers)}

    def holds(self, worker, block, medium=None):
        wid = self._wid.get(worker)
        if wid is None:
            return False
        cdef uint32_t bits = 0xFF
        if medium is not None:
            t = self._medium_id.get(medium)
            if t is None:
                return False
            bits = 1u << <int>t
        cdef int64_t b = self._find(_u64(block))
        if b < 0 or self.blocks[b].n == 0:
            return False
        cdef int pos = self._slot_of(&self.blocks[b], <uint32_t>wid)
        return pos >= 0 and bool(_hold(&self.blocks[b])[pos] & bits)

    def holders(self, block):
        cdef int64_t b = self._find(_u64(block))
        cdef int i
        cdef uint32_t* e
        if b < 0:
            return []
        e = _hold(&self.blocks[b])
        return [self._workers[e[i] >> 8] for i in range(self.blocks[b].n)]

    def parent(self, block):
        cdef int64_t b = self._find(_u64(block))
        if b < 0 or self.blocks[b].n == 0 or self.blocks[b].parent < 0:
            return None
        return self.blocks[self.blocks[b].parent].hash

    def blocks_of(self, worker):
        wid = self._wid.get(worker)
        if wid is None:
            return []
        cdef uint32_t b
        cdef list out = []
        for b in range(self.nblocks):
            if self.blocks[b].n and self._slot_of(&self.blocks[b], <uint32_t>wid) >= 0:
                out.append(self.blocks[b].hash)
        return out

    def __contains__(self, block):
        cdef int64_t b = self._find(_u64(block))
        return b >= 0 and self.blocks[b].n > 0

    def __len__(self):
        return self.live

    def memory_bytes(self):
        """Bytes this index has allocated (blocks in use, hash table, holder arrays, statistics)."""
        cdef uint64_t total = self.nblocks * (sizeof(Block) + sizeof(Tie)) + (self.tb.mask + 1) * sizeof(uint32_t)
        if self.tb.old != NULL:
            total += (self.tb.omask + 1) * sizeof(uint32_t)
        total += self.tb.ntouched if self.tb.next != NULL else 0
        total += (self.st_reps.cap + self.st_fan.cap + self.st_leaf_e.cap + self.st_leaf_b.cap) * sizeof(int64_t)
        total += (self.st_gone.cap + self.st_stack.cap) * sizeof(uint32_t)
        cdef uint32_t b
        for b in range(self.nblocks):
            total += _capof(&self.blocks[b]) * sizeof(uint32_t)
        return total

    # ---- events -------------------------------------------------------------------------------
    def apply(self, str worker, events):
        """Apply one worker's events in order (see ``ReferencePrefixIndex.apply``)."""
        cdef int wid = self._worker_id(worker)
        cdef int64_t stored = 0, removed = 0, cleared = 0, unknown_parent = 0, unknown_removals = 0
        cdef int64_t stored_events = 0, removed_events = 0
        cdef int64_t pl0 = self.pl_decisions, ph0 = self.pl_hits
        cdef uint64_t moved0 = self._moved()
        cdef int t = -1
        cdef Py_ssize_t n
        cdef object parent
        cdef uint64_t stackbuf[HBUF]
        cdef uint64_t* hbuf
        # The previous event's medium (``self``: none yet). Decoded media are equal strings, rarely
        # the same object: an equal one keeps the tier without a lookup.
        cdef object last = self
        for ev in events:
            kind = type(ev)
            if kind is BlockStored:
                hs = ev.hashes
                if type(hs) is not tuple:
                    hs = tuple(hs)
                m = ev.medium
                if m is not last and not (type(m) is str and type(last) is str and m == last):
                    t, last = self._tier_id(m), m
                stored_events += 1
                parent = ev.parent
                n = PyTuple_GET_SIZE(hs)
                stored += n
                hbuf = _load_hashes(hs, stackbuf)
                try:
                    unknown_parent += self._store(wid, t, hbuf, n, parent is not None,
                                                  _u64(parent) if parent is not None else 0)
                finally:
                    if hbuf != stackbuf:
                        free(hbuf)
            elif kind is BlockRemoved:
                hs = ev.hashes
                if type(hs) is not tuple:
                    hs = tuple(hs)
                m = ev.medium
                if m is not last and not (type(m) is str and type(last) is str and m == last):
                    t, last = self._tier_id(m), m
                removed_events += 1
                n = PyTuple_GET_SIZE(hs)
                removed += n
                hbuf = _load_hashes(hs, stackbuf)
                try:
                    unknown_removals += self._remove(wid, t, hbuf, n)
                finally:
                    if hbuf != stackbuf:
                        free(hbuf)
            elif kind is AllBlocksCleared:
                self._clear(wid)
                cleared += 1
        if self.st_stack.n > SETTLE_AT:
            self._st_settle(0)
        self._applied(moved0)
        self.version += 1
        return _apply_result(stored, removed, cleared, unknown_parent, unknown_removals, stored_events,
                             removed_events, self.pl_decisions - pl0, self.pl_hits - ph0)

    def apply_scan(self, str worker, KvScan scan):
        """Apply a batch read by :func:`scan_kv_batch`: the same as ``apply(worker, events)`` on
        the batch's model events (the equality tests hold the two to it), straight from the
        scan's hash arrays, with no event object built."""
        cdef int wid = self._worker_id(worker)
        cdef int64_t stored = 0, removed = 0, cleared = 0, unknown_parent = 0, unknown_removals = 0
        cdef int64_t stored_events = 0, removed_events = 0
        cdef int64_t pl0 = self.pl_decisions, ph0 = self.pl_hits
        cdef uint64_t moved0 = self._moved()
        cdef int tiers[SCAN_MAX_MEDIA]
        cdef int t, k
        cdef Py_ssize_t i
        cdef ScanEvent* e
        for k in range(SCAN_MAX_MEDIA):
            tiers[k] = -1
        # The batch's hashes are all known up front, so their table slots, then the entries those
        # slots name, are fetched before the events are applied: in a large index (a cluster's
        # millions of pairs) each lookup is a cache miss, and these overlap instead of queueing
        # one by one. (A prefetch is a hint: a slot that moves meanwhile costs only its miss.)
        # The entries a lookup compares are fetched (those of the hash's probe run that share its
        # home slot, which the slots say: usually the block itself, none for a new one); a
        # removal's backward shift reads slots only; the tree links read the ties.
        for i in range(scan.nh):
            __builtin_prefetch(&self.tb.slots[_mix(scan.hashes[i]) & self.tb.mask])
        for i in range(scan.nh):
            _tb_prefetch_run(&self.tb, self.blocks, self.ties, scan.hashes[i])
        for i in range(scan.n):
            e = &scan.ev[i]
            if e.kind == SCAN_CLEARED:
                self._clear(wid)
                cleared += 1
                continue
            t = tiers[e.medium]
            if t < 0:  # tiers are made in the order the events first name them, as ``apply`` does
                t = tiers[e.medium] = self._tier_id(scan.media[e.medium])
            if e.kind == SCAN_STORED:
                stored_events += 1
                stored += e.hn
                unknown_parent += self._store(wid, t, scan.hashes + e.hoff, e.hn, e.has_parent, e.parent)
            else:
                removed_events += 1
                removed += e.hn
                unknown_removals += self._remove(wid, t, scan.hashes + e.hoff, e.hn)
        if self.st_stack.n > SETTLE_AT:
            self._st_settle(0)
        self._applied(moved0)
        self.version += 1
        return _apply_result(stored, removed, cleared, unknown_parent, unknown_removals, stored_events,
                             removed_events, self.pl_decisions - pl0, self.pl_hits - ph0)

    def apply_kv(self, str worker, KvScan scan, CompiledEvictionTracker evictions, ts):
        """``(apply_scan(worker, scan), evictions.apply_scan(worker, scan, ts))`` in one pass: every
        table either part will look a hash of the batch up in is fetched ahead together, and each
        event goes to the eviction tracker right after the index, its hashes still in the cache.
        One call per batch into C (the equality tests hold it to the two calls)."""
        cdef int wid = self._worker_id(worker)
        cdef _EvictionWorker ew = evictions._worker(worker)
        cdef double now = ts
        cdef int64_t stored = 0, removed = 0, cleared = 0, unknown_parent = 0, unknown_removals = 0
        cdef int64_t stored_events = 0, removed_events = 0
        cdef int64_t ev_stored = 0, ev_restored = 0, ev_evicted = 0
        cdef bint other_media = False
        cdef list ages = []
        cdef int64_t pl0 = self.pl_decisions, ph0 = self.pl_hits
        cdef uint64_t moved0 = self._moved()
        cdef int tiers[SCAN_MAX_MEDIA]
        cdef int8_t gpu[SCAN_MAX_MEDIA]
        cdef int t, k
        cdef Py_ssize_t i
        cdef ScanEvent* e
        for k in range(SCAN_MAX_MEDIA):
            tiers[k] = -1
            gpu[k] = -1
        # (``apply_scan`` and ``CompiledEvictionTracker.apply_scan`` say why each fetch is made;
        # the dependent ones — the entries the index's slots name — come after every first one)
        for i in range(scan.nh):
            __builtin_prefetch(&self.tb.slots[_mix(scan.hashes[i]) & self.tb.mask])
        evictions._prefetch(ew, scan.hashes, scan.nh)
        for i in range(scan.nh):
            _tb_prefetch_run(&self.tb, self.blocks, self.ties, scan.hashes[i])
        for i in range(scan.n):
            e = &scan.ev[i]
            if e.kind == SCAN_CLEARED:
                self._clear(wid)
                cleared += 1
                _ring_clear(&ew.recent)  # a reset, not eviction: nothing to learn from
                _ring_clear(&ew.sampled)
                _ot_clear(&ew.live)
                ew.carry = 0
                continue
            t = tiers[e.medium]
            if t < 0:  # tiers are made in the order the events first name them, as ``apply`` does
                t = tiers[e.medium] = self._tier_id(scan.media[e.medium])
            if gpu[e.medium] < 0:
                gpu[e.medium] = _is_gpu(scan.media[e.medium])
            if e.kind == SCAN_STORED:
                stored_events += 1
                stored += e.hn
                unknown_parent += self._store(wid, t, scan.hashes + e.hoff, e.hn, e.has_parent, e.parent)
                if gpu[e.medium]:
                    evictions._stored(ew, scan.hashes + e.hoff, e.hn, e.has_parent, e.parent, now,
                                      &ev_stored, &ev_restored)
                else:
                    other_media = True
            else:
                removed_events += 1
                removed += e.hn
                unknown_removals += self._remove(wid, t, scan.hashes + e.hoff, e.hn)
                if gpu[e.medium]:
                    ev_evicted += evictions._removed(ew, scan.hashes + e.hoff, e.hn, now, ages)
                else:
                    other_media = True
        evictions._expire(ew, now)
        if self.st_stack.n > SETTLE_AT:
            self._st_settle(0)
        self._applied(moved0)
        self.version += 1
        return (_apply_result(stored, removed, cleared, unknown_parent, unknown_removals, stored_events,
                              removed_events, self.pl_decisions - pl0, self.pl_hits - ph0),
                _batch_evictions(ev_stored, ev_restored, ev_evicted, ages, other_media))

    cdef int _store(self, int wid, int t, const uint64_t* hs, Py_ssize_t n, bint has_parent,
                    uint64_t parent) except -1:
        """One BlockStored; returns 1 when the worker held its parent on no tier."""
        cdef uint32_t tbit = 1u << t
        cdef int64_t prev = -1, b, p
        cdef int unknown = 0, pos
        cdef Py_ssize_t i
        cdef Block* blk
        cdef uint32_t* e
        if self.pl_on:  # judged against the index before this store
            self._pl_judge(wid, t, hs, n, has_parent, parent)
        if has_parent:
            p = self._find(parent)
            if p < 0 or self.blocks[p].n == 0:
                unknown = 1  # nobody holds it: the run hangs off the root
            else:
                prev = p
                if self._slot_of(&self.blocks[p], <uint32_t>wid) < 0:
                    unknown = 1
        for i in range(n):
            b = self._find_or_add(hs[i])
            blk = &self.blocks[b]
            if blk.n == 0:  # new to the tree: fresh, or a departed block named by a child
                self._insert(b, 0, (<uint32_t>wid << 8) | tbit)
                self.live += 1
                self.res[wid] += 1
                self.tres[wid * NMEDIA + t] += 1
                p = self.blocks[b].parent
                if self.blocks[b].flags & FLAG_NEW:
                    self.blocks[b].flags &= ~FLAG_NEW
                    self.blocks[b].parent = <int32_t>prev
                    _link_to(self.blocks, self.ties, &self.root_head, <uint32_t>b, prev)
                    self.ties[b].fp = _fp_of(self.ties[prev].fp if prev >= 0 else FP_ROOT, blk.hash)
                else:
                    if p != prev:  # a departed block back under another parent
                        _unlist_from(self.blocks, self.ties, &self.root_head, <uint32_t>b)
                        self.blocks[b].parent = <int32_t>prev
                        _link_to(self.blocks, self.ties, &self.root_head, <uint32_t>b, prev)
                        if p >= 0:
                            self._release(p)
                    self._fp_set(<uint32_t>b)
                self._st_enter(<uint32_t>b)  # statistics
                self._now_holds(b, <uint32_t>wid)
            else:
                pos = self._slot_of(blk, <uint32_t>wid)
                if pos < 0:
                    self._insert(b, -pos - 1, (<uint32_t>wid << 8) | tbit)
                    self.res[wid] += 1
                    self.tres[wid * NMEDIA + t] += 1
                    self._now_holds(b, <uint32_t>wid)
                else:
                    e = _hold(blk)
                    if not e[pos] & tbit:
                        e[pos] |= tbit
                        self.tres[wid * NMEDIA + t] += 1
            prev = b
        return unknown

    cdef int64_t _remove(self, int wid, int t, const uint64_t* hs, Py_ssize_t n) except -1:
        """One BlockRemoved on one medium; returns the hashes the worker did not hold there."""
        cdef uint32_t tbit = 1u << t
        cdef int64_t b, unknown = 0
        cdef int pos
        cdef Py_ssize_t i
        cdef uint32_t* e
        for i in range(n):
            b = self._find(hs[i])
            if b < 0 or self.blocks[b].n == 0:
                unknown += 1
                continue
            pos = self._slot_of(&self.blocks[b], <uint32_t>wid)
            if pos < 0:
                unknown += 1
                continue
            e = _hold(&self.blocks[b])
            if not e[pos] & tbit:
                unknown += 1
                continue
            e[pos] &= ~tbit
            self.tres[wid * NMEDIA + t] -= 1
            if not e[pos] & 0xFF:
                self._stops_holding(b, <uint32_t>wid)
                self._erase(b, pos)
                self.res[wid] -= 1
                if self.blocks[b].n == 0:
                    self._leave(b)
        return unknown

    cdef int _clear(self, int wid) except -1:
        """One pass over all entries (clears are rare: restarts), so the depths are not kept block
        by block meanwhile (each departure could shift a subtree) but rebuilt once at the end."""
        cdef uint32_t b
        cdef int pos
        if self.res[wid] == 0:
            return 0
        self.st_bulk = True
        try:
            for b in range(self.nblocks):
                if self.blocks[b].n:
                    pos = self._slot_of(&self.blocks[b], <uint32_t>wid)
                    if pos >= 0:
                        self._erase(b, pos)
                        if self.blocks[b].n == 0:
                            self._leave(b)
        finally:
            self.st_bulk = False
            self._st_rebuild()
            self._open_rebuild()
        self.res[wid] = 0
        memset(self.tres + wid * NMEDIA, 0, NMEDIA * sizeof(int64_t))
        self.version += 1
        return 0

    def clear_worker(self, worker):
        """Drop every block from one worker's view, on every tier (restart or AllBlocksCleared)."""
        wid = self._wid.get(worker)
        if wid is not None:
            self._clear(wid)

    # ---- placement (``exporter.core.index.prefix_index_ref``'s docstring) ------------------------------------
    def set_placement_domains(self, domains):
        """Judge each GPU store's placement against these NVLink domains (worker -> domain); None: stop."""
        ids = {}
        self._pl_domain_ids = {w: ids.setdefault(d, len(ids)) for w, d in domains.items()} if domains is not None else None
        self.pl_on = domains is not None
        self.pl_gpu = self._medium_id.get(DEFAULT_MEDIUM, -1)
        self.pl_known = <uint32_t>-1

    def set_placement_excluded(self, workers):
        """Workers whose blocks no placement can use (they left the pool)."""
        self._pl_excluded = frozenset(workers)
        self.pl_known = <uint32_t>-1

    def set_placement_clock(self, ts):
        """The time of the batch about to be applied (continuations are judged by it)."""
        if self._pl_tails is None:
            self._pl_tails = ChainTails()
        self._pl_tails.now = ts

    cdef int _pl_refresh(self) except -1:
        """The per-worker arrays, rebuilt when a worker appears (rare) or the tables change."""
        ids, excluded = self._pl_domain_ids or {}, self._pl_excluded or frozenset()
        self.pl_dom = array("i", [ids.get(w, -1) for w in self._workers])
        self.pl_out = array("b", [w in excluded for w in self._workers])
        self.pl_buf = array("I", [0]) * (2 * len(self._workers))
        self.pl_known = len(self._workers)
        return 0

    cdef int _pl_judge(self, int wid, int t, const uint64_t* hs, Py_ssize_t n, bint has_parent,
                       uint64_t parent) except -1:
        """One store's placement, before it is applied: the holders of its first blocks (sorted
        worker ids, intersected while non-empty) else of its parent."""
        cdef int64_t b
        cdef Block* blk
        cdef const uint32_t* e
        cdef uint32_t* cur
        cdef uint32_t* nxt
        cdef uint32_t* tmp
        cdef const int32_t* dom
        cdef const int8_t* out
        cdef uint32_t k, j, cnt = 0, m, x
        cdef Py_ssize_t i
        cdef int32_t mine
        if t != self.pl_gpu:
            if self.pl_gpu >= 0 or self._media[t] != DEFAULT_MEDIUM:
                return 0
            self.pl_gpu = t
        if n == 0:
            return 0
        if self.pl_known != <uint32_t>len(self._workers):
            self._pl_refresh()
        dom = <const int32_t*>(<carray.array>self.pl_dom).data.as_ints
        out = <const int8_t*>(<carray.array>self.pl_out).data.as_schars
        mine = dom[wid]
        if mine < 0:
            return 0
        if self._pl_tails is not None and self._pl_tails.continues(wid, parent if has_parent else None, hs[n - 1]):
            return 0
        cur = (<carray.array>self.pl_buf).data.as_uints
        nxt = cur + self.pl_known
        b = self._find(hs[0])
        if b >= 0:
            blk = &self.blocks[b]
            e = _hold(blk)
            for k in range(blk.n):
                x = e[k] >> 8
                if x != <uint32_t>wid and not out[x]:
                    cur[cnt] = x
                    cnt += 1
        if cnt:  # others held a longer prefix: the deepest non-empty intersection
            for i in range(1, n):
                b = self._find(hs[i])
                if b < 0:
                    break
                blk = &self.blocks[b]
                e = _hold(blk)
                m = j = 0
                for k in range(cnt):  # both sorted by worker id
                    x = cur[k]
                    while j < blk.n and (e[j] >> 8) < x:
                        j += 1
                    if j == blk.n:
                        break
                    if (e[j] >> 8) == x:
                        nxt[m] = x
                        m += 1
                if m == 0:
                    break
                tmp = cur
                cur = nxt
                nxt = tmp
                cnt = m
        elif has_parent:
            b = self._find(parent)
            if b >= 0:
                blk = &self.blocks[b]
                e = _hold(blk)
                for k in range(blk.n):
                    x = e[k] >> 8
                    if x == <uint32_t>wid or not out[x]:
                        cur[cnt] = x
                        cnt += 1
        if cnt == 0:
            return 0
        self.pl_decisions += 1
        for k in range(cnt):
            if dom[cur[k]] == mine:
                self.pl_hits += 1
                break
        return 0

    # ---- open blocks and path fingerprints (``longest_match``'s binary search) -------------------
    cdef int _fp_set(self, uint32_t b) except -1:
        """Entry ``b``'s parent link was set: its fingerprint, and its descendants' if it changed
        (through the child lists; a parent cycle ends the walk where it started)."""
        cdef int64_t p = self.blocks[b].parent
        cdef uint32_t f = _fp_of(self.ties[p].fp if p >= 0 else FP_ROOT, self.blocks[b].hash)
        cdef uint32_t x, c
        cdef Vec q
        if f == self.ties[b].fp:
            return 0
        self.ties[b].fp = f
        if self.blocks[b].flags & FLAG_OPEN:
            self.ov += 1
        if self.ties[b].first == NONE:
            return 0
        _vec_init(&q, sizeof(uint32_t))
        try:
            if _qpush(&q, b):
                raise MemoryError()
            while q.n:
                q.n -= 1
                x = (<uint32_t*>q.data)[q.n]
                c = self.ties[x].first
                while c != NONE:
                    f = _fp_of(self.ties[x].fp, self.blocks[c].hash)
                    if c != b and f != self.ties[c].fp:
                        self.ties[c].fp = f
                        if self.blocks[c].flags & FLAG_OPEN:
                            self.ov += 1
                        if self.ties[c].first != NONE and _qpush(&q, c):
                            raise MemoryError()
                    c = self.blocks[c].next
        finally:
            _vec_free(&q)
        return 0

    cdef inline int _open_add(self, int64_t p, int64_t d) except -1:
        """``d`` more (worker, child) pairs of ``p`` whose worker does not hold ``p`` (``p`` not wide).
        Changes to one block in a row are summed first: removing a chain from its root, each
        block's pair with the next opens and closes again, with no dictionary work."""
        if p == self.pend_b:
            self.pend_d += d
            return 0
        if self.pend_b >= 0:
            self._open_flush()
        self.pend_b, self.pend_d = p, d
        return 0

    cdef int _open_flush(self) except -1:
        """Make the pending change to ``_open``."""
        cdef int64_t p = self.pend_b, d = self.pend_d, cnt
        self.pend_b = -1
        if p < 0 or d == 0:
            return 0
        cnt = self._open.get(p, 0) + d
        if cnt > 0:
            self._open[p] = cnt
            if not self.blocks[p].flags & FLAG_OPEN:
                self.blocks[p].flags |= FLAG_OPEN
                self.ov += 1
        else:
            self._open.pop(p, None)
            if self.blocks[p].flags & FLAG_OPEN:
                self.blocks[p].flags &= ~FLAG_OPEN
                self.ov += 1
        return 0

    cdef int64_t _kids_held(self, int64_t b, uint32_t wid) except -2:
        """How many of ``b``'s children ``wid`` holds; -1 when ``b`` has too many to count (it
        becomes wide: open for good, so no holder change of its children is counted again)."""
        cdef uint32_t c = self.ties[b].first
        cdef int64_t k = 0, steps = 0
        while c != NONE:
            steps += 1
            if steps > WALK_KIDS:
                if self.pend_b == b:
                    self.pend_b = -1
                self._open.pop(b, None)
                self._wide.add(b)
                self.blocks[b].flags |= FLAG_WIDE | FLAG_OPEN
                self.ov += 1
                return -1
            if self.blocks[c].n and self._slot_of(&self.blocks[c], wid) >= 0:
                k += 1
            c = self.blocks[c].next
        return k

    cdef int _now_holds(self, int64_t b, uint32_t wid) except -1:
        """``wid`` came to hold ``b`` (its parent link set): the pair is open when it lacks the
        parent; its pairs with ``b``'s children stop being open."""
        cdef int64_t p = self.blocks[b].parent, k
        if p >= 0 and not self.blocks[p].flags & FLAG_WIDE and self._slot_of(&self.blocks[p], wid) < 0:
            self._open_add(p, 1)
        if self.ties[b].first != NONE and not self.blocks[b].flags & FLAG_WIDE:
            k = self._kids_held(b, wid)
            if k > 0:
                self._open_add(b, -k)
        return 0

    cdef int _stops_holding(self, int64_t b, uint32_t wid) except -1:
        """``wid`` is about to stop holding ``b``: the reverse of ``_now_holds``."""
        cdef int64_t p = self.blocks[b].parent, k
        if p >= 0 and not self.blocks[p].flags & FLAG_WIDE and self._slot_of(&self.blocks[p], wid) < 0:
            self._open_add(p, -1)
        if self.ties[b].first != NONE and not self.blocks[b].flags & FLAG_WIDE:
            k = self._kids_held(b, wid)
            if k > 0:
                self._open_add(b, k)
        return 0

    cdef int _open_rebuild(self) except -1:
        """Count the open pairs anew (after a worker's clear, which erases without counting)."""
        cdef uint32_t c, j
        cdef int64_t p
        cdef uint32_t* e
        cdef dict counts = {}
        self.pend_b = -1
        for c in range(self.nblocks):
            if not self.blocks[c].flags & FLAG_WIDE:
                self.blocks[c].flags &= ~FLAG_OPEN
        for c in range(self.nblocks):
            p = self.blocks[c].parent
            if not self.blocks[c].n or p < 0 or self.blocks[p].flags & FLAG_WIDE:
                continue
            e = _hold(&self.blocks[c])
            for j in range(self.blocks[c].n):
                if self._slot_of(&self.blocks[p], e[j] >> 8) < 0:
                    counts[p] = counts.get(p, 0) + 1
        for p in counts:
            self.blocks[p].flags |= FLAG_OPEN
        self._open = counts
        self.ov += 1
        return 0

    def _open_blocks(self):
        """(tests) The open blocks' hashes -> their open pairs (-1: wide), as kept and as counted anew."""
        self._open_flush()
        kept = {self.blocks[p].hash: n for p, n in self._open.items()}
        kept.update({self.blocks[p].hash: -1 for p in self._wide})
        self._open_rebuild()
        counted = {self.blocks[p].hash: n for p, n in self._open.items()}
        counted.update({self.blocks[p].hash: -1 for p in self._wide})
        return kept, counted

    def _fingerprints_hold(self):
        """(tests) Whether every entry's fingerprint follows from its parent's (cycles aside)."""
        cdef uint32_t c
        cdef int64_t p
        for c in range(self.nblocks):
            if self.blocks[c].flags & FLAG_FREE:
                continue
            p = self.blocks[c].parent
            if self.ties[c].fp != _fp_of(self.ties[p].fp if p >= 0 else FP_ROOT, self.blocks[c].hash):
                if not self._in_cycle(c):
                    return False
        return True

    cdef bint _in_cycle(self, uint32_t c):
        cdef int64_t p = self.blocks[c].parent
        cdef uint32_t steps = 0
        while p >= 0 and steps <= self.nblocks:
            if p == c:
                return True
            p = self.blocks[p].parent
            steps += 1
        return False

    cdef int _open_table(self) except -1:
        """The sorted fingerprints of the open blocks and their filter, rebuilt when they changed."""
        cdef Py_ssize_t n = len(self._open) + len(self._wide), i = 0
        cdef uint32_t* fps
        cdef uint32_t f
        fps = <uint32_t*>realloc(self.o_fp, (n + 1) * sizeof(uint32_t))
        if not fps:
            raise MemoryError()
        self.o_fp = fps
        memset(self.o_bits, 0, 1024 * sizeof(uint64_t))
        for src in (self._open, self._wide):
            for p in src:
                f = self.ties[<uint32_t>p].fp
                fps[i] = f
                self.o_bits[(f & 0xFFFF) >> 6] |= (<uint64_t>1) << (f & 63)
                i += 1
        qsort(fps, n, sizeof(uint32_t), _cmp_u32)
        self.o_n = n
        self.ov_built = self.ov
        return 0

    # ---- lookups ------------------------------------------------------------------------------
    cdef inline void _ahead(self, uint64_t h) noexcept:
        """Start loading the table slot of ``h`` (a later probe's)."""
        __builtin_prefetch(&self.tb.slots[_mix(h) & self.tb.mask])

    def longest_match(self, block_hashes):
        """Leading blocks of ``block_hashes`` each worker holds (on any tier), and the best of them.

        Exact without assuming the chain property (a worker may hold a block without its parent).
        The rule the walk and its result rely on: the survivors after block d+1 — the workers
        holding each of the first d+1 blocks — are the survivors after block d that hold block
        d+1, a subset of them. So each worker's depth is the depth at which it stops surviving;
        the result keeps, each time the survivors shrink, the set before the step with its depth
        (groups of falling size and rising depth, each a subset of the one before), and a worker's
        depth is that of the deepest group naming it; the best depth among workers outside a set X
        is that of the deepest group with a member outside X (a deeper group's members are all in
        this one). A block whose holder entries (worker and tier bits) are byte for byte those of
        the block before, when every holder of that block survived, leaves the survivors as they
        are. tests/exporter/core/index/test_prefix_index_equality.py holds the result to the reference's
        per-worker walk. The workers still matching are a sorted
        array; each block intersects it with the block's sorted holders (a merge, or binary
        searches when one side is much shorter). When the survivors shrink, the set before the
        step is appended to the result with its depth (one memcpy; the per-worker dict is built
        from these groups only if asked for). When the survivors are all the previous block's
        holders and this block has the same holder entries (the usual case inside a shared
        prefix), one memcmp stands for the intersection. The walk ends at the first block no
        survivor holds.

        Long chains (``set_binary_from``: 32 blocks and more) skip most of the walk by binary
        search where that is exact. Exact means: along a stretch of the chain the survivors can
        only shrink, so "block j holds every survivor" is true up to some block and false after
        it. That holds from block a to block b when (1) the chain's blocks a..b are a path of the
        index's tree — each one's parent link names the block before it, checked by the path
        fingerprint each entry keeps (``_fp_of`` folded from the root, compared with the
        chain's own fold: a 32-bit check, so an inconsistent path passes with odds of 2^-32)
        — and (2) none of blocks a..b-1 is open: every holder of each one's children holds it
        too (kept at apply time per block: ``_open``, or wide — more children than a holder
        change counts through — which always counts as open). Engines that chain block hashes
        and evict children first keep holdings prefix-closed, so in a healthy fleet the open
        blocks are few: a run stored under a parent its worker lacks (a lost event), a block
        evicted from the middle while the blocks below it stay, and the wide branching points
        (a system prompt with many conversations below it). The walk steps block by block
        through an open block's child (one intersection) and searches again after it; where
        the fingerprint does not match (a chain that leaves the tree's paths, a run hanging off
        the root after a lost parent, a parent cycle) it walks block by block to the end. A
        search costs about two log2(length) probes per distinct survivor set, instead of a probe
        per block; every chain still has each of its hashes read once to fold the fingerprints.
        """
        if type(block_hashes) is not tuple:
            block_hashes = tuple(block_hashes)
        cdef tuple hs = block_hashes
        cdef Py_ssize_t i, n = PyTuple_GET_SIZE(hs), lo, hi, mid_i, seg
        cdef uint32_t depth = 0
        cdef int64_t b, bm
        cdef uint32_t* e
        cdef uint32_t* prev_e = NULL
        cdef uint32_t* alive = self.scratch
        cdef uint32_t* nxt = self.scratch + self.capworkers
        cdef uint32_t* tmp
        cdef int k, prev_k = 0, na = 0, nn, j, a, lo2, hi2, mid
        cdef bint full = False, binary = n >= _binary_from, ok, first
        cdef uint32_t w, f, olo, ohi, omid
        cdef Py_ssize_t o_n
        cdef const uint64_t* o_bits
        cdef uint32_t head[2]
        cdef carray.array out = carray.clone(_GROUPS, 0, zero=False)
        # The chain's hashes are known up front, so their table slots and blocks are fetched
        # ahead of the walk: the lookups' cache misses overlap instead of queueing one by one.
        cdef uint64_t stackbuf[64]
        cdef uint32_t fpbuf[64]
        cdef uint8_t cutbuf[65]
        cdef uint64_t* h = stackbuf
        cdef uint32_t* fp = fpbuf
        cdef uint8_t* cut = cutbuf
        cdef int64_t hint
        if n > 64:
            h = <uint64_t*>malloc(n * (sizeof(uint64_t) + sizeof(uint32_t) + 1) + 1)
            if not h:
                raise MemoryError()
            fp = <uint32_t*>(h + n)
            cut = <uint8_t*>(fp + n)
        try:
            if binary and self.pend_b >= 0:
                self._open_flush()
            if binary and self.ov != self.ov_built:
                self._open_table()
            f = FP_ROOT
            o_n, o_bits = (self.o_n if binary else 0), self.o_bits
            for i in range(min(n, INTS_AHEAD)):
                __builtin_prefetch(<void*>PyTuple_GET_ITEM(hs, i))
            for i in range(n):
                if i + INTS_AHEAD < n:  # the ints themselves: a record's may be anywhere in the heap
                    __builtin_prefetch(<void*>PyTuple_GET_ITEM(hs, i + INTS_AHEAD))
                if not _u64_digits(PyTuple_GET_ITEM(hs, i), &h[i]):
                    h[i] = _u64(<object>PyTuple_GET_ITEM(hs, i))
                if binary:
                    # the path fingerprint of the chain's first i + 1 blocks, and whether an open
                    # block could sit at i (then the walk steps through block i + 1)
                    f = _fp_of(f, h[i])
                    fp[i] = f
                    cut[i + 1] = 0
                    if o_n and o_bits[(f & 0xFFFF) >> 6] & ((<uint64_t>1) << (f & 63)):
                        olo, ohi = 0, <uint32_t>o_n
                        while olo < ohi:
                            omid = (olo + ohi) >> 1
                            if self.o_fp[omid] < f:
                                olo = omid + 1
                            else:
                                ohi = omid
                        cut[i + 1] = olo < o_n and self.o_fp[olo] == f
            for i in range(min(n, AHEAD)):
                __builtin_prefetch(&self.tb.slots[_mix(h[i]) & self.tb.mask])
            i = 0
            while i < n:
                if i + AHEAD < n:
                    __builtin_prefetch(&self.tb.slots[_mix(h[i + AHEAD]) & self.tb.mask])
                if i + AHEAD // 2 < n:
                    hint = _tb_hint(&self.tb, h[i + AHEAD // 2])
                    if hint >= 0:
                        __builtin_prefetch(&self.blocks[hint])
                b = self._find(h[i])
                if b < 0 or self.blocks[b].n == 0:
                    break
                e = _hold(&self.blocks[b])
                k = self.blocks[b].n
                if depth == 0:
                    for j in range(k):
                        alive[j] = e[j] >> 8
                    na = k
                    full = True
                elif not (full and k == prev_k and memcmp(e, prev_e, k * sizeof(uint32_t)) == 0):
                    nn = 0
                    if k * 16 < na:  # few holders: look each up among the survivors
                        for j in range(k):
                            w = e[j] >> 8
                            lo2, hi2 = 0, na
                            while lo2 < hi2:
                                mid = (lo2 + hi2) >> 1
                                if alive[mid] < w:
                                    lo2 = mid + 1
                                else:
                                    hi2 = mid
                            if lo2 < na and alive[lo2] == w:
                                nxt[nn] = w
                                nn += 1
                    elif na * 16 < k:  # few survivors: look each up among the holders
                        for a in range(na):
                            w = alive[a]
                            lo2, hi2 = 0, k
                            while lo2 < hi2:
                                mid = (lo2 + hi2) >> 1
                                if (e[mid] >> 8) < w:
                                    lo2 = mid + 1
                                else:
                                    hi2 = mid
                            if lo2 < k and (e[lo2] >> 8) == w:
                                nxt[nn] = w
                                nn += 1
                    else:  # a merge of the two sorted lists
                        j = 0
                        for a in range(na):
                            w = alive[a]
                            while j < k and (e[j] >> 8) < w:
                                j += 1
                            if j < k and (e[j] >> 8) == w:
                                nxt[nn] = w
                                nn += 1
                    if nn < na:  # some stop here: the set before this block reached ``depth``
                        head[0], head[1] = depth, na
                        carray.extend_buffer(out, <char*>head, 2)
                        carray.extend_buffer(out, <char*>alive, na)
                    tmp = alive
                    alive, nxt = nxt, tmp
                    na = nn
                    if not na:
                        break
                    full = na == k
                prev_e, prev_k = e, k
                depth += 1
                i += 1
                if not binary or self.ties[b].fp != fp[i - 1]:
                    continue
                # Block i - 1 is on its path from the root (its fingerprint is the chain's). Up to
                # the next open block the chain follows parent links through blocks whose
                # children's holders are subsets of theirs, so the survivors stay whole up to
                # some block and shrink after it: find the last block that holds them all by
                # binary search, and step from there.
                seg = i
                while seg < n and not cut[seg]:
                    seg += 1
                lo, hi = i - 1, seg  # block lo holds the survivors; none from hi on is looked at
                bm = b
                first = True
                while hi - lo > 1:
                    if first:  # the survivors mostly reach the stretch's end: one probe when they do
                        mid_i = hi - 1
                        first = False
                    else:
                        mid_i = (lo + hi) >> 1
                        # the probes are dependent (each halves the range), so fetch the next two
                        # levels' candidates while this one's table slot, block and fingerprint load
                        self._ahead(h[(lo + mid_i) >> 1])
                        self._ahead(h[(mid_i + hi) >> 1])
                        self._ahead(h[(3 * lo + mid_i) >> 2])
                        self._ahead(h[(lo + 3 * mid_i) >> 2])
                        self._ahead(h[(3 * mid_i + hi) >> 2])
                        self._ahead(h[(mid_i + 3 * hi) >> 2])
                    hint = _tb_hint(&self.tb, h[mid_i])
                    if hint >= 0:
                        __builtin_prefetch(&self.blocks[hint])
                        __builtin_prefetch(&self.ties[hint])
                    b = self._find(h[mid_i])
                    ok = b >= 0 and self.ties[b].fp == fp[mid_i]
                    if ok:
                        if full:  # the survivors are block i - 1's holders: a subset of them as large
                            ok = self.blocks[b].n == na
                        else:
                            for a in range(na):
                                if self._slot_of(&self.blocks[b], alive[a]) < 0:
                                    ok = False
                                    break
                    if ok:
                        lo, bm = mid_i, b
                    else:
                        hi = mid_i
                if lo >= i:
                    prev_e, prev_k = _hold(&self.blocks[bm]), self.blocks[bm].n
                    full = na == prev_k
                    depth = <uint32_t>(lo + 1)
                    i = lo + 1
        finally:
            if h != stackbuf:
                free(h)
        if na:
            head[0], head[1] = depth, na
            carray.extend_buffer(out, <char*>head, 2)
            carray.extend_buffer(out, <char*>alive, na)
        cdef CompiledMatch match = CompiledMatch.__new__(CompiledMatch)
        match.blocks, match._names, match._wid, match._pairs = depth, self._workers, self._wid, out
        return match

    def record_hits(self, block_hashes, hit_blocks, block_size):
        hits = self._hits
        cdef int64_t b
        for h in block_hashes[:hit_blocks]:
            b = self._find(_u64(h))
            if b >= 0 and self.blocks[b].n:
                key = self.blocks[b].hash
                hits[key] = hits.get(key, 0) + block_size
                self.blocks[b].flags |= FLAG_HIT

    def hit_tokens(self, block):
        return self._hits.get(block, 0)

    def branch_of(self, block_hashes, stats):
        """The branch a chain belongs to (see ``ReferencePrefixIndex.branch_of``)."""
        if not block_hashes:
            return None
        branching = stats.branching
        for i in range(len(block_hashes) - 1):
            if block_hashes[i] in branching:
                return block_hashes[i + 1]
            if block_hashes[i + 1] not in self:
                break
        return block_hashes[0]

    # ---- statistics -----------------------------------------------------------------------------
    # Every statistic is kept at apply time, one call per block-state transition (``_st_enter``,
    # ``_st_leave``, ``_st_kid``, ``_st_holders_*``): live children per entry, holders -> blocks,
    # children -> branching blocks, root-level blocks, the branching set, and the leaf depths.
    # Reading them is O(histogram + branching set) (``StatsReading``); nothing walks the tree.
    #
    # The depth rule. Each block in the tree keeps its depth in blocks and in radix edges (packed
    # in ``Tie.dep``). A block whose parent is the root or out of the tree (an orphan), or that is a
    # parent cycle's cut, has depths (1, 1); any other block has its parent's depth in blocks + 1,
    # and its parent's depth in edges + 1 if the parent has two or more live children (a run starts
    # here), else the parent's (the run goes on). A leaf (no live child) is counted in the two
    # histograms at its depths. A block's depths depend only on its parent's depths, on whether its
    # parent is in the tree and has two or more live children, and on its own cut flag; whenever one
    # of these changes, the blocks concerned are queued (``st_stack``) and ``_st_settle`` recomputes
    # each from its parent: one whose depths are unchanged stops there; one whose depths changed
    # moves between histogram buckets if it is a leaf, else queues its live children. The tree is
    # a forest once cycles are cut, so the settled depths are the rule's unique solution, whatever
    # the order. Two invariants make that hold while blocks wait in the queue: the histograms count
    # each leaf at its *stored* depths (every change of a stored depth or of leafhood moves it), and
    # every block whose stored depths differ from what the rule gives from its parent's stored
    # depths is queued. So ``apply`` only queues (a block's new depths come from its parent's
    # stored ones, exactly as settling would give them), and the next reading settles the queue
    # before it copies anything, a bounded number of blocks per step under the lock (``step``
    # returns False until the queue is empty; after ``SETTLE_STEPS`` steps the rest goes in one).
    # A queued block that left the tree meanwhile costs nothing: a chain evicted top first, or a
    # subtree orphaned and then evicted before the reading, is never visited. ``apply`` settles
    # itself only when more than ``SETTLE_AT`` blocks wait (no reader), to bound the queue.
    #
    # What a transition costs:
    # * at apply time, O(1) always: the counters, a block stored under a leaf (same edges, one more
    #   block; the parent stops being a leaf), under a block with two or more children (one more
    #   edge) or under the root, a leaf leaving whose parent keeps two or more children or becomes
    #   a leaf, holders and tiers changing — and the queueing of the children named below.
    # * at the next reading, the subtree below, each entry once (its child list scanned; ~20 ns an
    #   entry, more out of the cache): a block with one child gaining a second (the first child's
    #   subtree gains an edge), a block going from two children to one (the remaining child's
    #   subtree loses one: it merges into the parent's run), a block leaving the middle of the tree
    #   (its children's subtrees become root-level runs; the usual eviction takes leaves first) or
    #   coming back above its orphans. The worst case is a split or a merge right above a large
    #   subtree — a second child near the top of a tree that hangs under one chain — which visits
    #   that whole subtree: at 10 M (worker, block) pairs ``bench.prefix_index`` measures it, spread
    #   over the reading's steps (each a few ms of lock); further children there are O(1) again.
    # * a worker's clear is one pass over all entries already: depths are rebuilt once after it.
    #
    # Parent cycles (colliding hashes: a departed block comes back under its own descendant) are
    # found when a block with live children enters the tree (a walk up from its parent) and cut
    # above their smallest hash (FLAG_CUT), the reference's rule; a cycle member leaving lifts the
    # cut. Child lists hold every entry naming a block as parent, holder-less ones too (an entry
    # lives while its list is not empty); holder-less entries are on the gone list, and their live
    # children are root-level. Depths beyond 20 bits of blocks or 12 of edges are kept in ``st_deep``.
    cdef int _get_dep(self, uint32_t x, uint32_t* b, uint32_t* e) except -1:
        cdef uint32_t d = self.ties[x].dep
        if d != DEEP:
            b[0] = d & DEP_BMAX
            e[0] = d >> DEP_BLOCKS
        else:
            pair = self.st_deep[x]
            b[0] = pair[0]
            e[0] = pair[1]
        return 0

    cdef int _set_dep(self, uint32_t x, uint32_t b, uint32_t e) except -1:
        if self.ties[x].dep == DEEP:
            self.st_deep.pop(x, None)
        if b < DEP_BMAX and e < DEP_EMAX:
            self.ties[x].dep = (e << DEP_BLOCKS) | b
        else:
            self.ties[x].dep = DEEP
            self.st_deep[x] = (b, e)
        return 0

    cdef int _leaf(self, uint32_t x, int64_t d) except -1:
        """Count (d=1) or uncount (d=-1) leaf ``x`` at its depths."""
        cdef uint32_t b, e
        self._get_dep(x, &b, &e)
        if _bump(&self.st_leaf_b, b, d) or _bump(&self.st_leaf_e, e, d):
            raise MemoryError()
        return 0

    cdef int _from_parent(self, uint32_t x, uint32_t* b, uint32_t* e) except -1:
        """The depths the rule gives block ``x`` from its parent's."""
        cdef int64_t p = self.blocks[x].parent
        if p < 0 or not self.blocks[p].n or self.blocks[x].flags & FLAG_CUT:
            b[0] = 1
            e[0] = 1
            return 0
        self._get_dep(<uint32_t>p, b, e)
        b[0] += 1
        if self.blocks[p].kids >= 2:
            e[0] += 1
        return 0

    cdef int _queue(self, uint32_t x) except -1:
        if _qpush(&self.st_stack, x):
            raise MemoryError()
        return 0

    cdef int _queue_kids(self, uint32_t p) except -1:
        """Queue the live children of ``p`` whose depths follow it (a cycle's cut does not)."""
        if _queue_kids_of(&self.st_stack, self.blocks, self.ties, p):
            raise MemoryError()
        return 0

    cdef int _st_settle(self, int64_t budget) except -1:
        """Recompute the queued blocks from their parents, and below those whose depths changed:
        about ``budget`` blocks (0: all). Returns 1 if some remain queued."""
        cdef Block* blocks = self.blocks
        cdef Tie* ties = self.ties
        cdef Vec* q = &self.st_stack
        cdef uint32_t x, b, e, ob, oe, d, od
        cdef int64_t p
        if budget <= 0:
            budget = -1
        while q.n and budget:
            budget -= 1
            q.n -= 1
            x = (<uint32_t*>q.data)[q.n]
            if not blocks[x].n:
                continue
            p = blocks[x].parent
            d = ties[p].dep if p >= 0 else 0
            od = ties[x].dep
            if p < 0 or not blocks[p].n or blocks[x].flags & FLAG_CUT:
                b = e = 1
            elif d != DEEP:
                b = (d & DEP_BMAX) + 1
                e = (d >> DEP_BLOCKS) + (1 if blocks[p].kids >= 2 else 0)
            else:
                self._from_parent(x, &b, &e)
            if od != DEEP and b < DEP_BMAX and e < DEP_EMAX:  # the packed common case, inline
                d = (e << DEP_BLOCKS) | b
                if d == od:
                    continue
                if not blocks[x].kids and (_bump(&self.st_leaf_b, od & DEP_BMAX, -1)
                                           or _bump(&self.st_leaf_e, od >> DEP_BLOCKS, -1)
                                           or _bump(&self.st_leaf_b, b, 1) or _bump(&self.st_leaf_e, e, 1)):
                    raise MemoryError()
                ties[x].dep = d
            else:
                self._get_dep(x, &ob, &oe)
                if b == ob and e == oe:
                    continue
                if not blocks[x].kids:
                    self._leaf(x, -1)
                    self._set_dep(x, b, e)
                    self._leaf(x, 1)
                else:
                    self._set_dep(x, b, e)
            if blocks[x].kids and _queue_kids_of(q, blocks, ties, x):
                raise MemoryError()
        if q.n:
            return 1
        if q.cap > (1 << 20):  # a large subtree's worth of queue: give it back
            _vec_free(q)
        return 0

    cdef int _st_rebuild(self) except -1:
        """Every depth and the leaf histograms from the root-level blocks down (after a clear)."""
        cdef uint32_t x, i, b, e
        self.st_leaf_e.n = 0
        self.st_leaf_b.n = 0
        self.st_stack.n = 0
        self.st_deep.clear()
        x = self.root_head
        while x != NONE:
            if self.blocks[x].n:
                self._queue(x)
            x = self.blocks[x].next
        for i in range(self.st_gone.n):
            self._queue_kids((<uint32_t*>self.st_gone.data)[i])
        for m in self.st_cuts:
            self._queue(<uint32_t>m)
        while self.st_stack.n:  # parents before children: each block's parent is settled
            self.st_stack.n -= 1
            x = (<uint32_t*>self.st_stack.data)[self.st_stack.n]
            self._from_parent(x, &b, &e)
            self._set_dep(x, b, e)
            if self.blocks[x].kids == 0:
                self._leaf(x, 1)
            else:
                self._queue_kids(x)
        return 0

    def _rebuild_depths(self):
        """Recompute every depth from the roots: what one walk of the whole tree costs (the bench's baseline)."""
        self._st_rebuild()

    cdef inline int _settled(self) except -1:
        """Settle every queued depth (before depths are read)."""
        if self.st_stack.n:
            self._st_settle(0)
        return 0

    cdef int _gone_add(self, uint32_t b) except -1:
        self.ties[b].dep = <uint32_t>self.st_gone.n
        if _push(&self.st_gone, &b):
            raise MemoryError()
        self.blocks[b].flags |= FLAG_GONE
        return 0

    cdef void _gone_drop(self, uint32_t b) noexcept:
        cdef uint32_t* g = <uint32_t*>self.st_gone.data
        cdef uint32_t i = self.ties[b].dep
        cdef uint32_t last = g[self.st_gone.n - 1]
        g[i] = last
        self.ties[last].dep = i
        self.st_gone.n -= 1
        self.blocks[b].flags &= ~FLAG_GONE

    cdef int _st_kid(self, int64_t p, int d) except -1:
        """Entry ``p`` gained (d=1) or lost (d=-1) a live child: fan-outs and the branching set."""
        cdef uint32_t before = self.blocks[p].kids
        cdef uint32_t after = before + d
        self.blocks[p].kids = after
        if self.blocks[p].n:  # fan-outs count branching blocks in the tree only
            if before >= 2:
                (<int64_t*>self.st_fan.data)[before] -= 1
                self.st_fansum -= before
            if after >= 2:
                if _tally(&self.st_fan, after, 1):
                    raise MemoryError()
                self.st_fansum += after
        if after == 2 and before == 1:  # branching, in the tree or not (as the reference counts it)
            self.st_branch.add(p)
        elif before == 2 and after == 1:
            self.st_branch.discard(p)
        return 0

    cdef int _st_holders_up(self, uint32_t n) except -1:
        """A block's holders went from n - 1 to n."""
        if n > 1:
            (<int64_t*>self.st_reps.data)[n - 1] -= 1
        if _tally(&self.st_reps, n, 1):
            raise MemoryError()
        return 0

    cdef void _st_holders_down(self, uint32_t n) noexcept:
        """A block's holders went from n + 1 to n (0: it is leaving the tree)."""
        (<int64_t*>self.st_reps.data)[n + 1] -= 1
        if n:
            (<int64_t*>self.st_reps.data)[n] += 1

    cdef int64_t _st_cycle_closed(self, uint32_t b) except -2:
        """``b`` entered with live children under a parent in the tree: if that closed a parent
        cycle, cut it above its smallest hash and return that entry; else -1."""
        cdef int64_t y = self.blocks[b].parent, m
        cdef uint64_t steps = 0
        while y >= 0 and <uint32_t>y != b and self.blocks[y].n:
            if self.blocks[y].flags & FLAG_CUT or steps > self.nblocks:
                return -1  # up into another cycle: b is not on it
            y = self.blocks[y].parent
            steps += 1
        if y < 0 or <uint32_t>y != b:
            return -1
        m = b
        y = self.blocks[b].parent
        while <uint32_t>y != b:
            if self.blocks[y].hash < self.blocks[m].hash:
                m = y
            y = self.blocks[y].parent
        self.blocks[m].flags |= FLAG_CUT
        self.st_cuts.add(m)
        return m

    cdef int _st_uncut(self, uint32_t b) except -1:
        """``b`` is leaving: if it was on a parent cycle, lift the cycle's cut."""
        cdef int64_t y, m = -1
        cdef uint64_t steps = 0
        if self.blocks[b].flags & FLAG_CUT:
            self.blocks[b].flags &= ~FLAG_CUT
            self.st_cuts.discard(b)
            return 0
        if not self.blocks[b].kids:
            return 0
        y = self.blocks[b].parent
        while y >= 0 and <uint32_t>y != b and self.blocks[y].n and steps <= self.nblocks:
            if self.blocks[y].flags & FLAG_CUT:
                if m >= 0:
                    return 0  # around another cycle: b is not on it
                m = y
            y = self.blocks[y].parent
            steps += 1
        if y < 0 or <uint32_t>y != b or m < 0:
            return 0
        self.blocks[m].flags &= ~FLAG_CUT
        self.st_cuts.discard(m)
        if not self.st_bulk:
            self._queue(<uint32_t>m)
        return 0

    cdef int _st_enter(self, uint32_t b) except -1:
        """Block ``b`` came into the tree, its parent set and linked: the parent gained a live
        child, b's own live children (kept while it was out) stop hanging off the root, depths."""
        cdef Block* blocks = self.blocks
        cdef int64_t p = blocks[b].parent, m = -1
        cdef uint32_t k = blocks[b].kids, k0 = 0, db, de, pb = 0, pe = 0, d
        cdef bint plive = p >= 0 and blocks[p].n > 0
        if blocks[b].flags & FLAG_GONE:
            self._gone_drop(b)
        if p >= 0:
            k0 = blocks[p].kids
            if k0 == 0 or (k0 >= 2 and not blocks[p].n):
                blocks[p].kids = k0 + 1  # no fan-out or branching change
            elif k0 >= 2:  # a branching block in the tree: one more child
                blocks[p].kids = k0 + 1
                (<int64_t*>self.st_fan.data)[k0] -= 1
                self.st_fansum += 1
                if _bump(&self.st_fan, k0 + 1, 1):
                    raise MemoryError()
            else:
                self._st_kid(p, 1)
        if not plive:
            self.st_root += 1
        if k:
            self.st_root -= k
            if k >= 2:
                if _tally(&self.st_fan, k, 1):
                    raise MemoryError()
                self.st_fansum += k
            if plive:
                m = self._st_cycle_closed(b)
        if self.st_bulk:
            return 0
        if plive and not blocks[b].flags & FLAG_CUT:
            d = self.ties[p].dep
            if d != DEEP:
                pb, pe = d & DEP_BMAX, d >> DEP_BLOCKS
            else:
                self._get_dep(<uint32_t>p, &pb, &pe)
            db, de = pb + 1, pe + (1 if k0 >= 1 else 0)  # the parent has k0 + 1 live children now
        else:
            db = de = 1
        if db < DEP_BMAX and de < DEP_EMAX and self.ties[b].dep != DEEP:
            self.ties[b].dep = (de << DEP_BLOCKS) | db
        else:
            self._set_dep(b, db, de)
        if k == 0 and plive and k0 == 0:  # a run grows by a leaf: its leaf moves one block down
            if _bump(&self.st_leaf_b, pb, -1) or _bump(&self.st_leaf_b, db, 1):
                raise MemoryError()
        else:
            if k == 0 and (_bump(&self.st_leaf_b, db, 1) or _bump(&self.st_leaf_e, de, 1)):
                raise MemoryError()
            if plive and k0 == 0:
                self._leaf(<uint32_t>p, -1)  # the parent stops being a leaf
        if plive and k0 == 1:
            self._queue_kids(<uint32_t>p)  # a split: the parent's first child starts a run now
        if k:
            self._queue_kids(b)  # its orphans hang under it again
        if m >= 0 and m != b:
            self._queue(<uint32_t>m)
        return 0

    cdef int _st_leave(self, uint32_t b) except -1:
        """Block ``b`` left the tree (before its entry is released): the reverse of ``_st_enter``."""
        cdef Block* blocks = self.blocks
        cdef int64_t p = blocks[b].parent
        cdef uint32_t k = blocks[b].kids, k1 = 0, bd, pd
        cdef bint plive = p >= 0 and blocks[p].n > 0
        cdef bint moved = False
        if not self.st_bulk and k == 0:
            bd = self.ties[b].dep
            pd = self.ties[p].dep if plive else DEEP
            if plive and blocks[p].kids == 1 and bd != DEEP and pd != DEEP and (bd >> DEP_BLOCKS) == (pd >> DEP_BLOCKS):
                # the run's leaf moves one block up (the parent becomes the leaf, same edges)
                if _bump(&self.st_leaf_b, bd & DEP_BMAX, -1) or _bump(&self.st_leaf_b, pd & DEP_BMAX, 1):
                    raise MemoryError()
                moved = True
            elif bd != DEEP:
                (<int64_t*>self.st_leaf_b.data)[bd & DEP_BMAX] -= 1
                (<int64_t*>self.st_leaf_e.data)[bd >> DEP_BLOCKS] -= 1
            else:
                self._leaf(b, -1)
        if p >= 0:
            k1 = blocks[p].kids - 1
            if k1 == 0 or (k1 >= 2 and not blocks[p].n):
                blocks[p].kids = k1  # no fan-out or branching change
            elif k1 >= 2:  # a branching block in the tree: one child less
                blocks[p].kids = k1
                (<int64_t*>self.st_fan.data)[k1 + 1] -= 1
                (<int64_t*>self.st_fan.data)[k1] += 1
                self.st_fansum -= 1
            else:
                self._st_kid(p, -1)
        if not plive:
            self.st_root -= 1
        if k:
            self.st_root += k
            if k >= 2:
                (<int64_t*>self.st_fan.data)[k] -= 1
                self.st_fansum -= k
        if self.st_cuts:
            self._st_uncut(b)
        if not self.st_bulk:
            if plive:
                if k1 == 0 and not moved:
                    self._leaf(<uint32_t>p, 1)  # the parent becomes a leaf
                elif k1 == 1:
                    self._queue_kids(<uint32_t>p)  # a merge: the remaining child joins the parent's run
            if k:
                self._queue_kids(b)  # its children's subtrees become root-level runs
        if self.ties[b].dep == DEEP:
            self.st_deep.pop(b, None)
        if self.ties[b].first != NONE:  # named by other entries: it stays, holder-less
            self._gone_add(b)
        return 0

    cdef object _stats_counters(self):
        """The statistics kept at apply time, exact at this version."""
        return dict(nodes=self.st_root + self.st_fansum, blocks=self.live, root_fanout=self.st_root,
                    fanouts=_counter_of(&self.st_fan, 2), replicas=_counter_of(&self.st_reps, 1),
                    leaf_depths=_counter_of(&self.st_leaf_e, 0), leaf_block_depths=_counter_of(&self.st_leaf_b, 0))

    def stats_pass(self):
        """Start a statistics reading (``StatsReading``): ``step`` it under the caller's lock (one
        step completes it), then ``to_stats``."""
        cdef StatsReading r = StatsReading.__new__(StatsReading)
        r.index = self
        return r

    def _stats_read(self, StatsReading r, Py_ssize_t max_blocks):
        """One step of a reading: settle up to ``max_blocks`` queued depths (0: ``SETTLE_SLICE``;
        all of them after ``SETTLE_STEPS`` steps); once none is queued, copy the statistics.
        True when the reading is complete."""
        cdef Py_ssize_t i = 0
        if r.index is not self:
            raise RuntimeError("a statistics reading reads the index that started it")
        r.steps += 1
        if self.st_stack.n and self._st_settle(0 if r.steps >= SETTLE_STEPS else
                                               (max_blocks if max_blocks > 0 else SETTLE_SLICE)):
            return False
        free(r.branching)
        r.branching = <uint64_t*>malloc(len(self.st_branch) * sizeof(uint64_t) + 8)
        if not r.branching:
            raise MemoryError()
        for x in self.st_branch:
            r.branching[i] = self.blocks[<uint32_t>x].hash
            i += 1
        r.nbranching = i
        r.version, r.counters, r.done = self.version, self._stats_counters(), True
        return True

    # The tree's top, read from the live index through the child lists (``ChildrenView``, ``RunsView``).
    cdef int64_t _only_child(self, uint32_t x) noexcept:
        """The live child of ``x`` (which has one)."""
        cdef uint32_t c = self.ties[x].first
        while c != NONE and not self.blocks[c].n:
            c = self.blocks[c].next
        return c if c != NONE else -1

    cdef bint _has_end(self, uint32_t x) noexcept:
        """Whether the run starting at ``x`` ends at a leaf or a branching block (only a run inside
        a parent cycle, down to the cycle's cut, has none)."""
        cdef int64_t c
        cdef uint64_t steps = 0
        if not self.st_cuts:
            return True
        while self.blocks[x].kids == 1 and steps <= self.nblocks:
            c = self._only_child(x)
            if c < 0 or self.blocks[c].flags & FLAG_CUT:
                return False
            x = <uint32_t>c
            steps += 1
        return True

    cdef list _root_level(self):
        """The root-level blocks: the root's children in the tree, the orphans of holder-less
        entries, and the cuts of parent cycles whose runs end."""
        cdef uint32_t x = self.root_head, i
        out = []
        while x != NONE:
            if self.blocks[x].n:
                out.append(self.blocks[x].hash)
            x = self.blocks[x].next
        for i in range(self.st_gone.n):
            x = self.ties[(<uint32_t*>self.st_gone.data)[i]].first
            while x != NONE:
                if self.blocks[x].n:
                    out.append(self.blocks[x].hash)
                x = self.blocks[x].next
        for m in self.st_cuts:
            if self._has_end(<uint32_t>m):
                out.append(self.blocks[<uint32_t>m].hash)
        return out

    def _kept_children(self, key, int keep):
        """The first blocks of the kept child runs of ROOT or of a branching block within ``keep``
        edges (None: not a kept key)."""
        cdef int64_t x
        cdef uint32_t c, b, e
        if keep < 1:
            return None
        self._settled()
        if key == ROOT:
            return self._root_level() or None
        x = self._find(_u64(key))
        if x < 0 or not self.blocks[x].n or self.blocks[x].kids < 2:
            return None
        self._get_dep(<uint32_t>x, &b, &e)
        if e >= <uint32_t>keep:
            return None
        out = []
        c = self.ties[x].first
        while c != NONE:
            if self.blocks[c].n and not self.blocks[c].flags & FLAG_CUT and self._has_end(c):
                out.append(self.blocks[c].hash)
            c = self.blocks[c].next
        return out or None

    def _kept_keys(self, int keep):
        """ROOT (if the root has a kept child run), then the branching blocks in the tree within
        ``keep`` - 1 edges, sorted."""
        cdef uint32_t b, e
        cdef bint root = self.st_root > 0
        if keep < 1:
            return []
        self._settled()
        for m in self.st_cuts:
            root = root or self._has_end(<uint32_t>m)
        unders = []
        for x in self.st_branch:
            if self.blocks[<uint32_t>x].n:
                self._get_dep(<uint32_t>x, &b, &e)
                if e < <uint32_t>keep:
                    unders.append(self.blocks[<uint32_t>x].hash)
        unders.sort()
        return [ROOT, *unders] if root else unders

    def _kept_run(self, first, int keep):
        """The blocks of the kept run starting at ``first`` if it has two or more, else None."""
        cdef int64_t x = self._find(_u64(first)), p, c
        cdef uint32_t b, e, n = 0, j
        cdef carray.array out
        if keep < 1 or x < 0 or not self.blocks[x].n or self.blocks[x].kids != 1:
            return None
        self._settled()
        p = self.blocks[x].parent
        if p >= 0 and self.blocks[p].n and not self.blocks[x].flags & FLAG_CUT:
            if self.blocks[p].kids < 2:
                return None  # inside a run, not its first block
            self._get_dep(<uint32_t>p, &b, &e)
            if e >= <uint32_t>keep:
                return None
        if not self._has_end(<uint32_t>x):
            return None
        c = x
        while True:
            n += 1
            if self.blocks[c].kids != 1:
                break
            c = self._only_child(<uint32_t>c)
        out = carray.clone(_RUN, n, zero=False)
        c = x
        for j in range(n):
            out.data.as_ulonglongs[j] = self.blocks[c].hash
            if j + 1 < n:
                c = self._only_child(<uint32_t>c)
        return out

    def _kept_run_firsts(self, int keep):
        """The first blocks of the kept runs of two or more blocks, sorted."""
        cdef int64_t x
        out = []
        for key in self._kept_keys(keep):
            for h in self._kept_children(key, keep) or ():
                x = self._find(h)
                if self.blocks[x].kids == 1:
                    out.append(h)
        out.sort()
        return out

    def stats(self, keep_children_depth=0):
        """The statistics of the current tree, synchronously (tests and offline tools)."""
        return self.stats_pass().to_stats(keep_children_depth)
