# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The compiled prefix index: the semantics of ``exporter.prefix_index_ref`` in flat C arrays.

Layout (about 40 bytes per block, whatever the number of workers):

* ``blocks``: one 32-byte ``Block`` per block hash — the hash, the parent as an array index,
  how many blocks name it as parent, and its holders: sorted ``wid << 8 | tiers`` entries
  (worker id, one bit per cache medium), two inline, more in a malloc'd array.
* ``slots``: an open-addressing (linear probing, backward-shift deletion) table of u32 block
  indexes keyed by the mixed 64-bit hash, at most 3/4 full.

A block leaves the tree when its last holder goes; its entry stays, holder-less, while other
blocks still name it as parent, so a child keeps its parent link exactly as the reference's
block -> parent-hash map does (and re-attaches when the parent is stored again).

Tree statistics are kept at apply time where a transition changes them by a known amount —
live children per entry (4 bytes a block), holders -> blocks, children -> branching blocks,
root-level blocks — and read in O(histogram size). Leaf depths and the tree's top are a walk of
the live tree in bounded slices under the caller's lock, without a copy (``StatsWalk`` says why).
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

from exporter.eviction import DEFAULT_MEMORY as DEFAULT_EVICTION_MEMORY, DEFAULT_SAMPLE_EVERY, BatchEvictions
from exporter.model import AllBlocksCleared, BlockRemoved, BlockStored
from exporter.prefix_index_ref import DEFAULT_MEDIUM, MAX_MEDIA, ROOT, ApplyResult, TreeStats

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
DEF FLAG_FREE = 1
DEF FLAG_HIT = 2
DEF INLINE = 2
DEF MAX_WORKERS = 65535
DEF MAX_KEEP = 16  # radix edges of the tree's top recorded by a pass (the API's deepest request)
DEF WALK_SLICE = 1 << 16  # entries (and walk-up steps) one statistics ``step`` visits: ~0.5 ms at 10 M pairs

assert MAX_MEDIA == NMEDIA, "the reference and the compiled index must allow the same media"


cdef union Holders:
    uint32_t inl[2]
    uint32_t* ext

cdef struct Block:
    uint64_t hash
    int32_t parent   # block index; -1: a root-level block
    uint32_t refs    # blocks whose parent this is (a holder-less entry lives while > 0)
    uint16_t n       # holder entries; 0: not in the tree
    uint16_t cap     # capacity of h.ext; 0 while the entries are inline
    uint32_t flags
    Holders h


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
    return b.h.ext if b.cap else b.h.inl


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
    """The kept runs of a walk as ``first block -> array('Q') of the run`` (runs of two blocks or
    more). Only each run's first and last hash and its length are held (20 bytes a run, where
    the blocks themselves would be 8 bytes each); a run's blocks are read from the live index
    when asked for — up from its last block — so read it under the lock that guards the index.
    A run the tree no longer holds as it was reads as its first block alone."""

    def __init__(self, index, firsts, lasts, lengths):
        self._ix, self._firsts, self._lasts, self._lengths = index, firsts, lasts, lengths

    def _at(self, first):
        if type(first) is not int or first < 0 or first > 0xFFFFFFFFFFFFFFFF:
            return -1
        r = bisect_left(self._firsts, first)
        return r if r < len(self._firsts) and self._firsts[r] == first else -1

    def __getitem__(self, first):
        r = self._at(first)
        if r < 0:
            raise KeyError(first)
        run = self._ix._run_up(self._lasts[r], self._lengths[r])
        return run if run is not None and run[0] == first else array("Q", [first])

    def __contains__(self, first):
        return self._at(first) >= 0

    def __iter__(self):
        return iter(self._firsts)

    def __len__(self):
        return len(self._firsts)


class ChildrenView(Mapping):
    """The kept child lists of a walk as ``ROOT or a branching block -> first blocks of its child
    runs`` (in walk order), over two flat arrays sorted by parent: a list is built when read."""

    def __init__(self, nroot, unders, firsts, nkeys):
        self._nroot, self._unders, self._firsts, self._nkeys = nroot, unders, firsts, nkeys

    def _span(self, key):
        if key == ROOT:
            return (0, self._nroot) if self._nroot else None
        if type(key) is not int or key < 0 or key > 0xFFFFFFFFFFFFFFFF:
            return None
        lo = bisect_left(self._unders, key)
        if lo == len(self._unders) or self._unders[lo] != key:
            return None
        return self._nroot + lo, self._nroot + bisect_right(self._unders, key, lo)

    def __getitem__(self, key):
        span = self._span(key)
        if span is None:
            raise KeyError(key)
        return list(self._firsts[span[0]:span[1]])

    def __contains__(self, key):
        return self._span(key) is not None

    def __iter__(self):
        if self._nroot:
            yield ROOT
        prev = None
        for u in self._unders:
            if u != prev:
                yield u
                prev = u

    def __len__(self):
        return self._nkeys


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


cdef struct KeptRun:  # a run within MAX_KEEP radix edges of the root, as the walk found it
    uint64_t first
    uint64_t last
    uint64_t under      # the branching block it hangs under (unless under_root)
    uint32_t length
    uint16_t edges      # its radix depth
    uint8_t under_root


cdef struct ChildKey:  # a kept run as its parent's child list entry
    uint64_t under
    uint64_t first
    uint32_t seq        # walk order
    uint8_t root


cdef struct RunKey:
    uint64_t first
    uint64_t last
    uint32_t length


cdef int _cmp_u64(const void* a, const void* b) noexcept nogil:
    cdef uint64_t x = (<const uint64_t*>a)[0], y = (<const uint64_t*>b)[0]
    return (x > y) - (x < y)


cdef int _cmp_child(const void* a, const void* b) noexcept nogil:
    """The root's children first, then by parent, each list in walk order."""
    cdef const ChildKey* x = <const ChildKey*>a
    cdef const ChildKey* y = <const ChildKey*>b
    if x.root != y.root:
        return <int>y.root - <int>x.root
    if x.under != y.under:
        return (x.under > y.under) - (x.under < y.under)
    return (x.seq > y.seq) - (x.seq < y.seq)


cdef int _cmp_run(const void* a, const void* b) noexcept nogil:
    return _cmp_u64(a, b)  # by first block (the struct's first field)


cdef class BranchSet:
    """The branching blocks of a walk: a sorted C array of hashes (8 bytes each, no Python int
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


cdef class StatsWalk:
    """One statistics reading of a compiled index: ``step`` under the caller's lock until it
    returns True, then ``to_stats`` (outside the lock).

    The counters the index keeps at apply time (blocks, nodes, root fan-out, fan-outs, replicas)
    are read at the last step, exact at that version. Leaf depths (in blocks and in radix edges),
    the branching blocks and the runs of the tree's top are a walk of the live tree — no copy —
    in slices of a bounded number of entries: a depth is the sum of a path, and one block
    leaving the middle of the tree (or a block gaining its second child) changes the depth of
    every leaf below it, which apply-time upkeep could follow only by visiting that subtree
    (and keeping child links, 8-12 more bytes a block). The walk remembers each visited entry's
    depths (8 bytes an entry while it runs, freed at its end), so every entry is walked up
    from once. Without ingest between steps the result is exact; with ingest, each leaf's
    depths are those of the step that visited it, and a leaf stored or removed meanwhile may
    be missed or counted once more (the next walk is exact again).

    The walk is skipped when the tree's shape is that of the index's latest complete walk (no
    block entered or left the tree since, only holders and tiers changed — replicas, offloads
    between tiers): the reading then reuses that walk and completes in its first step,
    O(histogram size).
    """

    cdef object index          # the CompiledPrefixIndex walked
    cdef StatsWalk src         # the walk whose depths this reading reuses (None: its own)
    cdef bint started
    cdef int64_t shape0, shape1  # the index's shape count at the first and the last step
    cdef int32_t* bdep         # per entry: depth in blocks (0 unknown, -1 on the current walk up)
    cdef int32_t* edep         # per entry: depth in radix edges
    cdef size_t cap
    cdef uint32_t cursor
    cdef int32_t* stack
    cdef size_t stackcap
    cdef Vec leaf_e, leaf_b    # int64 leaves per depth
    cdef Vec branching         # u64 hashes of entries with two or more live children
    cdef Vec kept              # KeptRun
    cdef readonly bint done
    cdef public long version
    cdef object counters       # the apply-time counters at the last step

    def __cinit__(self):
        self.version = -1
        _vec_init(&self.leaf_e, sizeof(int64_t))
        _vec_init(&self.leaf_b, sizeof(int64_t))
        _vec_init(&self.branching, sizeof(uint64_t))
        _vec_init(&self.kept, sizeof(KeptRun))

    def __dealloc__(self):
        self._free_work()
        _vec_free(&self.leaf_e)
        _vec_free(&self.leaf_b)
        _vec_free(&self.branching)
        _vec_free(&self.kept)

    cdef void _free_work(self) noexcept:
        cdef int32_t* bdep = self.bdep
        cdef int32_t* edep = self.edep
        cdef size_t size = self.cap * sizeof(int32_t)
        with nogil:  # unmapping hundreds of megabytes takes milliseconds: let ingest run meanwhile
            _scratch_unmap(bdep, size)
            _scratch_unmap(edep, size)
        free(self.stack)
        self.bdep, self.edep, self.cap, self.stack, self.stackcap = NULL, NULL, 0, NULL, 0

    def step(self, max_blocks=0):
        """Walk the next entries (about ``max_blocks``, 0: ~1 ms worth; call it under the lock
        that guards the index's changes); True once the walk is complete."""
        if self.done:
            return True
        return self.index._stats_walk_step(self, max_blocks)

    def to_stats(self, keep_children_depth=0):
        """The statistics with the runs and child lists of the top ``keep_children_depth`` edges
        (finishing the walk first if steps remain: only without concurrent changes)."""
        if keep_children_depth > MAX_KEEP:
            raise ValueError(f"the compiled index keeps at most {MAX_KEEP} edges of the tree's top")
        while not self.step():
            pass
        self._free_work()
        if self.src is None and self.shape0 == self.shape1:  # the tree kept its shape throughout
            self.index._stats_remember(self)
        src = self if self.src is None else self.src
        return src._build(self.version, self.counters, keep_children_depth)

    cdef object _build(self, long version, dict counters, int keep_children_depth):
        cdef BranchSet branching = BranchSet.__new__(BranchSet)
        branching.data = <uint64_t*>malloc(self.branching.n * sizeof(uint64_t) + 8)
        if not branching.data:
            raise MemoryError()
        if self.branching.n:
            memcpy(branching.data, self.branching.data, self.branching.n * sizeof(uint64_t))
        branching.n = self.branching.n
        with nogil:
            qsort(branching.data, branching.n, sizeof(uint64_t), _cmp_u64)
        children, runs = self._kept_views(keep_children_depth)
        return TreeStats(version=version, leaf_depths=_counter_of(&self.leaf_e, 0),
                         leaf_block_depths=_counter_of(&self.leaf_b, 0), branching=branching,
                         children=children, children_depth=keep_children_depth, runs=runs, **counters)

    cdef tuple _kept_views(self, int keep):
        """The kept runs within ``keep`` edges as a ``ChildrenView`` and a ``RunsView`` (flat arrays
        sorted in C: no Python object per run is held)."""
        cdef size_t i, nc = 0, nr = 0, nroot = 0, nkeys = 0
        cdef KeptRun* k
        cdef ChildKey* ck = <ChildKey*>malloc(self.kept.n * sizeof(ChildKey) + 1)
        cdef RunKey* rk = <RunKey*>malloc(self.kept.n * sizeof(RunKey) + 1)
        cdef carray.array firsts, unders, run_firsts, run_lasts, run_lengths
        try:
            if not (ck and rk):
                raise MemoryError()
            for i in range(self.kept.n):
                k = &(<KeptRun*>self.kept.data)[i]
                if k.edges > keep:
                    continue
                ck[nc].under, ck[nc].first, ck[nc].seq, ck[nc].root = k.under, k.first, <uint32_t>i, k.under_root
                nc += 1
                nroot += k.under_root
                if k.length > 1:
                    rk[nr].first, rk[nr].last, rk[nr].length = k.first, k.last, k.length
                    nr += 1
            with nogil:
                qsort(ck, nc, sizeof(ChildKey), _cmp_child)
                qsort(rk, nr, sizeof(RunKey), _cmp_run)
            firsts = carray.clone(_RUN, nc, zero=False)
            unders = carray.clone(_RUN, nc - nroot, zero=False)
            for i in range(nc):
                firsts.data.as_ulonglongs[i] = ck[i].first
                if i >= nroot:
                    unders.data.as_ulonglongs[i - nroot] = ck[i].under
                    nkeys += i == nroot or ck[i].under != ck[i - 1].under
            run_firsts = carray.clone(_RUN, nr, zero=False)
            run_lasts = carray.clone(_RUN, nr, zero=False)
            run_lengths = carray.clone(_LENGTHS, nr, zero=False)
            for i in range(nr):
                run_firsts.data.as_ulonglongs[i] = rk[i].first
                run_lasts.data.as_ulonglongs[i] = rk[i].last
                run_lengths.data.as_uints[i] = rk[i].length
        finally:
            free(ck)
            free(rk)
        return (ChildrenView(nroot, unders, firsts, nkeys + (nroot > 0)),
                RunsView(self.index, run_firsts, run_lasts, run_lengths))


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
    # placement judgement (``exporter.prefix_index_ref``'s docstring): on while domains are set
    cdef bint pl_on
    cdef int pl_gpu            # tier id of the GPU medium (-1: not seen yet)
    cdef int64_t pl_decisions, pl_hits  # judged so far (a batch's result is the difference)
    cdef uint32_t pl_known     # workers the arrays below were built for
    cdef object pl_dom         # array("i"): per worker id, its domain id (-1: not in the topology)
    cdef object pl_out         # array("b"): per worker id, 1 when excluded (left the pool)
    cdef object pl_buf         # array("I"): two worker-id sets of the intersection walk
    cdef dict _pl_domain_ids   # worker -> domain id
    cdef frozenset _pl_excluded
    cdef public long version
    # statistics kept at apply time (see the statistics section below)
    cdef uint32_t* st_kids     # per entry: live children
    cdef size_t st_kcap
    cdef Vec st_reps           # int64: holders -> blocks in the tree
    cdef Vec st_fan            # int64: live children -> branching blocks in the tree with that many
    cdef int64_t st_root       # blocks in the tree whose parent is the root or out of the tree
    cdef int64_t st_fansum     # live children of the branching blocks in the tree
    cdef int64_t st_shape      # blocks that entered or left the tree so far
    cdef tuple st_last         # (shape, StatsWalk): the latest walk during which the shape held

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
        _vec_init(&self.st_reps, sizeof(int64_t))
        _vec_init(&self.st_fan, sizeof(int64_t))

    def __dealloc__(self):
        cdef uint32_t i
        if self.blocks:
            for i in range(self.nblocks):
                if self.blocks[i].cap:
                    free(self.blocks[i].h.ext)
            _scratch_unmap(self.blocks, self.capblocks * sizeof(Block))
        free(self.slots)
        free(self.res)
        free(self.tres)
        free(self.scratch)
        _scratch_unmap(self.st_kids, self.st_kcap * sizeof(uint32_t))
        _vec_free(&self.st_reps)
        _vec_free(&self.st_fan)

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
        blk.refs = 0
        blk.n = 0
        blk.cap = 0
        blk.flags = 0
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
        if not blocks:
            raise MemoryError()
        _hugepages(blocks, cap * sizeof(Block))
        memcpy(blocks, self.blocks, self.nblocks * sizeof(Block))
        _scratch_unmap(self.blocks, self.capblocks * sizeof(Block))
        self.blocks = blocks
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
        if self.blocks[b].cap:
            free(self.blocks[b].h.ext)
            self.blocks[b].cap = 0
        self.blocks[b].flags = FLAG_FREE
        self.blocks[b].n = 0
        self.blocks[b].parent = <int32_t>self.free_head
        self.free_head = b

    cdef void _release(self, int64_t b) noexcept:
        """Free holder-less entries nobody names as parent, up the parent chain."""
        cdef int64_t p
        cdef int guard = 0
        while b >= 0 and self.blocks[b].n == 0 and self.blocks[b].refs == 0 \
                and not self.blocks[b].flags & FLAG_FREE:
            p = self.blocks[b].parent
            self._unlink(b)
            if p >= 0:
                self.blocks[p].refs -= 1
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
        cdef uint16_t cap = blk.cap if blk.cap else INLINE
        if blk.n == cap:
            if cap >= MAX_WORKERS:
                raise ValueError("more than 65535 workers hold one block")
            cap = 4 if cap == INLINE else (cap * 2 if cap < 32768 else MAX_WORKERS)
            grown = <uint32_t*>malloc(cap * sizeof(uint32_t))
            if not grown:
                raise MemoryError()
            memcpy(grown, _hold(blk), blk.n * sizeof(uint32_t))
            if blk.cap:
                free(blk.h.ext)
            blk.h.ext = grown
            blk.cap = cap
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
        if blk.cap and blk.n <= INLINE:  # back inline: no allocation for one or two holders
            ext = blk.h.ext
            memcpy(blk.h.inl, ext, blk.n * sizeof(uint32_t))
            free(ext)
            blk.cap = 0

    cdef void _leave(self, int64_t b) noexcept:
        """Block ``b`` lost its last holder: it leaves the tree (its hits with it)."""
        self._st_leave(b)  # statistics
        self.live -= 1
        if self.blocks[b].flags & FLAG_HIT:
            self.blocks[b].flags &= ~FLAG_HIT
            self._hits.pop(self.blocks[b].hash, None)
        self._release(b)

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
        cdef uint64_t total = self.nblocks * sizeof(Block) + (self.tmask + 1) * sizeof(uint32_t)
        total += self.nblocks * sizeof(uint32_t) + (self.st_reps.cap + self.st_fan.cap) * sizeof(int64_t)
        cdef uint32_t b
        for b in range(self.nblocks):
            total += self.blocks[b].cap * sizeof(uint32_t)
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
                if p != prev:
                    if prev >= 0:
                        self.blocks[prev].refs += 1
                    self.blocks[b].parent = <int32_t>prev
                    if p >= 0:
                        self.blocks[p].refs -= 1
                        self._release(p)
                self._st_enter(b)  # statistics
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

    cdef void _clear(self, int wid) noexcept:
        cdef uint32_t b
        cdef int pos
        if self.res[wid] == 0:
            return
        for b in range(self.nblocks):
            if self.blocks[b].n:
                pos = self._slot_of(&self.blocks[b], <uint32_t>wid)
                if pos >= 0:
                    self._erase(b, pos)
                    if self.blocks[b].n == 0:
                        self._leave(b)
        self.res[wid] = 0
        memset(self.tres + wid * NMEDIA, 0, NMEDIA * sizeof(int64_t))
        self.version += 1

    def clear_worker(self, worker):
        """Drop every block from one worker's view, on every tier (restart or AllBlocksCleared)."""
        wid = self._wid.get(worker)
        if wid is not None:
            self._clear(wid)

    # ---- placement (``exporter.prefix_index_ref``'s docstring) ------------------------------------
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
        are. tests/exporter/test_prefix_index_equality.py holds the result to the reference's
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
    # Kept at apply time, one call per block-state transition (``_st_*``): live children per
    # entry (``refs`` also counts holder-less children), holders -> blocks, children -> branching
    # blocks, root-level blocks. Reading them is O(histogram size); ``StatsWalk`` adds the depths.
    cdef int _st_grow_kids(self) except -1:
        cdef size_t cap = self.capblocks
        cdef uint32_t* kids = <uint32_t*>_scratch_map(cap * sizeof(uint32_t))
        if not kids:
            raise MemoryError()
        if self.st_kids:
            memcpy(kids, self.st_kids, self.st_kcap * sizeof(uint32_t))
            _scratch_unmap(self.st_kids, self.st_kcap * sizeof(uint32_t))
        self.st_kids, self.st_kcap = kids, cap
        return 0

    cdef inline uint32_t _st_kids_of(self, int64_t b) noexcept:
        return self.st_kids[b] if <size_t>b < self.st_kcap else 0

    cdef int _st_kid(self, int64_t p, int d) noexcept:
        """Entry ``p`` gained (d=1) or lost (d=-1) a live child; -1 when memory ran out."""
        cdef uint32_t before = self.st_kids[p]
        cdef uint32_t after = before + d
        self.st_kids[p] = after
        if self.blocks[p].n:  # fan-outs count branching blocks in the tree only
            if before >= 2:
                (<int64_t*>self.st_fan.data)[before] -= 1
                self.st_fansum -= before
            if after >= 2:
                if _tally(&self.st_fan, after, 1):
                    return -1
                self.st_fansum += after
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

    cdef int _st_enter(self, int64_t b) except -1:
        """Block ``b`` came into the tree, its parent set: the parent gained a live child, and
        b's own live children (kept while it was out) stop hanging off the root."""
        cdef int64_t p = self.blocks[b].parent
        cdef uint32_t k
        self.st_shape += 1
        if self.nblocks > self.st_kcap:
            self._st_grow_kids()
        if p >= 0 and self._st_kid(p, 1):
            raise MemoryError()
        if p < 0 or not self.blocks[p].n:
            self.st_root += 1
        k = self.st_kids[b]
        self.st_root -= k
        if k >= 2:
            if _tally(&self.st_fan, k, 1):
                raise MemoryError()
            self.st_fansum += k
        return 0

    cdef void _st_leave(self, int64_t b) noexcept:
        """Block ``b`` left the tree (before its entry is released): the reverse of ``_st_enter``."""
        cdef int64_t p = self.blocks[b].parent
        cdef uint32_t k = self.st_kids[b]
        self.st_shape += 1
        if p >= 0:
            self._st_kid(p, -1)  # never grows the histogram: it cannot fail
        if p < 0 or not self.blocks[p].n:
            self.st_root -= 1
        self.st_root += k
        if k >= 2:
            (<int64_t*>self.st_fan.data)[k] -= 1
            self.st_fansum -= k

    cdef object _stats_counters(self):
        """The statistics kept at apply time, exact at this version."""
        return dict(nodes=self.st_root + self.st_fansum, blocks=self.live, root_fanout=self.st_root,
                    fanouts=_counter_of(&self.st_fan, 2), replicas=_counter_of(&self.st_reps, 1))

    def stats_pass(self):
        """Start a statistics reading (``StatsWalk``): ``step`` it under the caller's lock until
        it returns True, then ``to_stats``. Walks are independent: nothing is written through."""
        cdef StatsWalk w = StatsWalk.__new__(StatsWalk)
        w.index = self
        return w

    def _stats_walk_step(self, StatsWalk w, Py_ssize_t max_blocks):
        cdef uint32_t nb = self.nblocks, b, k
        cdef size_t cap
        cdef int64_t budget = max_blocks if max_blocks > 0 else WALK_SLICE, work = 0
        cdef int32_t* bdep
        cdef int32_t* edep
        cdef uint64_t h
        if w.index is not self:
            raise RuntimeError("a statistics walk steps over the index that started it")
        if not w.started:
            w.started, w.shape0 = True, self.st_shape
            if self.st_last is not None and self.st_last[0] == self.st_shape:  # the shape held: reuse
                w.src = self.st_last[1]
                w.shape1, w.version, w.counters, w.done = self.st_shape, self.version, self._stats_counters(), True
                return True
        if nb > w.cap:  # first step, or the index grew past the walk's address space
            # Address space for twice the block array: pages are taken only as the walk touches
            # them, and a regrowth (a copy of the depths so far, under the lock) needs the index
            # to more than double during one walk.
            cap = <size_t>self.capblocks * 2 + 1024
            bdep = <int32_t*>_scratch_map(cap * sizeof(int32_t))
            edep = <int32_t*>_scratch_map(cap * sizeof(int32_t))
            if not (bdep and edep):
                _scratch_unmap(bdep, cap * sizeof(int32_t))
                _scratch_unmap(edep, cap * sizeof(int32_t))
                raise MemoryError()
            if w.cap:
                memcpy(bdep, w.bdep, w.cap * sizeof(int32_t))
                memcpy(edep, w.edep, w.cap * sizeof(int32_t))
                _scratch_unmap(w.bdep, w.cap * sizeof(int32_t))
                _scratch_unmap(w.edep, w.cap * sizeof(int32_t))
            w.bdep, w.edep, w.cap = bdep, edep, cap
        b = w.cursor
        while b < nb and work < budget:
            work += 1
            k = self._st_kids_of(b)
            if k >= 2:  # branching, in the tree or not (as the reference counts it)
                h = self.blocks[b].hash
                if _push(&w.branching, &h):
                    raise MemoryError()
            if self.blocks[b].n:
                if w.bdep[b] == 0:
                    work += self._walk_depth(w, b)
                if k == 0 and (_tally(&w.leaf_e, w.edep[b], 1) or _tally(&w.leaf_b, w.bdep[b], 1)):
                    raise MemoryError()
                if k != 1 and w.edep[b] <= MAX_KEEP:  # a run's end within the kept top
                    work += self._walk_keep(w, b)
            b += 1
        w.cursor = b
        if b < nb:
            return False
        w.shape1, w.version, w.counters, w.done = self.st_shape, self.version, self._stats_counters(), True
        return True  # the working memory goes in ``to_stats``, outside the lock (unmapping takes ms)

    def _stats_remember(self, StatsWalk w):
        """A complete walk during which the shape held: later readings at that shape reuse it."""
        self.st_last = (w.shape1, w)

    cdef int64_t _walk_depth(self, StatsWalk w, uint32_t b) except -1:
        """Depths of ``b`` and of its ancestors not yet known: up to a known one, a run hanging
        off the root or a parent cycle (colliding hashes: it ends where the walk meets itself),
        then back down. Returns the entries visited."""
        cdef int32_t* bdep = w.bdep
        cdef int32_t* edep = w.edep
        cdef size_t sp = 0, visited
        cdef int64_t p
        cdef uint32_t x = b
        cdef int32_t* grown
        while True:
            if sp == w.stackcap:
                grown = <int32_t*>realloc(w.stack, (w.stackcap * 2 + 64) * sizeof(int32_t))
                if not grown:
                    raise MemoryError()
                w.stack, w.stackcap = grown, w.stackcap * 2 + 64
            w.stack[sp] = x
            sp += 1
            bdep[x] = -1
            p = self.blocks[x].parent
            if p < 0 or not self.blocks[p].n or bdep[p] != 0:
                break
            x = <uint32_t>p
        visited = sp
        while sp:
            sp -= 1
            x = w.stack[sp]
            p = self.blocks[x].parent
            if p < 0 or not self.blocks[p].n or bdep[p] < 0:
                bdep[x] = 1
                edep[x] = 1
            else:
                bdep[x] = bdep[p] + 1
                edep[x] = edep[p] + (1 if self._st_kids_of(p) > 1 else 0)
        return visited

    cdef int64_t _walk_keep(self, StatsWalk w, uint32_t b) except -1:
        """Record the run ending at ``b`` (up to its start; the length bound cuts a parent cycle)."""
        cdef KeptRun r
        cdef uint32_t x = b, nb = self.nblocks
        cdef int64_t p
        cdef uint32_t length = 1
        cdef bint root_run
        while True:
            p = self.blocks[x].parent
            if p < 0 or not self.blocks[p].n or self._st_kids_of(p) > 1 or <uint32_t>p == b or length > nb:
                break
            x = <uint32_t>p
            length += 1
        root_run = p < 0 or not self.blocks[p].n or <uint32_t>p == b
        r.first, r.last, r.length = self.blocks[x].hash, self.blocks[b].hash, length
        r.under = 0 if root_run else self.blocks[p].hash
        r.edges, r.under_root = <uint16_t>w.edep[b], root_run
        if _push(&w.kept, &r):
            raise MemoryError()
        return length

    def _run_up(self, last, uint32_t length):
        """The ``length`` blocks ending at ``last``, read up its parent links, first to last
        (None when the tree no longer links them so)."""
        cdef int64_t b = self._find(_u64(last))
        cdef carray.array out = carray.clone(_RUN, length, zero=False)
        cdef uint32_t j
        for j in range(length, 0, -1):
            if b < 0 or not self.blocks[b].n:
                return None
            out.data.as_ulonglongs[j - 1] = self.blocks[b].hash
            b = self.blocks[b].parent
        return out

    def stats(self, keep_children_depth=0):
        """The statistics of the current tree, synchronously (tests and offline tools)."""
        return self.stats_pass().to_stats(keep_children_depth)


# ---- eviction lifecycle ---------------------------------------------------------------------------
# The semantics of ``exporter.eviction.EvictionTracker`` (the reference; read its docstring for the
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
    """``exporter.eviction.EvictionTracker`` in C: same interface, same results (the equality
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
    """``exporter.model`` events from ``exporter.kvcodec``'s typed structs, their slots filled in C
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
# subset of what ``exporter.kvcodec``'s typed path accepts and reads the same values from it (the
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
    PyObject_GenericSetAttr(o, "raw_events", None)
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
