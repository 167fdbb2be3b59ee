# ---- KV batches read straight from the payload: what a scan holds ---------------------------------
# Part of ``_prefix_core.pyx``, which ``include``s it: one extension module, its names the module's
# (the DEFs, structs and types it uses are declared in the files included before it).
#
# ``scan_kv_batch`` (``_kv_reader.pxi``) fills a ``KvScan``; the index (``CompiledPrefixIndex.apply_scan``),
# the eviction tracker and prefix instability read it without an event object.

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
    # the stores that name their session (vLLM >= 0.30 ``session_id``), as ``KvBatch.sessions``
    # (session, parent, last block, medium) in order; None when none does
    cdef readonly object sessions

    def __cinit__(self):
        self.ev, self.n, self.cap = NULL, 0, 0
        self.hashes, self.nh, self.hcap = NULL, 0, 0
        self.media = []
        self.roots = 0
        self.labelled = False
        self.sessions = None

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
