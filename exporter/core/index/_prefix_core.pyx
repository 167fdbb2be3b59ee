# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The compiled prefix index: the semantics of ``exporter.core.index.prefix_index_ref`` in flat C arrays.

Layout (about 44 bytes per block, whatever the number of workers):

* ``blocks``: one 32-byte ``Block`` per block hash — the hash, the parent as an array index,
  its live children, the next entry of its parent's child list, and its holders: sorted
  ``wid << 8 | tiers`` entries (worker id, one bit per cache medium), two inline, more in a
  malloc'd array.
* ``ties``: 12 bytes per entry beside it — the first entry of its child list, the previous one
  in its parent's list, and its depths (see the statistics section of ``CompiledPrefixIndex``).
* ``slots``: an open-addressing (linear probing, backward-shift deletion) table of u32 block
  indexes keyed by the mixed 64-bit hash, at most 3/4 full.

A block leaves the tree when its last holder goes; its entry stays, holder-less, while other
entries still name it as parent (its child list is not empty), so a child keeps its parent link
exactly as the reference's block -> parent-hash map does (and re-attaches when the parent is
stored again).

Every tree statistic is kept at apply time — holders -> blocks, children -> branching blocks,
root-level blocks, the branching set, and each block's depth in blocks and in radix edges with
the two leaf-depth histograms — so a reading is O(histogram + branching set), with no walk of
the tree; the top of the tree is read from the live index through the child lists.
"""

from collections import Counter
from collections.abc import Mapping, Set
from array import array
from bisect import bisect_left, bisect_right

from cpython.long cimport PyLong_AsUnsignedLongLongMask
from cpython.exc cimport PyErr_Occurred
from cpython.tuple cimport PyTuple_GET_SIZE, PyTuple_GET_ITEM, PyTuple_New, PyTuple_SET_ITEM
from cpython.ref cimport Py_INCREF
from libc.stdint cimport uint64_t, uint32_t, int32_t, uint16_t, int64_t, uint8_t, int8_t
from libc.stdlib cimport malloc, calloc, realloc, free, qsort
from libc.string cimport memmove, memset, memcpy, memcmp
from cpython cimport array as carray
from cpython.object cimport PyObject_GenericSetAttr, PyTypeObject
from cpython.ref cimport PyObject
from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE

from exporter.core.index.eviction import DEFAULT_MEMORY as DEFAULT_EVICTION_MEMORY, DEFAULT_SAMPLE_EVERY, BatchEvictions
from exporter.model import AllBlocksCleared, BlockRemoved, BlockStored
from exporter.core.index.prefix_index_ref import DEFAULT_MEDIUM, MAX_MEDIA, ROOT, ApplyResult, ChainTails, TreeStats

cdef carray.array _RUN = array("Q")
cdef carray.array _LENGTHS = array("I")
cdef carray.array _GROUPS = array("I")

DEF NMEDIA = 8  # a worker's tiers are 8 bits of its holder entry
cdef extern from *:
    """
    #define PFX_EMPTY_SLOT ((uint32_t)0xFFFFFFFFu)
    """
    # An empty hash-table slot: a C constant (a DEF this large would be a Python int, and every
    # probe's comparison a Python call).
    const uint32_t EMPTY "PFX_EMPTY_SLOT"
    const uint32_t NONE "PFX_EMPTY_SLOT"  # no entry (child and sibling links)
    const uint32_t DEEP "PFX_EMPTY_SLOT"  # a packed depth too large for 32 bits: kept in ``st_deep``
DEF FLAG_FREE = 1
DEF FLAG_HIT = 2
DEF FLAG_NEW = 4     # made by ``_find_or_add``, in no child list yet
DEF FLAG_GONE = 8    # holder-less, on the gone list (its ``dep`` is its place there)
DEF FLAG_CUT = 16    # the smallest hash of a parent cycle: its depths start at the root
DEF INLINE = 2
DEF MAX_WORKERS = 65535
DEF MAX_KEEP = 16  # radix edges of the tree's top a reading serves (the API's deepest request)
DEF DEP_BLOCKS = 20  # a packed depth: blocks in the low 20 bits, radix edges above them
DEF DEP_BMAX = 0xFFFFF
DEF DEP_EMAX = 0xFFF
DEF SETTLE_AT = 1 << 18  # queued blocks an ``apply`` lets wait for the next reading (1 MB of queue)
DEF SETTLE_SLICE = 1 << 18  # blocks one reading step settles at most: a few ms of lock
DEF SETTLE_STEPS = 64  # reading steps after which the rest is settled in one

assert MAX_MEDIA == NMEDIA, "the reference and the compiled index must allow the same media"


cdef union Holders:
    uint32_t inl[2]
    uint32_t* ext

cdef struct Block:
    uint64_t hash
    int32_t parent   # block index; -1: a root-level block
    uint32_t kids    # live children (entries in the tree naming it as parent)
    uint16_t n       # holder entries; 0: not in the tree
    uint8_t capx     # capacity of h.ext as log2 (16: 65535); 0 while the entries are inline
    uint8_t flags
    uint32_t next    # the next entry of its parent's child list (NONE: the last)
    Holders h


cdef struct Tie:     # per entry, beside its Block: the child lists and the depths
    uint32_t first   # the first entry naming it as parent, live or holder-less (NONE: none)
    uint32_t prev    # the previous entry of its parent's child list (NONE: the first)
    uint32_t dep     # in the tree: edges << DEP_BLOCKS | blocks (DEEP: in ``st_deep``);
                     # holder-less on the gone list: its place there


cdef extern from *:
    void __builtin_prefetch(const void* addr) nogil

cdef extern from "sys/mman.h":
    int madvise(void* addr, size_t length, int advice) nogil
    void* mmap(void* addr, size_t length, int prot, int flags, int fd, long offset) nogil
    int munmap(void* addr, size_t length) nogil
    int MADV_HUGEPAGE, PROT_READ, PROT_WRITE, MAP_PRIVATE, MAP_ANONYMOUS
    void* MAP_FAILED


cdef void* _scratch_map(size_t size) noexcept nogil:
    """Zeroed memory straight from the OS, given back whole by :func:`_scratch_unmap` (through
    malloc, glibc would keep a freed pass's working memory in the heap): the block array and
    a statistics pass's working arrays."""
    cdef void* p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
    return NULL if p == MAP_FAILED else p


cdef void _scratch_unmap(void* p, size_t size) noexcept nogil:
    if p != NULL:
        munmap(p, size)


cdef inline void _hugepages(void* p, size_t size) noexcept nogil:
    """Ask for transparent huge pages on a large array: lookups are random accesses over
    hundreds of megabytes, and 4 KiB pages make most of them TLB misses too. Advice only."""
    cdef size_t start = (<size_t>p + 4095) & ~(<size_t>4095)
    cdef size_t end = (<size_t>p + size) & ~(<size_t>4095)
    if size >= (<size_t>4 << 20) and end > start:
        madvise(<void*>start, end - start, MADV_HUGEPAGE)


DEF AHEAD = 16  # longest_match fetches the table slot this many blocks ahead, the block half as far


cdef inline uint64_t _mix(uint64_t x) nogil:
    x ^= x >> 30
    x *= <uint64_t>0xbf58476d1ce4e5b9
    x ^= x >> 27
    x *= <uint64_t>0x94d049bb133111eb
    x ^= x >> 31
    return x


cdef inline uint64_t _u64(object h) except? 0xFFFFFFFFFFFFFFFF:
    """A block hash as the decoder gives it: an int folded to 64 bits."""
    cdef uint64_t v = PyLong_AsUnsignedLongLongMask(h)
    if v == <uint64_t>0xFFFFFFFFFFFFFFFF and PyErr_Occurred():
        raise TypeError(f"block hash must be an int, got {type(h).__name__}")
    return v


cdef inline uint32_t* _hold(Block* b) nogil:
    return b.h.ext if b.capx else b.h.inl


cdef inline uint32_t _capof(Block* b) nogil:
    """Capacity of the block's holder array (0 while inline)."""
    return 0 if not b.capx else (MAX_WORKERS if b.capx >= 16 else (1u << b.capx))


DEF HBUF = 64  # hashes of one event read into a stack buffer (more: a heap one for that event)


cdef uint64_t* _load_hashes(tuple hs, uint64_t* stackbuf) except NULL:
    """The tuple's block hashes as 64-bit ints (folded, as ``_u64`` reads them): in ``stackbuf``
    (``HBUF`` of them) when they fit, else in a malloc'd array the caller frees."""
    cdef Py_ssize_t i, n = PyTuple_GET_SIZE(hs)
    cdef uint64_t* out = stackbuf
    if n > HBUF:
        out = <uint64_t*>malloc(n * sizeof(uint64_t))
        if out == NULL:
            raise MemoryError()
    try:
        for i in range(n):
            out[i] = _u64(<object>PyTuple_GET_ITEM(hs, i))
    except BaseException:
        if out != stackbuf:
            free(out)
        raise
    return out


# ---- KV batches read straight from the payload (declarations; the reader is at the end) -----------

DEF SCAN_STORED = 0
DEF SCAN_REMOVED = 1
DEF SCAN_CLEARED = 2
DEF SCAN_MAX_MEDIA = 8  # distinct media one scanned batch may name (more: the decoder's path reads it)
DEF SCAN_MAX_DEPTH = 32  # nesting of a skipped value the reader follows (deeper: the decoder's path)


cdef struct ScanEvent:
    uint64_t parent
    int64_t block_size
    uint32_t hoff        # the event's hashes: KvScan.hashes[hoff:hoff + hn]
    uint32_t hn
    uint32_t toff        # a stored event's raw token_ids: payload[toff:toff + tlen] (0, 0: none sent)
    uint32_t tlen
    uint32_t token_count
    uint8_t kind
    uint8_t medium       # index into KvScan.media
    uint8_t has_parent


cdef class KvScan:
    """One KV batch as :func:`scan_kv_batch` read it: its events as C arrays (kind, medium,
    parent, block size, token count, hashes), the payload kept for the rest. The prefix index
    and the eviction tracker apply it with ``apply_scan`` without building an event object."""

    cdef ScanEvent* ev
    cdef Py_ssize_t n, cap
    cdef uint64_t* hashes
    cdef Py_ssize_t nh, hcap
    cdef readonly list media      # the distinct media the events name, first named first
    cdef readonly double ts
    cdef readonly object dp_rank
    cdef readonly bytes payload
    cdef readonly Py_ssize_t roots  # stored events without a parent
    # a stored event names a LoRA adapter or carries extra keys (a cache salt, multimodal ids):
    # tenant/adapter attribution reads such a batch through the decoder's typed path
    cdef readonly bint labelled

    def __cinit__(self):
        self.ev, self.n, self.cap = NULL, 0, 0
        self.hashes, self.nh, self.hcap = NULL, 0, 0
        self.media = []
        self.roots = 0
        self.labelled = False

    def __dealloc__(self):
        free(self.ev)
        free(self.hashes)

    def __len__(self):
        return self.n

    @property
    def block_size(self):
        """The first non-zero block size of a stored event (None: no stored event)."""
        cdef Py_ssize_t i
        for i in range(self.n):
            if self.ev[i].kind == SCAN_STORED and self.ev[i].block_size:
                return self.ev[i].block_size
        return None

    def root_events(self, stored_cls, Py_ssize_t max_blocks):
        """The stored events without a parent, as ``stored_cls``: all that prefix instability
        reads of a batch. Their hashes stop after ``max_blocks`` blocks and their token ids after
        ``max_blocks`` blocks' worth (what it compares: ``len(hashes)`` and
        ``len(token_ids) // block_size`` are then cut at ``max_blocks``, nothing else changes)."""
        cdef Py_ssize_t i, j, keep, nh
        cdef ScanEvent* e
        cdef list out = []
        if not self.roots:
            return out
        for i in range(self.n):
            e = &self.ev[i]
            if e.kind != SCAN_STORED or e.has_parent:
                continue
            nh = e.hn if e.hn < max_blocks else max_blocks
            hs = tuple([self.hashes[j] for j in range(e.hoff, e.hoff + nh)])
            keep = e.token_count if e.token_count < max_blocks * e.block_size else max_blocks * e.block_size
            toks = _ints_tuple(self.payload, e.toff, e.tlen, keep)
            out.append(stored_cls(hs, None, e.block_size, e.token_count, self.media[e.medium], toks))
        return out

    def root_keys(self, Py_ssize_t compared, Py_ssize_t early, Py_ssize_t min_shared):
        """What prefix instability reads of the batch's GPU root stores, computed from the payload
        without an int object per token: one ``(first block, head, keys)`` per root store in order,
        as ``prefix_instability.root_key`` defines them (head None: nothing to compare). The keys'
        digests are Python's own ``hash`` of the same tuples (:func:`_same_hash_as_python` checks
        this build against the interpreter; when it differs, ``root_keys`` is None and the state
        reads ``root_events`` instead)."""
        cdef Py_ssize_t i, blocks, bs, keep, s, hn
        cdef ScanEvent* e
        cdef list out = []
        cdef uint64_t lanes_buf[512]
        cdef uint64_t* lanes
        cdef Py_hash_t digest
        cdef list keys
        if not self.roots:
            return out
        for i in range(self.n):
            e = &self.ev[i]
            if e.kind != SCAN_STORED or e.has_parent or e.hn == 0 or not _is_gpu(self.media[e.medium]):
                continue
            first = self.hashes[e.hoff]
            bs = e.block_size
            hn = e.hn
            blocks = compared if compared < hn else hn
            if <Py_ssize_t>(e.token_count // bs) < blocks:
                blocks = e.token_count // bs
            if blocks <= 0:
                out.append((first, None, ()))
                continue
            if blocks - 1 < min_shared:  # no keys, so no head either
                out.append((first, (), ()))
                continue
            keep = blocks * bs
            head = _ints_tuple(self.payload, e.toff, e.tlen, min((early + 1) * bs, keep))
            if keep <= 512:
                lanes = &lanes_buf[0]
            else:
                lanes = <uint64_t*>malloc(keep * sizeof(uint64_t))
            if lanes == NULL:
                raise MemoryError()
            try:
                _int_lanes(self.payload, e.toff, e.tlen, keep, lanes)
                digest = _tuple_hash(lanes + early * bs, keep - early * bs)
                keys = [(early, blocks, digest)] if blocks - early >= min_shared else []
                for s in range(early - 1, 0, -1):
                    digest = _pair_hash(_tuple_hash(lanes + s * bs, bs), digest)
                    if blocks - s >= min_shared:
                        keys.append((s, blocks, digest))
            finally:
                if lanes != &lanes_buf[0]:
                    free(lanes)
            keys.reverse()
            out.append((first, head, tuple(keys)))
        return out

    def events(self, stored_cls, removed_cls, cleared):
        """The model events (tests; the decoder's own path builds them for readers)."""
        cdef Py_ssize_t i, j
        cdef ScanEvent* e
        cdef list out = []
        for i in range(self.n):
            e = &self.ev[i]
            hs = tuple([self.hashes[j] for j in range(e.hoff, e.hoff + e.hn)])
            if e.kind == SCAN_STORED:
                out.append(stored_cls(hs, e.parent if e.has_parent else None, e.block_size, e.token_count,
                                      self.media[e.medium]))
            elif e.kind == SCAN_REMOVED:
                out.append(removed_cls(hs, self.media[e.medium]))
            else:
                out.append(cleared)
        return tuple(out)


class CompiledMatch:
    """Longest cached prefix of a chain (see ``prefix_index_ref.Match``); ``per_worker`` is built
    on first use, so a caller that needs only ``blocks`` or one worker's depth pays no dict."""

    __slots__ = ("blocks", "_names", "_wid", "_pairs", "_dict")

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


cdef class CompiledPrefixIndex:
    """Per-(worker, medium) resident blocks over one shared block tree, in C arrays."""

    cdef Block* blocks
    cdef uint32_t nblocks      # high-water mark of used entries
    cdef uint32_t capblocks
    cdef int64_t free_head     # free entries chained through ``parent``
    cdef uint32_t* slots
    cdef uint64_t tmask        # table size - 1
    cdef uint64_t used         # occupied slots (= entries, live or holder-less)
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

    def __cinit__(self):
        self.capblocks = 1024
        self.blocks = <Block*>_scratch_map(self.capblocks * sizeof(Block))
        self.tmask = 2048 - 1
        self.slots = <uint32_t*>malloc((self.tmask + 1) * sizeof(uint32_t))
        self.capworkers = 64
        self.res = <int64_t*>calloc(self.capworkers, sizeof(int64_t))
        self.tres = <int64_t*>calloc(self.capworkers * NMEDIA, sizeof(int64_t))
        self.scratch = <uint32_t*>calloc(self.capworkers * 2, sizeof(uint32_t))
        if not (self.blocks and self.slots and self.res and self.tres and self.scratch):
            raise MemoryError()
        memset(self.slots, 0xFF, (self.tmask + 1) * sizeof(uint32_t))
        self.free_head = -1
        self._workers = []
        self._wid = {}
        self._media = []
        self._medium_id = {}
        self._hits = {}
        self.version = 0
        self.ties = <Tie*>_scratch_map(self.capblocks * sizeof(Tie))
        if not self.ties:
            raise MemoryError()
        self.root_head = NONE
        _vec_init(&self.st_reps, sizeof(int64_t))
        _vec_init(&self.st_fan, sizeof(int64_t))
        _vec_init(&self.st_leaf_e, sizeof(int64_t))
        _vec_init(&self.st_leaf_b, sizeof(int64_t))
        _vec_init(&self.st_gone, sizeof(uint32_t))
        _vec_init(&self.st_stack, sizeof(uint32_t))
        self.st_branch, self.st_cuts, self.st_deep = set(), set(), {}

    def __dealloc__(self):
        cdef uint32_t i
        if self.blocks:
            for i in range(self.nblocks):
                if self.blocks[i].capx:
                    free(self.blocks[i].h.ext)
            _scratch_unmap(self.blocks, self.capblocks * sizeof(Block))
        _scratch_unmap(self.ties, self.capblocks * sizeof(Tie))
        free(self.slots)
        free(self.res)
        free(self.tres)
        free(self.scratch)
        _vec_free(&self.st_reps)
        _vec_free(&self.st_fan)
        _vec_free(&self.st_leaf_e)
        _vec_free(&self.st_leaf_b)
        _vec_free(&self.st_gone)
        _vec_free(&self.st_stack)

    # ---- hash table ----------------------------------------------------------------------
    cdef inline int64_t _find(self, uint64_t h) noexcept:
        cdef uint64_t i = _mix(h) & self.tmask
        cdef uint32_t s
        while True:
            s = self.slots[i]
            if s == EMPTY:
                return -1
            if self.blocks[s].hash == h:
                return s
            i = (i + 1) & self.tmask

    cdef int _grow_table(self) except -1:
        cdef uint64_t size = (self.tmask + 1) * 2
        cdef uint32_t* slots = <uint32_t*>malloc(size * sizeof(uint32_t))
        cdef uint32_t b
        cdef uint64_t i
        if not slots:
            raise MemoryError()
        _hugepages(slots, size * sizeof(uint32_t))  # before the first touch
        memset(slots, 0xFF, size * sizeof(uint32_t))
        for b in range(self.nblocks):
            if not self.blocks[b].flags & FLAG_FREE:
                i = _mix(self.blocks[b].hash) & (size - 1)
                while slots[i] != EMPTY:
                    i = (i + 1) & (size - 1)
                slots[i] = b
        free(self.slots)
        self.slots = slots
        self.tmask = size - 1
        return 0

    cdef int64_t _find_or_add(self, uint64_t h) except -2:
        """The entry of ``h``, created holder-less and root-level if it is new."""
        cdef uint64_t i = _mix(h) & self.tmask
        cdef uint32_t s
        cdef int64_t b
        cdef Block* blk
        while True:
            s = self.slots[i]
            if s == EMPTY:
                break
            if self.blocks[s].hash == h:
                return s
            i = (i + 1) & self.tmask
        if self.free_head >= 0:
            b = self.free_head
            self.free_head = self.blocks[b].parent
        else:
            if self.nblocks == self.capblocks:
                self._grow_blocks()
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
        self.slots[i] = <uint32_t>b
        self.used += 1
        if self.used * 4 >= (self.tmask + 1) * 3:
            self._grow_table()
        return b

    cdef int _grow_blocks(self) except -1:
        cdef uint64_t cap = self.capblocks + (self.capblocks >> 1)
        if cap > 0xFFFFFFF0:
            raise MemoryError("prefix index: more than 2^32 blocks")
        # A fresh mapping with huge pages asked for before the copy touches it (realloc would
        # move the old 4 KiB pages along): random lookups then rarely miss the TLB.
        cdef Block* blocks = <Block*>_scratch_map(cap * sizeof(Block))
        cdef Tie* ties = <Tie*>_scratch_map(cap * sizeof(Tie))
        if not (blocks and ties):
            _scratch_unmap(blocks, cap * sizeof(Block))
            _scratch_unmap(ties, cap * sizeof(Tie))
            raise MemoryError()
        _hugepages(blocks, cap * sizeof(Block))
        _hugepages(ties, cap * sizeof(Tie))
        memcpy(blocks, self.blocks, self.nblocks * sizeof(Block))
        memcpy(ties, self.ties, self.nblocks * sizeof(Tie))
        _scratch_unmap(self.blocks, self.capblocks * sizeof(Block))
        _scratch_unmap(self.ties, self.capblocks * sizeof(Tie))
        self.blocks, self.ties = blocks, ties
        self.capblocks = <uint32_t>cap
        return 0

    cdef void _unlink(self, int64_t b) noexcept:
        """Take entry ``b`` out of the table (backward-shift deletion) and onto the free list."""
        cdef uint64_t i = _mix(self.blocks[b].hash) & self.tmask
        cdef uint64_t j, k
        while self.slots[i] != <uint32_t>b:
            i = (i + 1) & self.tmask
        j = i
        while True:
            j = (j + 1) & self.tmask
            if self.slots[j] == EMPTY:
                break
            k = _mix(self.blocks[self.slots[j]].hash) & self.tmask
            # move slot j back to the hole at i unless its home k lies cyclically in (i, j]
            if (j > i and (k <= i or k > j)) or (j < i and (k <= i and k > j)):
                self.slots[i] = self.slots[j]
                i = j
        self.slots[i] = EMPTY
        self.used -= 1
        if self.blocks[b].capx:
            free(self.blocks[b].h.ext)
            self.blocks[b].capx = 0
        if self.blocks[b].flags & FLAG_GONE:
            self._gone_drop(<uint32_t>b)
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
        cdef uint64_t total = self.nblocks * (sizeof(Block) + sizeof(Tie)) + (self.tmask + 1) * sizeof(uint32_t)
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
        cdef int tiers[SCAN_MAX_MEDIA]
        cdef int t, k
        cdef Py_ssize_t i
        cdef ScanEvent* e
        for k in range(SCAN_MAX_MEDIA):
            tiers[k] = -1
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
        self.version += 1
        return _apply_result(stored, removed, cleared, unknown_parent, unknown_removals, stored_events,
                             removed_events, self.pl_decisions - pl0, self.pl_hits - ph0)

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
                elif p != prev:  # a departed block back under another parent
                    _unlist_from(self.blocks, self.ties, &self.root_head, <uint32_t>b)
                    self.blocks[b].parent = <int32_t>prev
                    _link_to(self.blocks, self.ties, &self.root_head, <uint32_t>b, prev)
                    if p >= 0:
                        self._release(p)
                self._st_enter(<uint32_t>b)  # statistics
            else:
                pos = self._slot_of(blk, <uint32_t>wid)
                if pos < 0:
                    self._insert(b, -pos - 1, (<uint32_t>wid << 8) | tbit)
                    self.res[wid] += 1
                    self.tres[wid * NMEDIA + t] += 1
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

    # ---- lookups ------------------------------------------------------------------------------
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
        """
        if type(block_hashes) is not tuple:
            block_hashes = tuple(block_hashes)
        cdef tuple hs = block_hashes
        cdef Py_ssize_t i, n = PyTuple_GET_SIZE(hs)
        cdef uint32_t depth = 0
        cdef int64_t b
        cdef uint32_t* e
        cdef uint32_t* prev_e = NULL
        cdef uint32_t* alive = self.scratch
        cdef uint32_t* nxt = self.scratch + self.capworkers
        cdef int k, prev_k = 0, na = 0, nn, j, a, lo, hi, mid
        cdef bint full = False
        cdef uint32_t w
        cdef uint32_t head[2]
        cdef carray.array out = carray.clone(_GROUPS, 0, zero=False)
        # The chain's hashes are known up front, so their table slots and blocks are fetched
        # ahead of the walk: the lookups' cache misses overlap instead of queueing one by one.
        cdef uint64_t stackbuf[64]
        cdef uint64_t* h = stackbuf
        cdef uint32_t s
        if n > 64:
            h = <uint64_t*>malloc(n * sizeof(uint64_t))
            if not h:
                raise MemoryError()
        try:
            for i in range(n):
                h[i] = _u64(<object>PyTuple_GET_ITEM(hs, i))
            for i in range(min(n, AHEAD)):
                __builtin_prefetch(&self.slots[_mix(h[i]) & self.tmask])
            for i in range(n):
                if i + AHEAD < n:
                    __builtin_prefetch(&self.slots[_mix(h[i + AHEAD]) & self.tmask])
                if i + AHEAD // 2 < n:
                    s = self.slots[_mix(h[i + AHEAD // 2]) & self.tmask]
                    if s != EMPTY:
                        __builtin_prefetch(&self.blocks[s])
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
                            lo, hi = 0, na
                            while lo < hi:
                                mid = (lo + hi) >> 1
                                if alive[mid] < w:
                                    lo = mid + 1
                                else:
                                    hi = mid
                            if lo < na and alive[lo] == w:
                                nxt[nn] = w
                                nn += 1
                    elif na * 16 < k:  # few survivors: look each up among the holders
                        for a in range(na):
                            w = alive[a]
                            lo, hi = 0, k
                            while lo < hi:
                                mid = (lo + hi) >> 1
                                if (e[mid] >> 8) < w:
                                    lo = mid + 1
                                else:
                                    hi = mid
                            if lo < k and (e[lo] >> 8) == w:
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
                    alive, nxt = nxt, alive
                    na = nn
                    if not na:
                        break
                    full = na == k
                prev_e, prev_k = e, k
                depth += 1
        finally:
            if h != stackbuf:
                free(h)
        if na:
            head[0], head[1] = depth, na
            carray.extend_buffer(out, <char*>head, 2)
            carray.extend_buffer(out, <char*>alive, na)
        return CompiledMatch(depth, self._workers, self._wid, out)

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


# ---- eviction lifecycle ---------------------------------------------------------------------------
# The semantics of ``exporter.core.index.eviction.EvictionTracker`` (the reference; read its docstring for the
# rule) in C: per worker two bounded ordered tables instead of an OrderedDict and a dict — recent
# evictions in last-eviction order, sampled resident blocks in insertion order — each a pool of at
# most ``memory`` entries (grown by doubling as it fills) with a chained hash index and a doubly
# linked order list. The batch's counts and sampled ages become Python objects once per batch.

DEF EV_FIRST_CAP = 64  # entries of a table's first allocation (grown by doubling up to ``memory``)


cdef struct EvEntry:
    uint64_t key
    double t         # recent: evicted at; live: stored at
    uint64_t child   # live: the first child seen (valid when has_child)
    int32_t hnext    # next entry in the bucket chain (or in the free list)
    int32_t prev     # order list: older neighbour
    int32_t next     # order list: newer neighbour
    uint8_t has_child
    uint8_t reused


cdef struct OrderedTable:
    EvEntry* e
    int32_t* buckets
    uint32_t cap      # entries allocated
    uint32_t bmask    # buckets - 1 (buckets: a power of two, at least ``cap``)
    uint32_t n        # entries in use
    uint32_t used     # entries ever handed out from the pool (the rest are above ``used``)
    int32_t head      # oldest
    int32_t tail      # newest
    int32_t free      # freed entries, linked through ``hnext``


cdef void _ot_init(OrderedTable* t) noexcept nogil:
    t.e, t.buckets = NULL, NULL
    t.cap = t.bmask = t.n = t.used = 0
    t.head = t.tail = t.free = -1


cdef void _ot_free(OrderedTable* t) noexcept nogil:
    free(t.e)
    free(t.buckets)
    _ot_init(t)


cdef void _ot_clear(OrderedTable* t) noexcept nogil:
    """Empty the table, keeping its allocation (it is bounded by ``memory``)."""
    if t.buckets != NULL:
        memset(t.buckets, 0xFF, (<size_t>t.bmask + 1) * sizeof(int32_t))
    t.n = t.used = 0
    t.head = t.tail = t.free = -1


cdef inline int32_t _ot_find(const OrderedTable* t, uint64_t key) noexcept nogil:
    cdef int32_t i
    if t.n == 0:
        return -1
    i = t.buckets[_mix(key) & t.bmask]
    while i >= 0 and t.e[i].key != key:
        i = t.e[i].hnext
    return i


cdef void _ot_unlink(OrderedTable* t, int32_t i) noexcept nogil:
    """Take entry ``i`` out of its bucket chain and the order list, onto the free list."""
    cdef int32_t* link = &t.buckets[_mix(t.e[i].key) & t.bmask]
    while link[0] != i:
        link = &t.e[link[0]].hnext
    link[0] = t.e[i].hnext
    if t.e[i].prev >= 0:
        t.e[t.e[i].prev].next = t.e[i].next
    else:
        t.head = t.e[i].next
    if t.e[i].next >= 0:
        t.e[t.e[i].next].prev = t.e[i].prev
    else:
        t.tail = t.e[i].prev
    t.e[i].hnext = t.free
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


cdef void _ot_to_end(OrderedTable* t, int32_t i) noexcept nogil:
    if t.tail == i:
        return
    if t.e[i].prev >= 0:
        t.e[t.e[i].prev].next = t.e[i].next
    else:
        t.head = t.e[i].next
    t.e[t.e[i].next].prev = t.e[i].prev  # not the tail: it has a newer neighbour
    _ot_append(t, i)


cdef int _ot_grow(OrderedTable* t, uint32_t limit) except -1:
    """Double the pool (up to ``limit``) and rebuild the bucket index for it."""
    cdef uint32_t cap = EV_FIRST_CAP if t.cap == 0 else t.cap * 2
    cdef uint32_t nb = 1, b
    cdef int32_t i
    cdef EvEntry* e
    cdef int32_t* buckets
    if cap > limit:
        cap = limit
    while nb < cap:
        nb <<= 1
    e = <EvEntry*>realloc(t.e, cap * sizeof(EvEntry))
    if e == NULL:
        raise MemoryError()
    t.e = e
    buckets = <int32_t*>malloc(nb * sizeof(int32_t))
    if buckets == NULL:
        raise MemoryError()
    memset(buckets, 0xFF, nb * sizeof(int32_t))
    i = t.head
    while i >= 0:  # every entry in use is on the order list; the free list is empty when full
        b = _mix(e[i].key) & (nb - 1)
        e[i].hnext = buckets[b]
        buckets[b] = i
        i = e[i].next
    free(t.buckets)
    t.buckets, t.bmask, t.cap = buckets, nb - 1, cap
    return 0


cdef int32_t _ot_add(OrderedTable* t, uint64_t key, double ts, uint32_t limit) except -2:
    """A new newest entry for ``key`` (not in the table); the oldest goes when ``limit`` are held."""
    cdef int32_t i
    cdef uint32_t b
    if t.n >= limit:
        _ot_unlink(t, t.head)
    elif t.n == t.cap:
        _ot_grow(t, limit)
    if t.free >= 0:
        i = t.free
        t.free = t.e[i].hnext
    else:
        i = <int32_t>t.used
        t.used += 1
    b = _mix(key) & t.bmask
    t.e[i].key, t.e[i].t = key, ts
    t.e[i].child, t.e[i].has_child, t.e[i].reused = 0, 0, 0
    t.e[i].hnext = t.buckets[b]
    t.buckets[b] = i
    _ot_append(t, i)
    t.n += 1
    return i


cdef class _EvictionWorker:
    """One worker's recent evictions (every one, and a sample reaching further) and sampled
    resident blocks."""

    cdef OrderedTable recent
    cdef OrderedTable sampled
    cdef OrderedTable live
    cdef int64_t carry  # estimated restores not yet counted (a batch counts at most its stored blocks)

    def __cinit__(self):
        _ot_init(&self.recent)
        _ot_init(&self.sampled)
        _ot_init(&self.live)
        self.carry = 0

    def __dealloc__(self):
        _ot_free(&self.recent)
        _ot_free(&self.sampled)
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
        if memory > 0x7FFFFFFF:
            raise ValueError("eviction memory must be below 2^31")
        self.window_s = float(window_s)
        self.memory = memory
        self.mask = <uint64_t>(sample_every - 1)

    cdef _EvictionWorker _worker(self, str worker):
        w = self._workers.get(worker)
        if w is None:
            w = self._workers[worker] = _EvictionWorker()
        return <_EvictionWorker>w

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
                _ot_clear(&w.recent)
                _ot_clear(&w.sampled)
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
        for i in range(scan.n):
            e = &scan.ev[i]
            if e.kind == SCAN_CLEARED:  # a reset, not eviction: nothing to learn from
                _ot_clear(&w.recent)
                _ot_clear(&w.sampled)
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

    cdef int _stored(self, _EvictionWorker w, const uint64_t* hs, Py_ssize_t n, bint has_parent,
                     uint64_t parent, double ts, int64_t* stored, int64_t* restored) except -1:
        cdef Py_ssize_t i
        cdef uint64_t mask = self.mask, p = parent
        cdef uint32_t limit = <uint32_t>self.memory
        cdef int32_t k
        cdef bint have_parent = has_parent, back
        cdef int64_t again = 0, counted
        cdef int64_t every = <int64_t>(mask + 1)
        cdef OrderedTable* recent = &w.recent
        cdef OrderedTable* sampled = &w.sampled
        cdef OrderedTable* live = &w.live
        if n == 0:
            return 0
        stored[0] += n
        if recent.n or sampled.n:  # stored again: evicted from this worker before (within the window: thrash)
            for i in range(n):
                back = False
                if recent.n:
                    k = _ot_find(recent, hs[i])
                    if k >= 0:
                        back = True
                        if ts - recent.e[k].t <= self.window_s:
                            again += 1
                        _ot_unlink(recent, k)
                if sampled.n and not hs[i] & mask:
                    k = _ot_find(sampled, hs[i])
                    if k >= 0:
                        if not back and ts - sampled.e[k].t <= self.window_s:
                            again += every  # beyond the exact ring: stands for ``every`` blocks
                        _ot_unlink(sampled, k)
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
        cdef uint64_t mask = self.mask
        cdef uint32_t limit = <uint32_t>self.memory
        cdef int32_t k
        cdef double age
        cdef OrderedTable* recent = &w.recent
        cdef OrderedTable* sampled = &w.sampled
        cdef OrderedTable* live = &w.live
        for i in range(n):
            k = _ot_find(recent, hs[i])
            if k >= 0:
                recent.e[k].t = ts
                _ot_to_end(recent, k)
            else:
                _ot_add(recent, hs[i], ts, limit)
            if not hs[i] & mask:
                k = _ot_find(sampled, hs[i])
                if k >= 0:
                    sampled.e[k].t = ts
                    _ot_to_end(sampled, k)
                else:
                    _ot_add(sampled, hs[i], ts, limit)
            if not hs[i] & mask and live.n:
                k = _ot_find(live, hs[i])
                if k >= 0:
                    age = ts - live.e[k].t
                    ages.append((age if age > 0.0 else 0.0, live.e[k].reused != 0))
                    _ot_unlink(live, k)
        return n

    cdef void _expire(self, _EvictionWorker w, double now) noexcept:
        cdef double cutoff = now - self.window_s
        cdef OrderedTable* recent = &w.recent
        cdef OrderedTable* sampled = &w.sampled
        while recent.n:
            if recent.e[recent.head].t >= cutoff:
                break
            _ot_unlink(recent, recent.head)
        while sampled.n:
            if sampled.e[sampled.head].t >= cutoff:
                break
            _ot_unlink(sampled, sampled.head)

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


# ---- KV events from the decoder's typed structs ---------------------------------------------------


# ApplyResult and BatchEvictions, one per batch each: plain dataclasses (an instance dict, no
# __post_init__), built by filling the dict instead of through the generated keyword __init__. If
# either class changes shape, its own constructor is used.
_APPLY_FIELDS = ("stored", "removed", "cleared", "unknown_parent", "unknown_removals", "stored_events",
                 "removed_events", "placements", "placement_hits")
_EVICTION_FIELDS = ("stored", "restored", "evicted", "ages", "other_media")


def _plain_dataclass(cls, names):
    from dataclasses import fields
    return (not hasattr(cls, "__post_init__") and "__slots__" not in vars(cls)
            and not cls.__dataclass_params__.frozen and tuple(f.name for f in fields(cls)) == names)


cdef bint _FAST_APPLY = _plain_dataclass(ApplyResult, _APPLY_FIELDS)
cdef bint _FAST_EVICTIONS = _plain_dataclass(BatchEvictions, _EVICTION_FIELDS)


cdef object _apply_result(int64_t stored, int64_t removed, int64_t cleared, int64_t unknown_parent,
                          int64_t unknown_removals, int64_t stored_events, int64_t removed_events,
                          int64_t placements, int64_t placement_hits):
    if not _FAST_APPLY:
        return ApplyResult(stored, removed, cleared, unknown_parent, unknown_removals, stored_events, removed_events,
                           placements, placement_hits)
    o = _new_slotted(ApplyResult)
    PyObject_GenericSetAttr(o, "stored", stored)
    PyObject_GenericSetAttr(o, "removed", removed)
    PyObject_GenericSetAttr(o, "cleared", cleared)
    PyObject_GenericSetAttr(o, "unknown_parent", unknown_parent)
    PyObject_GenericSetAttr(o, "unknown_removals", unknown_removals)
    PyObject_GenericSetAttr(o, "stored_events", stored_events)
    PyObject_GenericSetAttr(o, "removed_events", removed_events)
    PyObject_GenericSetAttr(o, "placements", placements)
    PyObject_GenericSetAttr(o, "placement_hits", placement_hits)
    return o


cdef object _batch_evictions(int64_t stored, int64_t restored, int64_t evicted, list ages, bint other_media):
    if not _FAST_EVICTIONS:
        return BatchEvictions(stored, restored, evicted, ages, other_media)
    o = _new_slotted(BatchEvictions)
    PyObject_GenericSetAttr(o, "stored", stored)
    PyObject_GenericSetAttr(o, "restored", restored)
    PyObject_GenericSetAttr(o, "evicted", evicted)
    PyObject_GenericSetAttr(o, "ages", ages)
    PyObject_GenericSetAttr(o, "other_media", other_media)
    return o


def split_ages(list ages):
    """(first observation reused, reused ages, fresh ages) of a batch's ``(age, reused)`` list, each
    in order: how the state writes the eviction-age series (``state.split_ages`` is the same in Python)."""
    cdef list reused = [], fresh = []
    for age, r in ages:
        if r is True:
            reused.append(age)
        elif r is False:
            fresh.append(age)
    return bool(ages) and bool(ages[0][1]), reused, fresh


cdef inline object _new_slotted(type cls):
    """An empty instance of a slotted class (``object.__new__(cls)``), its slots unset."""
    return (<PyTypeObject*>cls).tp_new(cls, <PyObject*>(), NULL)


cdef Py_ssize_t _raw_array_len(object raw) except -1:
    """The length of a raw msgpack array from its header; 0 for anything else."""
    cdef Py_buffer view
    cdef const unsigned char* p
    cdef Py_ssize_t n = 0
    PyObject_GetBuffer(raw, &view, PyBUF_SIMPLE)
    try:
        p = <const unsigned char*>view.buf
        if view.len >= 1 and 0x90 <= p[0] <= 0x9F:
            n = p[0] & 0x0F
        elif view.len >= 3 and p[0] == 0xDC:
            n = (<Py_ssize_t>p[1] << 8) | p[2]
        elif view.len >= 5 and p[0] == 0xDD:
            n = (<Py_ssize_t>p[1] << 24) | (<Py_ssize_t>p[2] << 16) | (<Py_ssize_t>p[3] << 8) | p[4]
    finally:
        PyBuffer_Release(&view)
    return n


cdef class EventBuilder:
    """``exporter.model`` events from ``exporter.codecs.kvcodec``'s typed structs, their slots filled in C
    (the work of ``kvcodec._build_events``, which defines it; the codec tests hold the two equal).
    The event classes must be slotted with the fields ``kvcodec`` names (it checks before use)."""

    cdef type stored_cls, removed_cls
    cdef object cleared, tokens
    cdef tuple stored_kinds, removed_kinds

    def __init__(self, type stored_cls, type removed_cls, cleared, tuple stored_kinds, tuple removed_kinds, tokens):
        self.stored_cls, self.removed_cls, self.cleared = stored_cls, removed_cls, cleared
        self.stored_kinds, self.removed_kinds, self.tokens = stored_kinds, removed_kinds, tokens

    def build(self, tuple structs, bint token_ids):
        cdef Py_ssize_t i, n = PyTuple_GET_SIZE(structs)
        cdef list out = [None] * n
        cdef object ev, kind, o, raw
        for i in range(n):
            ev = <object>PyTuple_GET_ITEM(structs, i)
            kind = type(ev)
            if kind is self.removed_kinds[0] or kind is self.removed_kinds[1]:
                o = _new_slotted(self.removed_cls)
                PyObject_GenericSetAttr(o, "hashes", ev.block_hashes)
                PyObject_GenericSetAttr(o, "medium", ev.medium)
            elif kind is self.stored_kinds[0] or kind is self.stored_kinds[1]:
                raw = ev.token_ids
                o = _new_slotted(self.stored_cls)
                PyObject_GenericSetAttr(o, "hashes", ev.block_hashes)
                PyObject_GenericSetAttr(o, "parent", ev.parent_block_hash)
                PyObject_GenericSetAttr(o, "block_size", ev.block_size)
                PyObject_GenericSetAttr(o, "token_count", _raw_array_len(raw))
                PyObject_GenericSetAttr(o, "medium", ev.medium)
                # a root store's tokens always (prefix instability compares openings)
                PyObject_GenericSetAttr(o, "token_ids", self.tokens(raw)
                                        if token_ids or ev.parent_block_hash is None else ())
            else:
                o = self.cleared
            out[i] = o
        return tuple(out)


# ---- KV batches read straight from the payload ------------------------------------------------------
# ``scan_kv_batch`` reads the common, well-formed vLLM batch without building a Python object per
# event or per hash: ``[ts, events]`` or ``[ts, events, dp_rank]`` with a float timestamp, the
# events all maps whose first key is ``type`` (vLLM >= 0.24) or all arrays of the declared length
# (<= 0.23), hashes and parents unsigned ints, a positive int block size, a string or nil medium,
# each field at most once; a root store's token_ids nil or an array of ints. It accepts a strict
# subset of what ``exporter.codecs.kvcodec``'s typed path accepts and reads the same values from it (the
# codec tests hold the two equal); anything else, it returns None and the decoder's path decides.

cdef struct Reader:
    const uint8_t* p
    const uint8_t* end


cdef inline uint64_t _be(const uint8_t* p, int n) noexcept nogil:
    cdef uint64_t v = 0
    cdef int i
    for i in range(n):
        v = (v << 8) | p[i]
    return v


cdef int _skip(Reader* r) noexcept nogil:
    """Step over one well-formed msgpack value; -1 when it is not one (or nests too deep)."""
    cdef uint64_t left[SCAN_MAX_DEPTH]
    cdef int sp = 0
    cdef uint8_t b
    cdef uint64_t size, items, avail
    left[0] = 1
    while True:
        if r.p >= r.end:
            return -1
        b = r.p[0]
        avail = <uint64_t>(r.end - r.p)
        items = 0
        if b <= 0x7f or b >= 0xe0 or b == 0xc0 or b == 0xc2 or b == 0xc3:
            size = 1
        elif b <= 0x8f:
            size, items = 1, 2 * <uint64_t>(b & 0x0f)
        elif b <= 0x9f:
            size, items = 1, b & 0x0f
        elif b <= 0xbf:
            size = 1 + <uint64_t>(b & 0x1f)
        elif b == 0xc1:
            return -1
        elif b == 0xc4 or b == 0xc5 or b == 0xc6 or b == 0xd9 or b == 0xda or b == 0xdb:  # bin, str
            size = <uint64_t>1 << (b - 0xc4) if b <= 0xc6 else <uint64_t>1 << (b - 0xd9)
            if avail < 1 + size:
                return -1
            size = 1 + size + _be(r.p + 1, <int>size)
        elif b == 0xc7 or b == 0xc8 or b == 0xc9:  # ext: length, type, data
            size = 1 << (b - 0xc7)
            if avail < 1 + size:
                return -1
            size = 2 + size + _be(r.p + 1, <int>size)
        elif b == 0xca or b == 0xce or b == 0xd2:
            size = 5
        elif b == 0xcb or b == 0xcf or b == 0xd3:
            size = 9
        elif b == 0xcc or b == 0xd0:
            size = 2
        elif b == 0xcd or b == 0xd1:
            size = 3
        elif 0xd4 <= b <= 0xd8:  # fixext 1, 2, 4, 8, 16
            size = 2 + (<uint64_t>1 << (b - 0xd4))
        elif b == 0xdc or b == 0xde:
            if avail < 3:
                return -1
            size, items = 3, _be(r.p + 1, 2)
            items = items * 2 if b == 0xde else items
        else:  # 0xdd, 0xdf
            if avail < 5:
                return -1
            size, items = 5, _be(r.p + 1, 4)
            items = items * 2 if b == 0xdf else items
        if avail < size:
            return -1
        r.p += size
        left[sp] -= 1
        if items:
            if items > avail:  # each item takes a byte at least
                return -1
            sp += 1
            if sp >= SCAN_MAX_DEPTH:
                return -1
            left[sp] = items
        while left[sp] == 0:
            if sp == 0:
                return 0
            sp -= 1


cdef inline int _container(Reader* r, uint8_t fix, uint8_t fixmask, uint8_t b16, uint8_t b32,
                           uint64_t* n) noexcept nogil:
    """An array (or map) header: its item (or pair) count; -1 for anything else."""
    cdef uint8_t b
    if r.p >= r.end:
        return -1
    b = r.p[0]
    if (b & ~fixmask) == fix:
        n[0] = b & fixmask
        r.p += 1
    elif b == b16 and r.end - r.p >= 3:
        n[0] = _be(r.p + 1, 2)
        r.p += 3
    elif b == b32 and r.end - r.p >= 5:
        n[0] = _be(r.p + 1, 4)
        r.p += 5
    else:
        return -1
    return 0


cdef inline int _array(Reader* r, uint64_t* n) noexcept nogil:
    return _container(r, 0x90, 0x0f, 0xdc, 0xdd, n)


cdef inline int _map(Reader* r, uint64_t* n) noexcept nogil:
    return _container(r, 0x80, 0x0f, 0xde, 0xdf, n)


cdef int _str(Reader* r, const uint8_t** s, uint64_t* n) noexcept nogil:
    cdef uint8_t b
    cdef int k
    if r.p >= r.end:
        return -1
    b = r.p[0]
    if 0xa0 <= b <= 0xbf:
        n[0] = b & 0x1f
        r.p += 1
    elif 0xd9 <= b <= 0xdb:
        k = 1 << (b - 0xd9)
        if r.end - r.p < 1 + k:
            return -1
        n[0] = _be(r.p + 1, k)
        r.p += 1 + k
    else:
        return -1
    if <uint64_t>(r.end - r.p) < n[0]:
        return -1
    s[0] = r.p
    r.p += n[0]
    return 0


cdef inline bint _is(const uint8_t* s, uint64_t n, const char* word, uint64_t wn) noexcept nogil:
    return n == wn and memcmp(s, word, wn) == 0


cdef int _int(Reader* r, uint64_t* v, bint* negative) noexcept nogil:
    """Any msgpack int: its value as 64 bits and whether it is below 0; -1 for anything else."""
    cdef uint8_t b
    cdef int k
    cdef int64_t x
    if r.p >= r.end:
        return -1
    b = r.p[0]
    negative[0] = False
    if b <= 0x7f:
        v[0] = b
        r.p += 1
        return 0
    if b >= 0xe0:
        v[0] = <uint64_t><int64_t><int8_t>b
        negative[0] = True
        r.p += 1
        return 0
    if 0xcc <= b <= 0xcf:
        k = 1 << (b - 0xcc)
        if r.end - r.p < 1 + k:
            return -1
        v[0] = _be(r.p + 1, k)
        r.p += 1 + k
        return 0
    if 0xd0 <= b <= 0xd3:
        k = 1 << (b - 0xd0)
        if r.end - r.p < 1 + k:
            return -1
        x = <int64_t>_be(r.p + 1, k)
        if k < 8:  # sign-extend
            x = (x ^ (<int64_t>1 << (8 * k - 1))) - (<int64_t>1 << (8 * k - 1))
        v[0] = <uint64_t>x
        negative[0] = x < 0
        r.p += 1 + k
        return 0
    return -1


cdef inline int _u64_at(Reader* r, uint64_t* v) noexcept nogil:
    """An int in 0..2^64-1 (a block hash); -1 for anything else."""
    cdef bint negative
    if _int(r, v, &negative) < 0 or negative:
        return -1
    return 0


cdef int _nil_or_u64(Reader* r, uint64_t* v, uint8_t* present) noexcept nogil:
    if r.p < r.end and r.p[0] == 0xc0:
        r.p += 1
        present[0] = 0
        return 0
    present[0] = 1
    return _u64_at(r, v)


cdef int _ints_or_nil(Reader* r) noexcept nogil:
    """Nil, or an array of ints (a root store's token ids as msgpack reads them); -1 otherwise."""
    cdef uint64_t n, i, v
    cdef bint negative
    if r.p < r.end and r.p[0] == 0xc0:
        r.p += 1
        return 0
    if _array(r, &n) < 0:
        return -1
    for i in range(n):
        if _int(r, &v, &negative) < 0:
            return -1
    return 0


cdef int _hashes_into(KvScan s, Reader* r, ScanEvent* e) except -2:
    """The event's hash array into the scan; -1 when it is not an array of u64 ints."""
    cdef uint64_t n, i
    cdef uint64_t* grown
    cdef Py_ssize_t cap
    if _array(r, &n) < 0 or n > <uint64_t>(r.end - r.p):
        return -1
    if s.nh + <Py_ssize_t>n > s.hcap:
        cap = s.hcap * 2 if s.hcap else 256
        while cap < s.nh + <Py_ssize_t>n:
            cap *= 2
        grown = <uint64_t*>realloc(s.hashes, cap * sizeof(uint64_t))
        if grown == NULL:
            raise MemoryError()
        s.hashes, s.hcap = grown, cap
    e.hoff, e.hn = <uint32_t>s.nh, <uint32_t>n
    for i in range(n):
        if _u64_at(r, &s.hashes[s.nh + <Py_ssize_t>i]) < 0:
            return -1
    s.nh += <Py_ssize_t>n
    return 0


cdef object _GPU = "GPU"


cdef int _medium(KvScan s, Reader* r, ScanEvent* e) except -2:
    """A str or nil medium into the scan's media; -1 for anything else (or a ninth medium)."""
    cdef const uint8_t* txt
    cdef uint64_t n
    cdef object m
    cdef Py_ssize_t i
    if r.p < r.end and r.p[0] == 0xc0:
        r.p += 1
        m = None
    else:
        if _str(r, &txt, &n) < 0:
            return -1
        if _is(txt, n, b"GPU", 3):
            m = _GPU
        else:
            try:
                m = (<const char*>txt)[:n].decode("utf-8")
            except UnicodeDecodeError:
                return -1
    return _medium_id(s, m, e)


cdef int _medium_id(KvScan s, object m, ScanEvent* e) except -2:
    cdef Py_ssize_t i
    for i in range(len(s.media)):
        if s.media[i] is m or (m is not None and s.media[i] == m):
            e.medium = <uint8_t>i
            return 0
    if len(s.media) >= SCAN_MAX_MEDIA:
        return -1
    e.medium = <uint8_t>len(s.media)
    s.media.append(m)
    return 0


cdef int _raw_tokens(Reader* r, const uint8_t* base, ScanEvent* e) noexcept nogil:
    """Step over a stored event's token_ids, noting where they are and their count (an array of
    small ints, the usual case, is stepped over in one tight loop; anything else by ``_skip``)."""
    cdef const uint8_t* start = r.p
    cdef Reader peek = r[0]
    cdef uint64_t n, i
    cdef const uint8_t* p
    cdef const uint8_t* end = r.end
    cdef uint8_t b
    e.token_count = 0
    if _array(&peek, &n) == 0:
        e.token_count = <uint32_t>n
        p = peek.p
        for i in range(n):  # ints only: fixint, uint8/16/32 (a token id is below 2^32)
            if p >= end:
                break
            b = p[0]
            if b <= 0x7f:
                p += 1
            elif b == 0xcd:
                p += 3
            elif b == 0xce:
                p += 5
            elif b == 0xcc:
                p += 2
            else:
                break
        else:
            if p <= end:
                r.p = p
                e.toff, e.tlen = <uint32_t>(start - base), <uint32_t>(p - start)
                return 0
    if _skip(r) < 0:
        return -1
    e.toff, e.tlen = <uint32_t>(start - base), <uint32_t>(r.p - start)
    return 0


cdef int _block_size(Reader* r, ScanEvent* e) noexcept nogil:
    cdef uint64_t v
    cdef bint negative
    if _int(r, &v, &negative) < 0 or negative or v == 0 or v > <uint64_t>0x7FFFFFFFFFFFFFFF:
        return -1
    e.block_size = <int64_t>v
    return 0


DEF F_HASHES = 1
DEF F_SIZE = 2
DEF F_PARENT = 4
DEF F_TOKENS = 8
DEF F_MEDIUM = 16


cdef int _label(KvScan s, Reader* r, bint entries) noexcept:
    """Skip a ``lora_name`` (``entries`` False) or ``extra_keys`` (True) value, noting on ``s``
    whether it labels the blocks: a lora name that is not nil, extra keys with an entry that is not nil."""
    cdef uint64_t n, i
    if r.p >= r.end:
        return -1
    if r.p[0] == 0xc0:
        r.p += 1
        return 0
    if not entries:
        s.labelled = True
        return _skip(r)
    if _array(r, &n) < 0:
        return -1
    for i in range(n):
        if r.p >= r.end:
            return -1
        if r.p[0] == 0xc0:
            r.p += 1
            continue
        s.labelled = True
        if _skip(r) < 0:
            return -1
    return 0


cdef int _map_event(KvScan s, Reader* r, const uint8_t* base, ScanEvent* e) except -2:
    cdef uint64_t keys, k, n
    cdef const uint8_t* txt
    cdef int seen = 0, f
    if _map(r, &keys) < 0 or keys == 0:
        return -1
    if _str(r, &txt, &n) < 0 or not _is(txt, n, b"type", 4) or _str(r, &txt, &n) < 0:
        return -1
    if _is(txt, n, b"BlockStored", 11):
        e.kind = SCAN_STORED
    elif _is(txt, n, b"BlockRemoved", 12):
        e.kind = SCAN_REMOVED
    elif _is(txt, n, b"AllBlocksCleared", 16):
        e.kind = SCAN_CLEARED
    else:
        return -1
    for k in range(1, keys):
        if _str(r, &txt, &n) < 0:
            return -1
        f = 0
        if e.kind != SCAN_CLEARED:
            if _is(txt, n, b"block_hashes", 12):
                f = F_HASHES
            elif _is(txt, n, b"medium", 6):
                f = F_MEDIUM
            elif e.kind == SCAN_STORED:
                if _is(txt, n, b"block_size", 10):
                    f = F_SIZE
                elif _is(txt, n, b"parent_block_hash", 17):
                    f = F_PARENT
                elif _is(txt, n, b"token_ids", 9):
                    f = F_TOKENS
        if _is(txt, n, b"type", 4) or seen & f:
            return -1  # a field twice: the decoder's path reads it (the last one wins there)
        seen |= f
        if f == F_HASHES:
            if _hashes_into(s, r, e) < 0:
                return -1
        elif f == F_MEDIUM:
            if _medium(s, r, e) < 0:
                return -1
        elif f == F_SIZE:
            if _block_size(r, e) < 0:
                return -1
        elif f == F_PARENT:
            if _nil_or_u64(r, &e.parent, &e.has_parent) < 0:
                return -1
        elif f == F_TOKENS:
            if _raw_tokens(r, base, e) < 0:
                return -1
        elif e.kind == SCAN_STORED and _is(txt, n, b"lora_name", 9):
            if _label(s, r, False) < 0:
                return -1
        elif e.kind == SCAN_STORED and _is(txt, n, b"extra_keys", 10):
            if _label(s, r, True) < 0:
                return -1
        elif _skip(r) < 0:
            return -1
    if e.kind == SCAN_CLEARED:
        return 0
    if not seen & F_HASHES or (e.kind == SCAN_STORED and not seen & F_SIZE):
        return -1
    if not seen & F_MEDIUM and _medium_id(s, _GPU, e) < 0:
        return -1
    return 0


# Array-encoded events name their fields by position; later vLLM releases append fields (up to 15
# for a stored event so far), which the decoder's typed structs ignore, and so does the reader.
DEF MAX_ARRAY_FIELDS = 32


cdef int _skip_n(Reader* r, uint64_t n) noexcept:
    cdef uint64_t i
    for i in range(n):
        if _skip(r) < 0:
            return -1
    return 0


cdef int _array_event(KvScan s, Reader* r, const uint8_t* base, ScanEvent* e) except -2:
    cdef uint64_t fields, n
    cdef const uint8_t* txt
    if _array(r, &fields) < 0 or fields == 0 or _str(r, &txt, &n) < 0:
        return -1
    if _is(txt, n, b"BlockStored", 11):
        # [tag, block_hashes, parent_block_hash, token_ids, block_size, lora_id?, medium?,
        #  lora_name?, extra_keys?, then fields the exporter does not read (group_idx, …)]
        e.kind = SCAN_STORED
        if fields < 5 or fields > MAX_ARRAY_FIELDS or _hashes_into(s, r, e) < 0 \
                or _nil_or_u64(r, &e.parent, &e.has_parent) < 0 or _raw_tokens(r, base, e) < 0 or _block_size(r, e) < 0:
            return -1
        if fields > 5 and _skip(r) < 0:
            return -1
        if (_medium(s, r, e) if fields > 6 else _medium_id(s, _GPU, e)) < 0:
            return -1
        if fields > 7 and _label(s, r, False) < 0:
            return -1
        if fields > 8 and _label(s, r, True) < 0:
            return -1
        return _skip_n(r, fields - 9) if fields > 9 else 0
    if _is(txt, n, b"BlockRemoved", 12):
        # [tag, block_hashes, medium?, then fields the exporter does not read (group_idx, …)]
        e.kind = SCAN_REMOVED
        if fields > MAX_ARRAY_FIELDS or _hashes_into(s, r, e) < 0:
            return -1
        if (_medium(s, r, e) if fields > 2 else _medium_id(s, _GPU, e)) < 0:
            return -1
        return _skip_n(r, fields - 3) if fields > 3 else 0
    if _is(txt, n, b"AllBlocksCleared", 16):
        e.kind = SCAN_CLEARED
        return 0 if fields == 1 else -1
    return -1


def scan_kv_batch(bytes payload, batch_cls=None, worker=None, seq=None):
    """The batch as a :class:`KvScan`, or None when it is not the common well-formed shape (see
    above: the decoder's own path then reads it). With ``batch_cls`` (``kvcodec.ScannedBatch``):
    an instance of it for ``worker`` and ``seq`` holding the scan, its slots filled in C."""
    cdef KvScan s = KvScan.__new__(KvScan)
    cdef const uint8_t* base = <const uint8_t*><const char*>payload
    cdef Reader r
    cdef uint64_t top, nev, i, v
    cdef uint8_t b
    cdef bint negative, maps = False
    cdef double ts
    cdef uint64_t bits
    cdef ScanEvent* e
    cdef float f32
    cdef uint32_t b32
    cdef int rc
    r.p, r.end = base, base + len(payload)
    if len(payload) >= (<Py_ssize_t>1 << 32) or _array(&r, &top) < 0 or not (top == 2 or top == 3) or r.p >= r.end:
        return None
    b = r.p[0]
    if b == 0xcb and r.end - r.p >= 9:
        bits = _be(r.p + 1, 8)
        memcpy(&ts, &bits, 8)
        r.p += 9
    elif b == 0xca and r.end - r.p >= 5:
        b32 = <uint32_t>_be(r.p + 1, 4)
        memcpy(&f32, &b32, 4)
        ts = f32
        r.p += 5
    else:
        return None
    if not (ts - ts == 0.0):  # NaN or infinite: the decoder's path words the error
        return None
    s.ts = ts
    if _array(&r, &nev) < 0 or nev > <uint64_t>(r.end - r.p):
        return None
    if nev:
        s.ev = <ScanEvent*>calloc(nev, sizeof(ScanEvent))
        if s.ev == NULL:
            raise MemoryError()
        s.cap = <Py_ssize_t>nev
        maps = r.p < r.end and (r.p[0] & 0xf0 == 0x80 or r.p[0] == 0xde or r.p[0] == 0xdf)
    for i in range(nev):
        e = &s.ev[i]
        rc = _map_event(s, &r, base, e) if maps else _array_event(s, &r, base, e)
        if rc < 0:
            return None
        s.n += 1
        if e.kind == SCAN_STORED and not e.has_parent:
            if e.tlen:
                r2 = Reader(base + e.toff, base + e.toff + e.tlen)
                if _ints_or_nil(&r2) < 0:
                    return None  # token ids msgpack may not read as ints: the decoder's path decides
            s.roots += 1
    s.dp_rank = None
    if top == 3:
        if r.p < r.end and r.p[0] == 0xc0:
            r.p += 1
        elif _int(&r, &v, &negative) == 0:
            s.dp_rank = <int64_t>v if negative else v
        else:
            return None
    if r.p != r.end:
        return None
    s.payload = payload
    if batch_cls is None:
        return s
    o = _new_slotted(<type>batch_cls)
    PyObject_GenericSetAttr(o, "worker", worker)  # the slots' own setters (the class is frozen)
    PyObject_GenericSetAttr(o, "seq", seq)
    PyObject_GenericSetAttr(o, "ts", s.ts)
    PyObject_GenericSetAttr(o, "dp_rank", s.dp_rank)
    PyObject_GenericSetAttr(o, "scan", s)
    PyObject_GenericSetAttr(o, "_events", None)
    PyObject_GenericSetAttr(o, "label_events", None)
    PyObject_GenericSetAttr(o, "attributed", False)
    return o


cdef tuple _ints_tuple(bytes payload, uint32_t off, uint32_t length, Py_ssize_t keep):
    """The first ``keep`` ints of a msgpack array of ints (checked by the reader) as msgpack reads
    them; () for nil or nothing sent."""
    cdef const uint8_t* base = <const uint8_t*><const char*>payload
    cdef Reader r
    cdef uint64_t n, v
    cdef bint negative
    cdef Py_ssize_t i
    cdef tuple out
    cdef object item
    r.p, r.end = base + off, base + off + length
    if length == 0 or _array(&r, &n) < 0:
        return ()
    if keep > <Py_ssize_t>n:
        keep = <Py_ssize_t>n
    out = PyTuple_New(keep)
    for i in range(keep):
        if _int(&r, &v, &negative) < 0:
            raise ValueError("token ids the reader accepted are not ints")
        if negative:
            item = <int64_t>v
        else:
            item = v
        Py_INCREF(item)
        PyTuple_SET_ITEM(out, i, item)
    return out


# ---- Python's hash of ints and tuples of ints, in C (prefix instability's content keys) -----------
# CPython's own definitions (Objects/longobject.c ``long_hash``, Objects/tupleobject.c ``tuplehash``,
# 64-bit builds since 3.8): an int hashes to itself modulo the Mersenne prime 2^61 - 1 (sign kept,
# -1 -> -2), a tuple to an xxHash-style accumulation of its items' hashes. ``_same_hash_as_python``
# compares them with the interpreter's at import; a mismatch turns ``root_keys`` off.
cdef extern from *:
    """
    #define PS_HASH_MODULUS ((uint64_t)0x1FFFFFFFFFFFFFFFULL)
    #define PS_XXPRIME_1 ((uint64_t)11400714785074694791ULL)
    #define PS_XXPRIME_2 ((uint64_t)14029467366897019727ULL)
    #define PS_XXPRIME_5 ((uint64_t)2870177450012600261ULL)
    #define PS_XXLEN_MANGLE ((uint64_t)(2870177450012600261ULL ^ 3527539ULL))
    """
    const uint64_t HASH_MODULUS "PS_HASH_MODULUS"
    const uint64_t XXPRIME_1 "PS_XXPRIME_1"
    const uint64_t XXPRIME_2 "PS_XXPRIME_2"
    const uint64_t XXPRIME_5 "PS_XXPRIME_5"
    const uint64_t XXLEN_MANGLE "PS_XXLEN_MANGLE"


cdef inline uint64_t _int_hash(uint64_t v, bint negative) noexcept nogil:
    """hash(int) of a msgpack int (``negative``: ``v`` is an int64 below 0), as Py_uhash_t."""
    cdef uint64_t h
    if not negative:
        return v % HASH_MODULUS
    h = ((<uint64_t>0) - v) % HASH_MODULUS  # |v| (two's complement), reduced
    h = (<uint64_t>0) - h
    if h == <uint64_t>0xFFFFFFFFFFFFFFFF:
        h = <uint64_t>0xFFFFFFFFFFFFFFFE
    return h


cdef inline uint64_t _xx_round(uint64_t acc, uint64_t lane) noexcept nogil:
    acc += lane * XXPRIME_2
    acc = (acc << 31) | (acc >> 33)
    return acc * XXPRIME_1


cdef inline Py_hash_t _xx_final(uint64_t acc, uint64_t n) noexcept nogil:
    acc += n ^ XXLEN_MANGLE
    if acc == <uint64_t>0xFFFFFFFFFFFFFFFF:
        return 1546275796
    return <Py_hash_t>acc


cdef Py_hash_t _tuple_hash(const uint64_t* lanes, Py_ssize_t n) noexcept nogil:
    """hash() of a tuple whose items hash to ``lanes``."""
    cdef uint64_t acc = XXPRIME_5
    cdef Py_ssize_t i
    for i in range(n):
        acc = _xx_round(acc, lanes[i])
    return _xx_final(acc, <uint64_t>n)


cdef Py_hash_t _pair_hash(Py_hash_t a, Py_hash_t b) noexcept nogil:
    """hash((x, b)) where hash(x) is ``a`` and ``b`` is an int."""
    cdef uint64_t acc = _xx_round(XXPRIME_5, <uint64_t>a)
    acc = _xx_round(acc, _int_hash(<uint64_t>b, b < 0))
    return _xx_final(acc, 2)


cdef int _int_lanes(bytes payload, uint32_t off, uint32_t length, Py_ssize_t keep, uint64_t* lanes) except -1:
    """The hashes of the first ``keep`` ints of a msgpack array of ints (checked by the reader)."""
    cdef const uint8_t* base = <const uint8_t*><const char*>payload
    cdef Reader r
    cdef uint64_t n, v
    cdef bint negative
    cdef Py_ssize_t i
    r.p, r.end = base + off, base + off + length
    if _array(&r, &n) < 0 or <Py_ssize_t>n < keep:
        raise ValueError("token ids the reader accepted are fewer than their count")
    for i in range(keep):
        if _int(&r, &v, &negative) < 0:
            raise ValueError("token ids the reader accepted are not ints")
        lanes[i] = _int_hash(v, negative)
    return 0


def hash_ints(tuple items):
    """hash(items) for a tuple of ints in the int64/uint64 range, computed in C (tests)."""
    cdef Py_ssize_t i, n = PyTuple_GET_SIZE(items)
    cdef uint64_t* lanes = <uint64_t*>malloc((n + 1) * sizeof(uint64_t))
    cdef object x
    if lanes == NULL:
        raise MemoryError()
    try:
        for i in range(n):
            x = <object>PyTuple_GET_ITEM(items, i)
            lanes[i] = _int_hash(<uint64_t>(<int64_t>x), True) if x < 0 else _int_hash(<uint64_t>x, False)
        return _tuple_hash(lanes, n)
    finally:
        free(lanes)


def hash_pair(Py_hash_t inner, Py_hash_t digest):
    """hash((t, digest)) where hash(t) is ``inner`` (tests)."""
    return _pair_hash(inner, digest)


def _same_hash_as_python():
    """This build's hashes equal the interpreter's on samples that exercise every branch."""
    samples = [(), (0,), (1, 2, 3), (-1, -2, 2**63 - 1, -2**63, 2**64 - 1, 2**61 - 1, 2**61, -(2**61 - 1)),
               tuple(range(0, 128000, 997))]
    for t in samples:
        if hash_ints(t) != hash(t):
            return False
        for d in (0, -1, -2, 2**63 - 1, -2**63, 2**61 - 1, -(2**61), hash(t)):
            if hash_pair(hash(t), d) != hash((t, d)):
                return False
    return True


ROOT_KEYS = _same_hash_as_python()


def ints_only(tuple items):
    """True when every item is exactly an ``int`` (not a bool, not a subclass): prefix
    instability's check of a root's token ids, one type comparison per item."""
    cdef Py_ssize_t i
    for i in range(PyTuple_GET_SIZE(items)):
        if type(<object>PyTuple_GET_ITEM(items, i)) is not int:
            return False
    return True
