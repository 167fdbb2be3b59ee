# ---- the prefix index's readings and small containers ---------------------------------------------
# Part of ``_prefix_core.pyx``, which ``include``s it: one extension module, its names the module's
# (the DEFs, structs and types it uses are declared in the files included before it).
#
# What ``CompiledPrefixIndex`` (``_index.pxi``) hands out — a match (``CompiledMatch``), the views and
# sets of a statistics reading (``RunsView``, ``ChildrenView``, ``BranchSet``, ``StatsReading``) — and the
# small C containers it is built from: growable arrays (``Vec``) and the child-list links.


cdef class CompiledMatch:
    """Longest cached prefix of a chain (see ``prefix_index_ref.Match``); ``per_worker`` is built
    on first use, so a caller that needs only ``blocks`` or one worker's depth pays no dict. A C
    type: made and asked once a record, its fields are read without attribute lookups."""

    cdef readonly object blocks
    cdef list _names
    cdef dict _wid
    cdef carray.array _pairs
    cdef object _dict

    def __init__(self, blocks, names, wid, pairs):
        self.blocks = blocks
        self._names = names
        self._wid = wid  # worker -> id (the index's table)
        # array('I'): groups of [depth, count, sorted worker ids...] by rising depth; each group's
        # workers are a subset of the one before (the survivors), so a worker's depth is that of
        # the last group naming it.
        self._pairs = pairs
        self._dict = None

    def depth_on(self, worker):
        """Leading blocks of the chain the worker holds: binary searches in the groups, no dict."""
        wid = self._wid.get(worker)
        return 0 if wid is None else _depth_of(self._pairs, <uint32_t>wid)

    def best_depth(self, excluding=()):
        """The longest match on any worker not in ``excluding``: the deepest group with a member
        that is not excluded (``blocks`` when nothing is)."""
        if not excluding:
            return self.blocks
        wid = self._wid
        if len(excluding) == 1:  # the record path's question (every worker but the serving one): no array
            for w in excluding:
                x = wid.get(w)
                return self.blocks if x is None else _best_excluding_one(self._pairs, <uint32_t>x)
        ids = sorted(wid[w] for w in excluding if w in wid)
        if not ids:
            return self.blocks
        return _best_excluding(self._pairs, array("I", ids))

    def best_depth_besides(self, worker, excluded=frozenset()):
        """``best_depth`` excluding ``worker`` and the workers in ``excluded``: the deepest group
        with a member that is neither. A frozenset ``excluded`` has its worker ids looked up once
        while it stays the caller's set (the pool hands out the same set between changes), so a
        record pays nothing per excluded worker."""
        cdef uint32_t own
        wid = self._wid
        x = wid.get(worker)
        own = 0xFFFFFFFF if x is None else <uint32_t>x
        if not excluded:
            return self.blocks if x is None else _best_excluding_one(self._pairs, own)
        return _best_besides(self._pairs, own, _excluded_ids(excluded, wid))

    @property
    def per_worker(self):
        if self._dict is None:
            names, pairs = self._names, self._pairs
            out, i = {}, 0
            while i < len(pairs):  # a later (deeper) group overrides: its workers went further
                depth, count = pairs[i], pairs[i + 1]
                for w in pairs[i + 2:i + 2 + count]:
                    out[names[w]] = depth
                i += 2 + count
            self._dict = out
        return self._dict

    @property
    def best_workers(self):
        return sorted(w for w, n in self.per_worker.items() if n == self.blocks and n > 0)

    def __repr__(self):
        return f"Match(blocks={self.blocks}, per_worker={self.per_worker})"


cdef inline bint _in_sorted(const uint32_t* g, uint32_t count, uint32_t w) noexcept nogil:
    cdef uint32_t lo = 0, hi = count, mid
    while lo < hi:
        mid = (lo + hi) >> 1
        if g[mid] < w:
            lo = mid + 1
        else:
            hi = mid
    return lo < count and g[lo] == w


cdef uint32_t _depth_of(carray.array pairs, uint32_t w) noexcept:
    cdef const uint32_t* g = pairs.data.as_uints
    cdef Py_ssize_t i = 0, n = len(pairs)
    cdef uint32_t depth = 0
    while i < n:
        if not _in_sorted(g + i + 2, g[i + 1], w):
            break
        depth = g[i]
        i += 2 + g[i + 1]
    return depth


cdef uint32_t _best_excluding(carray.array pairs, carray.array excluded) noexcept:
    cdef const uint32_t* g = pairs.data.as_uints
    cdef const uint32_t* x = excluded.data.as_uints
    cdef Py_ssize_t i = 0, n = len(pairs), k, nx = len(excluded)
    cdef uint32_t depth = 0, out
    while i < n:
        out = 0
        for k in range(nx):
            out += _in_sorted(g + i + 2, g[i + 1], x[k])
        if out == g[i + 1]:  # every worker this deep is excluded, and so are the deeper groups' workers
            break
        depth = g[i]
        i += 2 + g[i + 1]
    return depth


cdef object _ex_set = None  # the last frozenset ``best_depth_besides`` was given, and its sorted ids
cdef object _ex_wid = None
cdef Py_ssize_t _ex_n = -1
cdef object _ex_ids = None


cdef object _excluded_ids(object excluded, dict wid):
    """The sorted ids of the known workers in ``excluded``; kept for a frozenset while it is the one
    asked about and the index has the same workers (ids are never reused)."""
    global _ex_set, _ex_wid, _ex_n, _ex_ids
    if excluded is _ex_set and wid is _ex_wid and len(wid) == _ex_n:
        return _ex_ids
    ids = array("I", sorted(wid[w] for w in excluded if w in wid))
    if type(excluded) is frozenset:
        _ex_set, _ex_wid, _ex_n, _ex_ids = excluded, wid, len(wid), ids
    return ids


cdef uint32_t _best_besides(carray.array pairs, uint32_t own, carray.array excluded) noexcept:
    """The depth of the deepest group with a member that is neither ``own`` nor in ``excluded``
    (sorted): each group is read until its first such member, so a few excluded workers in a
    group cost a few binary searches."""
    cdef const uint32_t* g = pairs.data.as_uints
    cdef const uint32_t* x = excluded.data.as_uints
    cdef Py_ssize_t i = 0, n = len(pairs), k
    cdef uint32_t depth = 0, count, m, nx = <uint32_t>len(excluded)
    cdef bint found
    while i < n:
        count = g[i + 1]
        found = False
        for k in range(count):
            m = g[i + 2 + k]
            if m != own and not _in_sorted(x, nx, m):
                found = True
                break
        if not found:  # every worker this deep is excluded, and so are the deeper groups' workers
            break
        depth = g[i]
        i += 2 + count
    return depth


cdef uint32_t _best_excluding_one(carray.array pairs, uint32_t w) noexcept:
    """``_best_excluding`` for one excluded worker: a group is all excluded when it is that worker alone."""
    cdef const uint32_t* g = pairs.data.as_uints
    cdef Py_ssize_t i = 0, n = len(pairs)
    cdef uint32_t depth = 0
    while i < n:
        if g[i + 1] == 1 and g[i + 2] == w:
            break
        depth = g[i]
        i += 2 + g[i + 1]
    return depth


class RunsView(Mapping):
    """The kept runs of a reading as ``first block -> array('Q') of the run`` (runs of two blocks
    or more within ``keep`` edges of the root). Nothing per run is held: keys and runs are read
    from the live index through its child lists when asked for (O(the kept top) to iterate, a
    run's length to read one), so read it under the lock that guards the index. A run the tree
    no longer holds as a kept run reads as missing (``TreeStats.run`` gives its first block)."""

    def __init__(self, index, keep):
        self._ix, self._keep = index, keep

    def __getitem__(self, first):
        if type(first) is not int or first < 0 or first > 0xFFFFFFFFFFFFFFFF:
            raise KeyError(first)
        run = self._ix._kept_run(first, self._keep)
        if run is None:
            raise KeyError(first)
        return run

    def __contains__(self, first):
        if type(first) is not int or first < 0 or first > 0xFFFFFFFFFFFFFFFF:
            return False
        return self._ix._kept_run(first, self._keep) is not None

    def __iter__(self):
        return iter(self._ix._kept_run_firsts(self._keep))

    def __len__(self):
        return len(self._ix._kept_run_firsts(self._keep))


class ChildrenView(Mapping):
    """The kept child lists of a reading as ``ROOT or a branching block -> first blocks of its
    child runs`` (within ``keep`` edges of the root), read from the live index through its child
    lists when asked for (a list is built per key read): read it under the lock that guards the
    index."""

    def __init__(self, index, keep):
        self._ix, self._keep = index, keep

    def __getitem__(self, key):
        if type(key) is not int or key < ROOT or key > 0xFFFFFFFFFFFFFFFF:
            raise KeyError(key)
        out = self._ix._kept_children(key, self._keep)
        if out is None:
            raise KeyError(key)
        return out

    def __contains__(self, key):
        if type(key) is not int or key < ROOT or key > 0xFFFFFFFFFFFFFFFF:
            return False
        return self._ix._kept_children(key, self._keep) is not None

    def __iter__(self):
        return iter(self._ix._kept_keys(self._keep))

    def __len__(self):
        return len(self._ix._kept_keys(self._keep))


cdef struct Vec:  # a growable C array
    char* data
    size_t n
    size_t cap
    size_t item


cdef int _reserve(Vec* v, size_t more) noexcept nogil:
    cdef size_t cap
    cdef char* p
    if v.n + more <= v.cap:
        return 0
    cap = v.cap * 2 + 64
    if cap < v.n + more:
        cap = v.n + more
    p = <char*>realloc(v.data, cap * v.item)
    if p == NULL:
        return -1
    v.data, v.cap = p, cap
    return 0


cdef inline int _push(Vec* v, const void* x) noexcept nogil:
    if _reserve(v, 1):
        return -1
    memcpy(v.data + v.n * v.item, x, v.item)
    v.n += 1
    return 0


cdef int _tally(Vec* v, size_t i, int64_t d) noexcept nogil:
    """Add ``d`` to the i-th int64 counter of ``v``, growing it with zeros as needed."""
    if i >= v.n:
        if _reserve(v, i + 1 - v.n):
            return -1
        memset(v.data + v.n * v.item, 0, (i + 1 - v.n) * v.item)
        v.n = i + 1
    (<int64_t*>v.data)[i] += d
    return 0


cdef void _vec_init(Vec* v, size_t item) noexcept nogil:
    v.data, v.n, v.cap, v.item = NULL, 0, 0, item


cdef void _vec_free(Vec* v) noexcept nogil:
    free(v.data)
    v.data, v.n, v.cap = NULL, 0, 0


cdef object _counter_of(Vec* v, size_t start):
    """The nonzero int64 counters of ``v`` from ``start`` on, as value -> count."""
    cdef size_t i
    cdef int64_t* c = <int64_t*>v.data
    out = Counter()
    for i in range(start, v.n):
        if c[i]:
            out[i] = c[i]
    return out


cdef inline int _bump(Vec* v, size_t i, int64_t d) noexcept nogil:
    """``_tally`` with its common case (the counter exists) inline."""
    if i < v.n:
        (<int64_t*>v.data)[i] += d
        return 0
    return _tally(v, i, d)


cdef inline int _qpush(Vec* v, uint32_t x) noexcept nogil:
    if v.n < v.cap:
        (<uint32_t*>v.data)[v.n] = x
        v.n += 1
        return 0
    return _push(v, &x)


cdef inline int _queue_kids_of(Vec* q, const Block* blocks, const Tie* ties, uint32_t p) noexcept nogil:
    """Queue the live children of ``p`` whose depths follow it (a cycle's cut does not); -1: no memory."""
    cdef uint32_t c = ties[p].first
    while c != NONE:
        if blocks[c].n and not blocks[c].flags & FLAG_CUT:
            if _qpush(q, c):
                return -1
        c = blocks[c].next
    return 0


cdef inline uint32_t* _list_head(Tie* ties, uint32_t* root_head, int64_t p) noexcept nogil:
    """Where the first entry of ``p``'s child list is kept (-1: the root's)."""
    return &ties[p].first if p >= 0 else root_head


cdef inline void _link_to(Block* blocks, Tie* ties, uint32_t* root_head, uint32_t x, int64_t p) noexcept nogil:
    """Put entry ``x`` first in the child list of ``p`` (-1: the root's)."""
    cdef uint32_t* head = _list_head(ties, root_head, p)
    blocks[x].next = head[0]
    ties[x].prev = NONE
    if head[0] != NONE:
        ties[head[0]].prev = x
    head[0] = x


cdef inline void _unlist_from(Block* blocks, Tie* ties, uint32_t* root_head, uint32_t x) noexcept nogil:
    """Take entry ``x`` out of its parent's child list."""
    cdef uint32_t pv = ties[x].prev, nx = blocks[x].next
    if pv != NONE:
        blocks[pv].next = nx
    else:
        _list_head(ties, root_head, blocks[x].parent)[0] = nx
    if nx != NONE:
        ties[nx].prev = pv


cdef int _cmp_u32(const void* a, const void* b) noexcept nogil:
    cdef uint32_t x = (<const uint32_t*>a)[0], y = (<const uint32_t*>b)[0]
    return (x > y) - (x < y)


cdef int _cmp_u64(const void* a, const void* b) noexcept nogil:
    cdef uint64_t x = (<const uint64_t*>a)[0], y = (<const uint64_t*>b)[0]
    return (x > y) - (x < y)


cdef class BranchSet:
    """The branching blocks of a reading: a sorted C array of hashes (8 bytes each, no Python int
    per block), a read-only set for ``in`` (a binary search), iteration and comparison."""

    cdef uint64_t* data
    cdef Py_ssize_t n

    def __dealloc__(self):
        free(self.data)

    def __contains__(self, block):
        if type(block) is not int or block < 0 or block > 0xFFFFFFFFFFFFFFFF:
            return False
        cdef uint64_t v = block
        cdef Py_ssize_t lo = 0, hi = self.n, mid
        while lo < hi:
            mid = (lo + hi) >> 1
            if self.data[mid] < v:
                lo = mid + 1
            else:
                hi = mid
        return lo < self.n and self.data[lo] == v

    def __len__(self):
        return self.n

    def __iter__(self):
        cdef Py_ssize_t i
        return iter([self.data[i] for i in range(self.n)])

    def __eq__(self, other):
        if not isinstance(other, Set):
            return NotImplemented
        return len(self) == len(other) and all(h in other for h in self)

    def __ne__(self, other):
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    __hash__ = None

    def __repr__(self):
        return f"BranchSet({sorted(self)!r})"


Set.register(BranchSet)


cdef class StatsReading:
    """One statistics reading of a compiled index: ``step`` under the caller's lock until it
    returns True, then ``to_stats`` (outside the lock).

    Everything is kept at apply time (see the statistics section of ``CompiledPrefixIndex``): the
    steps first settle the depth shifts ``apply`` left queued (a bounded number of blocks per
    step; usually none or a few), then one step copies the counters, the two leaf-depth
    histograms and the branching set's hashes — O(histogram + branching set), no walk of the
    tree — exact at that version. The tree's top (``children``, ``runs``) is not copied: the
    result's views read it from the live index through its child lists when asked for, under
    the lock that guards the index.
    """

    cdef object index          # the CompiledPrefixIndex read
    cdef uint64_t* branching   # hashes of the entries with two or more live children (sorted in ``to_stats``)
    cdef Py_ssize_t nbranching
    cdef int steps
    cdef readonly bint done
    cdef public long version
    cdef object counters       # the apply-time counters and histograms

    def __cinit__(self):
        self.version = -1

    def __dealloc__(self):
        free(self.branching)

    def step(self, max_blocks=0):
        """Settle the depths ``apply`` left queued (about ``max_blocks``, 0: a few ms' worth), then
        read the kept statistics; call it under the lock that guards the index's changes until it
        returns True (one step unless many depths wait)."""
        if self.done:
            return True
        return self.index._stats_read(self, max_blocks)

    def to_stats(self, keep_children_depth=0):
        """The statistics with views of the runs and child lists of the top ``keep_children_depth``
        edges (the views read the live index)."""
        if keep_children_depth > MAX_KEEP:
            raise ValueError(f"the compiled index keeps at most {MAX_KEEP} edges of the tree's top")
        while not self.step():
            pass
        cdef BranchSet branching = BranchSet.__new__(BranchSet)
        branching.data, branching.n = self.branching, self.nbranching
        self.branching, self.nbranching = NULL, 0
        with nogil:
            qsort(branching.data, branching.n, sizeof(uint64_t), _cmp_u64)
        self.branching = <uint64_t*>malloc(branching.n * sizeof(uint64_t) + 8)  # for a second ``to_stats``
        if not self.branching:
            raise MemoryError()
        memcpy(self.branching, branching.data, branching.n * sizeof(uint64_t))
        self.nbranching = branching.n
        return TreeStats(version=self.version, branching=branching,
                         children=ChildrenView(self.index, keep_children_depth),
                         children_depth=keep_children_depth,
                         runs=RunsView(self.index, keep_children_depth), **self.counters)
