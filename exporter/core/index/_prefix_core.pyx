# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The compiled prefix index: the semantics of ``exporter.core.index.prefix_index_ref`` in flat C arrays.

Layout (about 48 bytes per block, whatever the number of workers):

* ``blocks``: one 32-byte ``Block`` per block hash — the hash, the parent as an array index,
  its live children, the next entry of its parent's child list, and its holders: sorted
  ``wid << 8 | tiers`` entries (worker id, one bit per cache medium), two inline, more in a
  malloc'd array.
* ``ties``: 16 bytes per entry beside it — the first entry of its child list, the previous one
  in its parent's list, its depths (see the statistics section of ``CompiledPrefixIndex``) and
  the fingerprint of its path from the root (``longest_match``'s binary search checks it).
* ``slots``: an open-addressing (linear probing, backward-shift deletion) table keyed by the
  mixed 64-bit hash, at most 3/4 full: per slot a u32 of a 27-bit block index and how far it sits
  past its home slot (5 bits, saturating), so a removal's shift reads no entry.

None of them grows in one step that costs time in proportion to its size (``_index_table.pxi``):
the entry arrays grow inside address space reserved for them, and a doubled hash table is
filled from the old one a few slots per entry added.

A block leaves the tree when its last holder goes; its entry stays, holder-less, while other
entries still name it as parent (its child list is not empty), so a child keeps its parent link
exactly as the reference's block -> parent-hash map does (and re-attaches when the parent is
stored again).

Every tree statistic is kept at apply time — holders -> blocks, children -> branching blocks,
root-level blocks, the branching set, and each block's depth in blocks and in radix edges with
the two leaf-depth histograms — so a reading is O(histogram + branching set), with no walk of
the tree; the top of the tree is read from the live index through the child lists.

One extension module in files by job, ``include``d at the end of this one (as msgpack-python
builds its ``_cmsgpack``): this file holds the imports, the constants and the entry layout, and
the helpers every part uses; ``_index_readings.pxi``, ``_index_table.pxi`` and ``_index.pxi`` the index,
``_eviction.pxi`` the eviction tracker, ``_kv_scan.pxi``, ``_kv_events.pxi`` and
``_kv_reader.pxi`` the reading of KV batches, ``_pyhash.pxi`` Python's hash in C.
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

from exporter.core.index.eviction import DEFAULT_MEMORY as DEFAULT_EVICTION_MEMORY, DEFAULT_SAMPLE_EVERY, BatchEvictions, far_sample
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
DEF FLAG_OPEN = 32   # a child has a holder this block lacks, or it is wide: a chain's walk steps past it
DEF FLAG_WIDE = 64   # too many children to count a worker's among them: always treated as open
DEF WALK_KIDS = 64   # children a holder change counts through before the block is called wide
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
    uint32_t fp      # fingerprint of its path through the parent links: ``_fp_of(parent's fp, hash)``


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
    malloc, glibc would keep freed arrays in the heap): the entry arrays and the hash tables."""
    cdef void* p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
    return NULL if p == MAP_FAILED else p


cdef void _scratch_unmap(void* p, size_t size) noexcept nogil:
    if p != NULL:
        munmap(p, size)


cdef Py_ssize_t _binary_from = 32  # chains this long (or longer) take longest_match's binary search


def set_binary_from(Py_ssize_t blocks):
    """(tests and the bench) The chain length from which ``longest_match`` searches by halves
    where that is exact; 0 or 1: always, a huge number: never (the walk block by block)."""
    global _binary_from
    previous, _binary_from = _binary_from, blocks
    return previous


DEF INTS_AHEAD = 64  # longest_match reads a chain's int objects this far ahead of converting them
DEF AHEAD = 16  # longest_match fetches the table slot this many blocks ahead, the block half as far


cdef inline uint64_t _mix(uint64_t x) nogil:
    x ^= x >> 30
    x *= <uint64_t>0xbf58476d1ce4e5b9
    x ^= x >> 27
    x *= <uint64_t>0x94d049bb133111eb
    x ^= x >> 31
    return x


DEF FP_ROOT = 0x2545F491  # the fingerprint a root-level block's path starts from


cdef inline uint32_t _fp_of(uint32_t parent_fp, uint64_t h) nogil:
    """The path fingerprint of a block under a parent with fingerprint ``parent_fp``: a polynomial
    in the path's mixed hashes (order matters), so a chain's fingerprints cost one multiply-add
    a block in sequence, the mixing of each hash running ahead of it."""
    return parent_fp * <uint32_t>0x01000193 + <uint32_t>((h * <uint64_t>0x9E3779B97F4A7C15) >> 32)


cdef extern from *:
    """
    /* A non-negative int of up to three digits read straight from its digits (CPython before
       3.12, whose int layout this is); 0: take the C API's path. */
    static inline int pfx_u64_digits(PyObject* o, uint64_t* out) {
    #if !defined(PYPY_VERSION) && PY_VERSION_HEX < 0x030C0000
        if (PyLong_CheckExact(o)) {
            const digit* d = ((PyLongObject*)o)->ob_digit;
            switch (Py_SIZE(o)) {
            case 0: *out = 0; return 1;
            case 1: *out = (uint64_t)d[0]; return 1;
            case 2: *out = (uint64_t)d[0] | ((uint64_t)d[1] << PyLong_SHIFT); return 1;
            case 3: *out = (uint64_t)d[0] | ((uint64_t)d[1] << PyLong_SHIFT)
                           | ((uint64_t)d[2] << (2 * PyLong_SHIFT)); return 1;
            }
        }
    #endif
        (void)o; (void)out;
        return 0;
    }
    """
    bint _u64_digits "pfx_u64_digits"(PyObject* o, uint64_t* out) noexcept


cdef inline uint64_t _u64(object h) except? 0xFFFFFFFFFFFFFFFF:
    """A block hash as the decoder gives it: an int folded to 64 bits (the low 64 bits of its
    two's complement, as ``PyLong_AsUnsignedLongLongMask`` reads it; the common sizes read from
    the int's digits, which is most of a long chain's lookup)."""
    cdef uint64_t v
    if _u64_digits(<PyObject*>h, &v):
        return v
    v = PyLong_AsUnsignedLongLongMask(h)
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


# ---- the module's parts, by job -------------------------------------------------------------------
# ``include`` is textual: one extension module, its C the same as one file's. The order matters for
# declarations only: a DEF, a struct or a cdef class used as a type comes before its first use
# (cdef functions may be called from anywhere in the module).
include "_kv_scan.pxi"         # a KV batch as the reader leaves it (KvScan), and what it gives its readers
include "_index_readings.pxi"  # matches, statistics readings and the index's small containers
include "_index_table.pxi"     # the index's entry arrays and hash table, grown a bounded step per apply
include "_index.pxi"           # the prefix index (CompiledPrefixIndex)
include "_eviction.pxi"        # eviction lifecycle (CompiledEvictionTracker)
include "_kv_events.pxi"       # model events from the decoder's typed structs; per-batch result objects
include "_kv_reader.pxi"       # KV batches read straight from the payload (scan_kv_batch)
include "_pyhash.pxi"          # Python's hash of ints and tuples of ints (prefix instability's keys)
