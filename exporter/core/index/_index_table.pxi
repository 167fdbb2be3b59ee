# ---- the prefix index's storage: entry arrays and hash table, grown without a stall ---------------
# Part of ``_prefix_core.pyx``, which ``include``s it: one extension module, its names the module's
# (the DEFs, structs and types it uses are declared in the files included before it).
#
# ``apply`` runs under the exporter's state lock with the GIL held, so no growth step may cost
# time in proportion to the index: at 17 M blocks, copying the entry arrays to a 1.5x mapping
# held both for 1.6 s, and doubling the hash table rehashed every entry in one go.
#
# * The entry arrays (``blocks``, ``ties``) live, once past ``RESERVE_AT`` entries, in address
#   space reserved up front for ``RESERVE_ENTRIES`` (PROT_NONE, no memory committed, none
#   touched): growing them is an ``mprotect`` of the next part, and no entry moves. Only the
#   one move into the reservation copies (at most ``RESERVE_AT`` entries). Where the address space
#   cannot be reserved (an RLIMIT_AS, say), each growth copies as before.
# * The hash table doubles into a zeroed mapping (a slot holds a complement, ``_slot``, so zero
#   reads as EMPTY and the new table needs no fill), and the old one drains into it incrementally:
#   ``DRAIN_PER_ADD`` old slots per entry added and ``DRAIN_SLICE`` per ``apply``, which empties
#   it long before the new table is 3/4 full. Meanwhile every entry is in exactly one of the two:
#   a lookup probes the new table, then the old; a moved or deleted old slot becomes a tombstone
#   (probes pass it), so the old table's probe chains stay whole until it is dropped. The drained
#   table is unmapped ``RETIRE_SLICE`` bytes per ``apply`` (unmapping 4 KiB pages costs about
#   their number).
# * The memory itself: a page's first touch costs a fault, and for a huge page that means zeroing
#   2 MiB and at times compacting memory first: 15-20 ms each on a freshly booted VM, so the
#   ``apply`` that touches one would hold the lock that long. Memory is therefore first touched as
#   4 KiB pages, and huge pages are asked for only on ranges already touched, which the kernel's
#   khugepaged collapses in the background (lookups are random accesses over hundreds of
#   megabytes; with 4 KiB pages most of them also miss the TLB). The entry arrays are touched in
#   order, a few pages per ``apply``. The next hash table would be touched all over at once by
#   the first lookups and moves after a doubling, so it is mapped shortly before (at ``NEXT_AT``,
#   47/64 full) and its pages are touched ahead, in step with the entries added (``_tb_tend``),
#   before it takes over. The pace costs one 4 KiB page fault per 8 entries added in that last
#   sixty-fourth; mapped at 5/8 full, the table would take three times its size over a third of
#   the blocks between two doublings, to save faults that cost nothing measurable.


DEF RESERVE_AT = 1 << 16  # entries past which the entry arrays move into reserved address space
DEF RESERVE_ENTRIES = 1 << 27  # entries that address space is reserved for (6 GiB: 32 B + 16 B each)
DEF MAX_ENTRIES = (1 << 27) - 16  # entry indexes take a slot's low 27 bits (the top values: empty, deleted)
DEF SLOT_ENTRY = (1 << 27) - 1  # a slot's entry bits; above them, how far the entry sits from its home slot
DEF SLOT_DIST_SHIFT = 27
DEF SLOT_DIST_MAX = 31  # a distance this large (or larger) is read from the entry's hash instead
DEF DRAIN_PER_ADD = 4  # old-table slots moved per entry added (the drain ends after a quarter of the old size)
DEF DRAIN_SLICE = 256  # old-table slots moved per ``apply`` besides (drains while entries are only removed)
DEF RETIRE_SLICE = 4 << 20  # bytes of a drained table unmapped per ``apply``
DEF TOUCH_AHEAD = 256 << 10  # bytes of the next table touched per ``apply`` beyond its pace
DEF NEXT_AT = 47  # sixty-fourths of the slots in use at which the next table is mapped (doubling at 48)
DEF HUGE = 2 << 20  # a huge page (ranges advised are whole ones)
DEF RUN_AHEAD = 8  # entries of a hash's probe run fetched ahead of a batch's apply

cdef extern from *:
    """
    #define PFX_TOMB ((uint32_t)0xFFFFFFFEu)
    """
    const uint32_t TOMB "PFX_TOMB"  # a slot of a draining table whose entry moved or left

cdef extern from "sys/mman.h":
    int mprotect(void* addr, size_t length, int prot) nogil
    int PROT_NONE, MAP_NORESERVE


cdef inline uint32_t _slot(uint32_t b, uint64_t dist) noexcept nogil:
    """What a slot holds for entry ``b`` placed ``dist`` slots past its home slot: ``~(dist << 27 | b)``
    (0 reads as EMPTY; the distance saturates at ``SLOT_DIST_MAX``). A removal's backward shift
    reads each following entry's home from its slot, not from the entry's hash: no cache miss."""
    return ~((<uint32_t>(dist if dist < SLOT_DIST_MAX else SLOT_DIST_MAX) << SLOT_DIST_SHIFT) | b)


cdef struct Table:
    uint32_t* slots   # ``_slot(entry, distance from home)`` per slot (0: EMPTY), linear probing, backward-shift deletion
    uint64_t mask     # slots - 1
    uint32_t* old     # the table before the last doubling while it drains (NULL: none)
    uint64_t omask
    uint64_t opos     # old slots before this one have been moved
    uint64_t used     # entries in the two tables
    uint64_t moved    # entries moved from an old table so far
    uint32_t* next    # the table for the next doubling, mapped ahead (NULL: none yet)
    size_t ntouched   # bytes of it touched so far
    uint64_t nfrom    # ``used`` when it was mapped
    char* retired     # the rest of a drained table, unmapped a slice per apply (NULL: none)
    size_t rsize


cdef int _tb_init(Table* t, uint64_t size) noexcept nogil:
    memset(t, 0, sizeof(Table))
    t.slots = <uint32_t*>_scratch_map(size * sizeof(uint32_t))
    t.mask = size - 1
    return 0 if t.slots != NULL else -1


cdef void _tb_free(Table* t) noexcept nogil:
    _scratch_unmap(t.slots, (t.mask + 1) * sizeof(uint32_t))
    if t.old != NULL:
        _scratch_unmap(t.old, (t.omask + 1) * sizeof(uint32_t))
    if t.next != NULL:
        _scratch_unmap(t.next, (t.mask + 1) * 2 * sizeof(uint32_t))
    if t.retired != NULL:
        _scratch_unmap(t.retired, t.rsize)
    t.slots, t.old, t.next, t.retired = NULL, NULL, NULL, NULL


cdef inline bint _same_home(uint32_t s, uint64_t dist) noexcept nogil:
    """Whether the entry slot ``s`` holds may have the home slot ``dist`` slots back (the slot keeps
    its entry's distance from home): only such an entry can be the hash looked up, so a probe reads
    no other entry of its run (each would be a cache miss in a large index). A saturated distance
    says only "this far or further"."""
    cdef uint64_t d = s >> SLOT_DIST_SHIFT
    return d == dist or (d == SLOT_DIST_MAX and dist > SLOT_DIST_MAX)


cdef int64_t _tb_find_old(const Table* t, const Block* blocks, uint64_t h, uint64_t mixed) noexcept nogil:
    cdef uint64_t i = mixed & t.omask
    cdef uint64_t dist = 0
    cdef uint32_t s
    while True:
        s = ~t.old[i]
        if s == EMPTY:
            return -1
        if s != TOMB and _same_home(s, dist) and blocks[s & SLOT_ENTRY].hash == h:
            return s & SLOT_ENTRY
        i = (i + 1) & t.omask
        dist += 1


cdef inline int64_t _tb_find(const Table* t, const Block* blocks, uint64_t h) noexcept nogil:
    """The entry of hash ``h``, or -1."""
    cdef uint64_t m = _mix(h)
    cdef uint64_t i = m & t.mask
    cdef uint64_t dist = 0
    cdef uint32_t s
    while True:
        s = ~t.slots[i]
        if s == EMPTY:
            break
        if _same_home(s, dist) and blocks[s & SLOT_ENTRY].hash == h:
            return s & SLOT_ENTRY
        i = (i + 1) & t.mask
        dist += 1
    return -1 if t.old == NULL else _tb_find_old(t, blocks, h, m)


cdef inline int64_t _tb_probe(const Table* t, const Block* blocks, uint64_t h, uint64_t* empty) noexcept nogil:
    """``_tb_find``, and where ``h`` would go in the current table when it is not there."""
    cdef uint64_t m = _mix(h)
    cdef uint64_t i = m & t.mask
    cdef uint64_t dist = 0
    cdef uint32_t s
    while True:
        s = ~t.slots[i]
        if s == EMPTY:
            break
        if _same_home(s, dist) and blocks[s & SLOT_ENTRY].hash == h:
            return s & SLOT_ENTRY
        i = (i + 1) & t.mask
        dist += 1
    empty[0] = i
    return -1 if t.old == NULL else _tb_find_old(t, blocks, h, m)


cdef inline int64_t _tb_hint(const Table* t, uint64_t h) noexcept nogil:
    """The first entry of the current table that a probe for ``h`` would compare (-1: none), to
    fetch ahead: reads the slots of its run only (a hint; usually the entry itself)."""
    cdef uint64_t i = _mix(h) & t.mask
    cdef uint64_t dist = 0
    cdef uint32_t s
    while True:
        s = ~t.slots[i]
        if s == EMPTY:
            return -1
        if _same_home(s, dist):
            return s & SLOT_ENTRY
        i = (i + 1) & t.mask
        dist += 1


cdef inline void _tb_prefetch_run(const Table* t, const Block* blocks, const Tie* ties, uint64_t h) noexcept nogil:
    """Fetch ahead the entries (and their ties) a probe for ``h`` compares in the current table:
    those of its run from ``h``'s home slot that share that home, up to ``RUN_AHEAD`` slots or the
    first empty one (a new hash's: usually none)."""
    cdef uint64_t i = _mix(h) & t.mask
    cdef uint32_t s
    cdef uint64_t k
    for k in range(RUN_AHEAD):
        s = ~t.slots[i]
        if s == EMPTY:
            return
        if _same_home(s, k):
            s &= SLOT_ENTRY
            __builtin_prefetch(&blocks[s])
            __builtin_prefetch(&ties[s])
        i = (i + 1) & t.mask


cdef void _tb_drain(Table* t, const Block* blocks, uint64_t n) noexcept nogil:
    """Move up to ``n`` old slots' entries into the current table; drop the old one once empty."""
    cdef uint32_t s
    cdef uint64_t i, home
    while n and t.old != NULL:
        n -= 1
        s = ~t.old[t.opos]
        if s != EMPTY and s != TOMB:
            s &= SLOT_ENTRY
            home = _mix(blocks[s].hash) & t.mask
            i = home
            while t.slots[i]:
                i = (i + 1) & t.mask
            t.slots[i] = _slot(s, (i - home) & t.mask)
            t.old[t.opos] = ~TOMB
            t.moved += 1
        t.opos += 1
        if t.opos > t.omask:  # drained: unmapped by ``_tb_tend``, a slice per apply
            if t.retired != NULL:  # not reached (a drain takes far longer than a retirement); kept safe
                _scratch_unmap(t.retired, t.rsize)
            t.retired, t.rsize = <char*>t.old, (t.omask + 1) * sizeof(uint32_t)
            t.old = NULL


cdef void _tb_touch(Table* t, size_t upto) noexcept nogil:
    """Touch the next table's pages up to byte ``upto`` (zero pages stay zero: EMPTY)."""
    cdef size_t size = (t.mask + 1) * 2 * sizeof(uint32_t)
    cdef size_t off
    if upto > size:
        upto = size
    off = t.ntouched
    while off < upto:
        (<char*>t.next)[off] = 0
        off += 4096
    if upto > t.ntouched:
        t.ntouched = upto
        if upto == size:
            _advise_touched(t.next, size)


cdef void _tb_tend(Table* t, const Block* blocks) noexcept nogil:
    """The end of an ``apply``: a slice of the drain, of the next table's pages (its share of them
    for the entries added since it was mapped, and ``TOUCH_AHEAD`` bytes more), of a retirement."""
    cdef size_t size, span, step
    if t.old != NULL:
        _tb_drain(t, blocks, DRAIN_SLICE)
    if t.next != NULL and t.used > t.nfrom:
        size = (t.mask + 1) * 2 * sizeof(uint32_t)
        span = (t.mask + 1) * 3 // 4 - t.nfrom  # entries added from its mapping to its use
        _tb_touch(t, <size_t>(<double>size * (t.used - t.nfrom) / (span if span else 1)) + TOUCH_AHEAD)
    if t.retired != NULL:
        step = t.rsize if t.rsize < RETIRE_SLICE else RETIRE_SLICE
        munmap(t.retired + t.rsize - step, step)
        t.rsize -= step
        if t.rsize == 0:
            t.retired = NULL


cdef int _tb_added(Table* t, const Block* blocks, uint64_t slot, uint32_t b) noexcept nogil:
    """Put new entry ``b`` in the slot ``_tb_probe`` gave, drain a little; map the next table at
    47/64 full, double into it at 3/4 (-1: no memory for it; the entry is in all the same)."""
    cdef uint64_t size = (t.mask + 1) * 2
    t.slots[slot] = _slot(b, (slot - (_mix(blocks[b].hash) & t.mask)) & t.mask)
    t.used += 1
    if t.old != NULL:
        _tb_drain(t, blocks, DRAIN_PER_ADD)
    if t.used * 64 < (t.mask + 1) * NEXT_AT:
        return 0
    if t.next == NULL:
        t.next = <uint32_t*>_scratch_map(size * sizeof(uint32_t))
        if t.next == NULL:
            return -1
        t.ntouched, t.nfrom = 0, t.used
    if t.used * 4 < (t.mask + 1) * 3:
        return 0
    if t.old != NULL:  # not reached (the drain ends near half full); kept safe
        _tb_drain(t, blocks, t.omask + 1)
    _tb_touch(t, size * sizeof(uint32_t))  # what ``_tb_tend`` has not touched yet (usually nothing)
    t.old, t.omask, t.opos = t.slots, t.mask, 0
    t.slots, t.mask, t.next = t.next, size - 1, NULL
    return 0


cdef void _tb_remove(Table* t, const Block* blocks, uint32_t b) noexcept nogil:
    """Take entry ``b`` out of whichever table holds it."""
    cdef uint64_t m = _mix(blocks[b].hash)
    cdef uint64_t i = m & t.mask
    cdef uint64_t j, k, d
    cdef uint32_t s
    while True:
        s = ~t.slots[i]
        if s == EMPTY:  # in the draining table: a tombstone keeps its probe chains whole
            i = m & t.omask
            while (~t.old[i]) == TOMB or ((~t.old[i]) & SLOT_ENTRY) != b:
                i = (i + 1) & t.omask
            t.old[i] = ~TOMB
            t.used -= 1
            return
        if (s & SLOT_ENTRY) == b:
            break
        i = (i + 1) & t.mask
    j = i
    while True:
        j = (j + 1) & t.mask
        if not t.slots[j]:
            break
        s = ~t.slots[j]
        d = s >> SLOT_DIST_SHIFT
        # its home: from the distance the slot keeps (the entry's hash only when that saturated)
        k = ((j - d) & t.mask) if d < SLOT_DIST_MAX else (_mix(blocks[s & SLOT_ENTRY].hash) & t.mask)
        # move slot j back to the hole at i unless its home k lies cyclically in (i, j]
        if (j > i and (k <= i or k > j)) or (j < i and (k <= i and k > j)):
            t.slots[i] = _slot(s & SLOT_ENTRY, (i - k) & t.mask)
            i = j
    t.slots[i] = 0
    t.used -= 1


cdef void* _span_map(size_t span, size_t commit) noexcept nogil:
    """``commit`` bytes of zeroed memory at the start of ``span`` bytes of address space reserved
    for it (nothing committed beyond ``commit``); NULL if either cannot be had."""
    cdef void* p
    if span <= commit:
        return _scratch_map(commit)
    p = mmap(NULL, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
    if p == MAP_FAILED:
        return NULL
    if mprotect(p, commit, PROT_READ | PROT_WRITE):
        munmap(p, span)
        return NULL
    return p


cdef void _advise_touched(void* p, size_t size) noexcept nogil:
    """Huge pages for the whole huge pages of ``p[:size]``, memory already touched: khugepaged
    collapses them in the background (asked for before the first touch, each fault would)."""
    cdef size_t start = (<size_t>p + HUGE - 1) & ~(<size_t>HUGE - 1)
    cdef size_t end = (<size_t>p + size) & ~(<size_t>HUGE - 1)
    if end > start:
        madvise(<void*>start, end - start, MADV_HUGEPAGE)


cdef int64_t _grow_entries(Block** blocks, Tie** ties, uint32_t* capacity, uint64_t* span,
                           uint32_t used) except -1:
    """Grow the entry arrays by half; returns the entries copied (0: grown in their reservation)."""
    cdef uint64_t cap = capacity[0]
    cdef uint64_t grown = cap + (cap >> 1)
    cdef uint64_t room = grown
    cdef Block* nb
    cdef Tie* nt
    if grown > MAX_ENTRIES:
        grown = MAX_ENTRIES
    if grown <= cap:
        raise MemoryError("prefix index: more than 2^27 blocks")
    if grown <= span[0]:  # within the reserved address space: commit the next part, move nothing
        if mprotect(blocks[0], grown * sizeof(Block), PROT_READ | PROT_WRITE) \
                or mprotect(ties[0], grown * sizeof(Tie), PROT_READ | PROT_WRITE):
            raise MemoryError()
        _advise_touched(blocks[0], used * sizeof(Block))
        _advise_touched(ties[0], used * sizeof(Tie))
        capacity[0] = <uint32_t>grown
        return 0
    if grown > RESERVE_AT:
        room = grown if grown > RESERVE_ENTRIES else RESERVE_ENTRIES
    while True:
        nb = <Block*>_span_map(room * sizeof(Block), grown * sizeof(Block))
        nt = <Tie*>_span_map(room * sizeof(Tie), grown * sizeof(Tie))
        if nb != NULL and nt != NULL:
            break
        _scratch_unmap(nb, room * sizeof(Block))
        _scratch_unmap(nt, room * sizeof(Tie))
        if room == grown:
            raise MemoryError()
        room = grown  # no address space to reserve: a mapping of the size alone (each growth copies)
    memcpy(nb, blocks[0], used * sizeof(Block))
    memcpy(nt, ties[0], used * sizeof(Tie))
    _advise_touched(nb, used * sizeof(Block))
    _advise_touched(nt, used * sizeof(Tie))
    _scratch_unmap(blocks[0], span[0] * sizeof(Block))
    _scratch_unmap(ties[0], span[0] * sizeof(Tie))
    blocks[0], ties[0] = nb, nt
    capacity[0], span[0] = <uint32_t>grown, room
    return used
