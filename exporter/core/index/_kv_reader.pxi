# ---- KV batches read straight from the payload: the reader ----------------------------------------
# Part of ``_prefix_core.pyx``, which ``include``s it: one extension module, its names the module's
# (the DEFs, structs and types it uses are declared in the files included before it).
#
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
cdef object _EXTERNAL = "EXTERNAL"  # the tier of a block vLLM marks ``locality: REMOTE`` (tiers.EXTERNAL)
cdef object _BAD = object()  # what the value readers below return for a value they do not accept


cdef object _text_or_nil(Reader* r):
    """A nil (None) or a UTF-8 string (str, "GPU" interned); ``_BAD`` for anything else."""
    cdef const uint8_t* txt
    cdef uint64_t n
    if r.p < r.end and r.p[0] == 0xc0:
        r.p += 1
        return None
    if _str(r, &txt, &n) < 0:
        return _BAD
    if _is(txt, n, b"GPU", 3):
        return _GPU
    try:
        return (<const char*>txt)[:n].decode("utf-8")
    except UnicodeDecodeError:
        return _BAD


cdef int _newer(KvScan s, ScanEvent* e, object medium, object locality, object session) except -2:
    """The event's tier (a ``REMOTE`` block's is ``EXTERNAL``: held outside the worker) and, for a
    store that names a session, its entry in the scan's sessions."""
    if _medium_id(s, _EXTERNAL if locality == "REMOTE" else medium, e) < 0:
        return -1
    if session is not None and e.kind == SCAN_STORED and len(<str>session):
        if s.sessions is None:
            s.sessions = []
        s.sessions.append((session, e.parent if e.has_parent else None,
                           s.hashes[e.hoff + e.hn - 1] if e.hn else None, s.media[e.medium]))
    return 0


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
DEF F_LOCALITY = 32
DEF F_SESSION = 64


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
    cdef object medium = _GPU, locality = None, session = None
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
            elif _is(txt, n, b"locality", 8):
                f = F_LOCALITY
            elif e.kind == SCAN_STORED and _is(txt, n, b"session_id", 10):
                f = F_SESSION
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
            medium = _text_or_nil(r)
            if medium is _BAD:
                return -1
        elif f == F_LOCALITY:
            locality = _text_or_nil(r)
            if locality is _BAD:
                return -1
        elif f == F_SESSION:
            session = _text_or_nil(r)
            if session is _BAD:
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
    return _newer(s, e, medium, locality, session)


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
    cdef object medium = _GPU, locality = None, session = None
    if _array(r, &fields) < 0 or fields == 0 or _str(r, &txt, &n) < 0:
        return -1
    if _is(txt, n, b"BlockStored", 11):
        # [tag, block_hashes, parent_block_hash, token_ids, block_size, lora_id?, medium?,
        #  lora_name?, extra_keys?, group_idx?, kv_cache_spec_kind?, kv_cache_spec_sliding_window?,
        #  locality? (12), ownership? (13), session_id? (14), then fields the exporter does not read]
        e.kind = SCAN_STORED
        if fields < 5 or fields > MAX_ARRAY_FIELDS or _hashes_into(s, r, e) < 0 \
                or _nil_or_u64(r, &e.parent, &e.has_parent) < 0 or _raw_tokens(r, base, e) < 0 or _block_size(r, e) < 0:
            return -1
        if fields > 5 and _skip(r) < 0:
            return -1
        if fields > 6:
            medium = _text_or_nil(r)
            if medium is _BAD:
                return -1
        if fields > 7 and _label(s, r, False) < 0:
            return -1
        if fields > 8 and _label(s, r, True) < 0:
            return -1
        if fields > 9 and _skip_n(r, (fields if fields < 12 else 12) - 9) < 0:
            return -1
        if fields > 12:
            locality = _text_or_nil(r)
            if locality is _BAD or _skip_n(r, 1 if fields > 13 else 0) < 0:
                return -1
        if fields > 14:
            session = _text_or_nil(r)
            if session is _BAD or _skip_n(r, fields - 15) < 0:
                return -1
        return _newer(s, e, medium, locality, session)
    if _is(txt, n, b"BlockRemoved", 12):
        # [tag, block_hashes, medium?, group_idx?, locality? (4), then fields the exporter does not read]
        e.kind = SCAN_REMOVED
        if fields > MAX_ARRAY_FIELDS or _hashes_into(s, r, e) < 0:
            return -1
        if fields > 2:
            medium = _text_or_nil(r)
            if medium is _BAD:
                return -1
        if fields > 3 and _skip(r) < 0:
            return -1
        if fields > 4:
            locality = _text_or_nil(r)
            if locality is _BAD or _skip_n(r, fields - 5) < 0:
                return -1
        return _newer(s, e, medium, locality, None)
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
    if s.sessions is not None:
        s.sessions = tuple(s.sessions)
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
    PyObject_GenericSetAttr(o, "sessions", s.sessions)
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
