# ---- Python's hash of ints and tuples of ints, in C (prefix instability's content keys) -----------
# Part of ``_prefix_core.pyx``, which ``include``s it: one extension module, its names the module's
# (the DEFs, structs and types it uses are declared in the files included before it).
#
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
