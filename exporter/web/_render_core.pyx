# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False, cdivision=True
"""The compiled side of ``exporter.web.exposition``: one counter or gauge family's sample lines.

A live scrape changes most per-worker values, so the text of most families is written anew at
every scrape. In Python that is a ``repr`` and a string concatenation per sample plus a join; here
it is one pass in C over the family's values: each value is read from the family's dict (the
cached label sets, in the cached order), compared bit for bit with the last scrape's, and only the
changed ones are formatted; the others are copied from the last scrape's text. Values are written
exactly as prometheus_client writes them (``floatToGoString``): Python's ``repr`` (the shortest
digits that read back as the same double, found with Ryu below; integers below 2**53 written
directly, their ``repr`` being their digits and ``.0``), Go-style exponents from 1e6 on for
positive values, ``+Inf``/``-Inf``/``NaN``.

``exporter.web.exposition`` keeps the Python reference of all this (``format_value`` and the
per-family cache); tests compare the two byte for byte. Objects here are immutable once built,
so threads rendering at once each see a complete family.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE, _PyBytes_Resize
from cpython.dict cimport PyDict_GetItem, PyDict_Next
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.object cimport Py_EQ, PyObject, PyObject_RichCompareBool
from cpython.ref cimport Py_DECREF, Py_XDECREF
from libc.math cimport floor, isinf, isnan, signbit
from libc.stdint cimport int32_t, uint32_t, uint64_t
from libc.string cimport memcmp, memcpy

cdef extern from *:
    """
    typedef unsigned __int128 ps_u128;
    static inline uint64_t ps_mul_shift(uint64_t m, const uint64_t* mul, int32_t j) {
        ps_u128 b0 = (ps_u128)m * mul[0];
        ps_u128 b2 = (ps_u128)m * mul[1];
        return (uint64_t)(((b0 >> 64) + b2) >> (j - 64));
    }
    """
    uint64_t ps_mul_shift(uint64_t m, const uint64_t* mul, int32_t j) nogil

cdef enum:
    VALUE_MAX = 32  # the longest value text is 24 bytes ("-2.2250738585072014e-308")
cdef double _EXACT = 9007199254740992.0  # 2**53: integers below it are their repr's digits


# ---- shortest round-trip digits (Ryu, Ulf Adams 2018) -----------------------------------------
# ``repr`` finds a double's shortest round-tripping digits with David Gay's dtoa, which costs about
# half a microsecond for the 16-17 digit values of ratios and seconds; a live scrape writes
# thousands. Ryu finds the same digits (the shortest, and of those the closest, ties to even:
# what dtoa's mode 0 returns) with a few 128-bit multiplications. Its tables (5^i and 2^k/5^i to
# 125 bits) are computed here at import from Python integers, not pasted.
cdef enum:
    _POW5_INV_BITCOUNT = 125
    _POW5_BITCOUNT = 125
    _INV_TABLE_SIZE = 342
    _TABLE_SIZE = 326

cdef uint64_t _POW5_INV_SPLIT[_INV_TABLE_SIZE][2]
cdef uint64_t _POW5_SPLIT[_TABLE_SIZE][2]


cdef inline int32_t _pow5bits(int32_t e) noexcept nogil:
    return <int32_t>((<uint32_t>e * 1217359) >> 19) + 1


cdef inline uint32_t _log10_pow2(int32_t e) noexcept nogil:
    return (<uint32_t>e * 78913) >> 18


cdef inline uint32_t _log10_pow5(int32_t e) noexcept nogil:
    return (<uint32_t>e * 732923) >> 20


def _fill_tables() -> None:
    mask = (1 << 64) - 1
    for i in range(_INV_TABLE_SIZE):
        pow5 = 5 ** i
        inv = (1 << (pow5.bit_length() - 1 + _POW5_INV_BITCOUNT)) // pow5 + 1
        _POW5_INV_SPLIT[i][0] = inv & mask
        _POW5_INV_SPLIT[i][1] = inv >> 64
    for i in range(_TABLE_SIZE):
        pow5 = 5 ** i
        shift = pow5.bit_length() - _POW5_BITCOUNT
        split = pow5 >> shift if shift >= 0 else pow5 << -shift
        _POW5_SPLIT[i][0] = split & mask
        _POW5_SPLIT[i][1] = split >> 64


_fill_tables()


cdef inline uint32_t _pow5_factor(uint64_t value) noexcept nogil:
    cdef uint32_t count = 0
    while value % 5 == 0:
        value //= 5
        count += 1
    return count


cdef Py_ssize_t _shortest_repr(double d, char* out) noexcept:
    """``repr(d)`` of a finite, non-zero ``d`` into ``out``; its length."""
    cdef uint64_t bits
    memcpy(&bits, &d, 8)
    cdef bint sign = (bits >> 63) != 0
    cdef uint64_t ieee_m = bits & ((<uint64_t>1 << 52) - 1)
    cdef uint32_t ieee_e = <uint32_t>((bits >> 52) & 0x7FF)
    cdef int32_t e2, e10, q, k, i, j
    cdef uint64_t m2, mv, vr, vp, vm, output
    cdef uint32_t mm_shift, removed = 0, last_removed = 0
    cdef bint accept_bounds, vm_tz = False, vr_tz = False, round_up = False
    if ieee_e == 0:
        m2 = ieee_m
        e2 = 1 - 1023 - 52 - 2
    else:
        m2 = ieee_m | (<uint64_t>1 << 52)
        e2 = <int32_t>ieee_e - 1023 - 52 - 2
    accept_bounds = (m2 & 1) == 0
    mv = 4 * m2
    mm_shift = 1 if (ieee_m != 0 or ieee_e <= 1) else 0
    if e2 >= 0:
        q = <int32_t>_log10_pow2(e2) - (1 if e2 > 3 else 0)
        e10 = q
        k = _POW5_INV_BITCOUNT + _pow5bits(q) - 1
        i = -e2 + q + k
        vr = ps_mul_shift(4 * m2, _POW5_INV_SPLIT[q], i)
        vp = ps_mul_shift(4 * m2 + 2, _POW5_INV_SPLIT[q], i)
        vm = ps_mul_shift(4 * m2 - 1 - mm_shift, _POW5_INV_SPLIT[q], i)
        if q <= 21:
            if mv % 5 == 0:
                vr_tz = _pow5_factor(mv) >= <uint32_t>q
            elif accept_bounds:
                vm_tz = _pow5_factor(mv - 1 - mm_shift) >= <uint32_t>q
            else:
                vp -= 1 if _pow5_factor(mv + 2) >= <uint32_t>q else 0
    else:
        q = <int32_t>_log10_pow5(-e2) - (1 if -e2 > 1 else 0)
        e10 = q + e2
        i = -e2 - q
        k = _pow5bits(i) - _POW5_BITCOUNT
        j = q - k
        vr = ps_mul_shift(4 * m2, _POW5_SPLIT[i], j)
        vp = ps_mul_shift(4 * m2 + 2, _POW5_SPLIT[i], j)
        vm = ps_mul_shift(4 * m2 - 1 - mm_shift, _POW5_SPLIT[i], j)
        if q <= 1:
            vr_tz = True
            if accept_bounds:
                vm_tz = mm_shift == 1
            else:
                vp -= 1
        elif q < 63:
            vr_tz = (mv & ((<uint64_t>1 << q) - 1)) == 0
    if vm_tz or vr_tz:
        while vp // 10 > vm // 10:
            vm_tz = vm_tz and vm % 10 == 0
            vr_tz = vr_tz and last_removed == 0
            last_removed = <uint32_t>(vr % 10)
            vr //= 10
            vp //= 10
            vm //= 10
            removed += 1
        if vm_tz:
            while vm % 10 == 0:
                vr_tz = vr_tz and last_removed == 0
                last_removed = <uint32_t>(vr % 10)
                vr //= 10
                vp //= 10
                vm //= 10
                removed += 1
        if vr_tz and last_removed == 5 and vr % 2 == 0:
            last_removed = 4  # exactly halfway: round to even
        output = vr + (1 if ((vr == vm and (not accept_bounds or not vm_tz)) or last_removed >= 5) else 0)
    else:
        while vp // 10 > vm // 10:
            round_up = vr % 10 >= 5
            vr //= 10
            vp //= 10
            vm //= 10
            removed += 1
        output = vr + (1 if (vr == vm or round_up) else 0)
    return _repr_layout(sign, output, e10 + <int32_t>removed, out)


cdef Py_ssize_t _repr_layout(bint sign, uint64_t digits, int32_t exp, char* out) noexcept:
    """``digits`` × 10^``exp`` laid out as ``repr`` lays it out: fixed notation for decimal
    exponents -4 ≤ x < 16 (``.0`` added to an integer), else ``d.ddde±XX``."""
    cdef char buf[20]
    cdef Py_ssize_t n = 0, k = 0, i, point
    cdef int32_t x
    while digits:
        buf[n] = <char>(c'0' + digits % 10)
        digits //= 10
        n += 1
    for i in range(n // 2):  # most significant first
        buf[i], buf[n - 1 - i] = buf[n - 1 - i], buf[i]
    while n > 1 and buf[n - 1] == c'0':  # (never: the shortest digits end in a non-zero digit)
        n -= 1
        exp += 1
    x = exp + <int32_t>n - 1  # the decimal exponent of the first digit
    if sign:
        out[k] = c'-'
        k += 1
    if -4 <= x < 16:
        if x < 0:
            out[k] = c'0'
            out[k + 1] = c'.'
            k += 2
            for i in range(-x - 1):
                out[k] = c'0'
                k += 1
            memcpy(out + k, buf, n)
            return k + n
        point = x + 1  # digits before the point
        for i in range(point):
            out[k] = buf[i] if i < n else c'0'
            k += 1
        out[k] = c'.'
        k += 1
        if point >= n:
            out[k] = c'0'
            return k + 1
        memcpy(out + k, buf + point, n - point)
        return k + n - point
    out[k] = buf[0]
    k += 1
    if n > 1:
        out[k] = c'.'
        memcpy(out + k + 1, buf + 1, n - 1)
        k += n
    out[k] = c'e'
    out[k + 1] = c'-' if x < 0 else c'+'
    k += 2
    x = -x if x < 0 else x
    if x >= 100:
        out[k] = <char>(c'0' + x // 100)
        k += 1
    out[k] = <char>(c'0' + (x // 10) % 10)
    out[k + 1] = <char>(c'0' + x % 10)
    return k + 2


def shortest_repr(double d) -> str:
    """``repr(d)`` through the compiled digits (tests compare it with ``repr``)."""
    cdef char out[VALUE_MAX]
    if d == 0.0 or isnan(d) or isinf(d):
        return repr(d)
    return out[:_shortest_repr(d, out)].decode("ascii")


cdef Py_ssize_t _go_exponent(const char* s, Py_ssize_t n, Py_ssize_t dot, char* out) noexcept:
    """``s`` (a positive value's fixed-notation repr, its dot at ``dot`` > 6) as Go writes it:
    ``d.ddd`` with trailing zeros (and a bare dot) dropped, then ``e+NN``."""
    cdef Py_ssize_t k = 0, i
    out[k] = s[0]
    k += 1
    out[k] = c'.'
    k += 1
    for i in range(1, n):
        if i != dot:
            out[k] = s[i]
            k += 1
    while k > 1 and (out[k - 1] == c'0' or out[k - 1] == c'.'):
        k -= 1
    out[k] = c'e'
    out[k + 1] = c'+'
    out[k + 2] = <char>(c'0' + (dot - 1) // 10)
    out[k + 3] = <char>(c'0' + (dot - 1) % 10)
    return k + 4


cdef Py_ssize_t format_into(double d, char* out) except -1:
    """Write ``d`` as prometheus_client does into ``out`` (``VALUE_MAX`` bytes); its length."""
    cdef char digits[24]
    cdef char text[VALUE_MAX]
    cdef Py_ssize_t n = 0, k = 0, dot, i
    cdef unsigned long long v
    if isnan(d):
        memcpy(out, b"NaN", 3)
        return 3
    if isinf(d):
        memcpy(out, b"+Inf" if d > 0 else b"-Inf", 4)
        return 4
    if -_EXACT < d < _EXACT and d == floor(d) and not (d == 0.0 and signbit(d)):
        v = <unsigned long long>(-d if d < 0 else d)
        while True:
            digits[n] = <char>(c'0' + v % 10)
            n += 1
            v //= 10
            if v == 0:
                break
        for i in range(n):  # the digits were written last first
            out[i] = digits[n - 1 - i]
        if d > 0 and n > 6:
            out[n] = c'.'
            out[n + 1] = c'0'
            memcpy(digits, out, n + 2)
            return _go_exponent(digits, n + 2, n, out)
        if d < 0:
            memcpy(digits, out, n)
            out[0] = c'-'
            memcpy(out + 1, digits, n)
            n += 1
        out[n] = c'.'
        out[n + 1] = c'0'
        return n + 2
    if d == 0.0:  # -0.0 (0.0 is an integer above)
        memcpy(out, b"-0.0", 4)
        return 4
    n = _shortest_repr(d, text)
    dot = -1
    for i in range(n):
        if text[i] == c'.':
            dot = i
            break
    if d > 0 and dot > 6:
        return _go_exponent(text, n, dot, out)
    memcpy(out, text, n)
    return n


def format_value(double d) -> str:
    """A sample value exactly as prometheus_client writes it (the compiled ``format_value``)."""
    cdef char out[VALUE_MAX]
    cdef Py_ssize_t n = format_into(d, out)
    return out[:n].decode("ascii")


cdef class Layout:
    """A family's label sets in the order they are written, and each one's ``name{labels} ``
    prefix (str, or bytes already UTF-8), joined into one buffer.

    ``order`` is the label sets in the order of the dict the layout was made for: the series
    view builds a family's dict in the same order scrape after scrape, so its values are read
    in one walk over the dict, each key compared with the one expected there (the same string
    objects: no hashing), and taken by key only when the order differs.
    """

    cdef readonly tuple keys
    cdef readonly tuple order
    cdef readonly Py_ssize_t n
    cdef bytes blob
    cdef Py_ssize_t* ends  # ends[i]: where prefix i ends in blob
    cdef Py_ssize_t* perm  # perm[j]: the written position of order[j]

    def __cinit__(self, tuple keys, list prefixes, tuple order=None):
        cdef Py_ssize_t i, at = 0
        if len(keys) != len(prefixes):
            raise ValueError("one prefix per label set")
        self.keys = keys
        self.n = len(keys)
        encoded = [p if type(p) is bytes else p.encode("utf-8") for p in prefixes]  # bytes: kept encoded
        self.blob = b"".join(encoded)
        self.ends = <Py_ssize_t*>PyMem_Malloc((self.n + 1) * sizeof(Py_ssize_t))
        self.perm = <Py_ssize_t*>PyMem_Malloc((self.n + 1) * sizeof(Py_ssize_t))
        if self.ends == NULL or self.perm == NULL:
            raise MemoryError()
        for i in range(self.n):
            at += PyBytes_GET_SIZE(encoded[i])
            self.ends[i] = at
        if order is not None:
            position = {k: i for i, k in enumerate(keys)}
            if len(order) != self.n or len(position) != self.n or set(order) != position.keys():
                raise ValueError("order must hold the same label sets")
            for i in range(self.n):
                self.perm[i] = position[order[i]]
            self.order = order

    def __dealloc__(self):
        PyMem_Free(self.ends)
        PyMem_Free(self.perm)


cdef class Lines:
    """One scrape's text of a family laid out by ``layout``: the values as native doubles and
    where each value's text sits in ``text`` (so the next scrape copies the unchanged ones)."""

    cdef readonly Layout layout
    cdef readonly bytes text
    cdef double* raw
    cdef Py_ssize_t* starts  # starts[i]: where value i's text begins; it ends at the next line's prefix - 1

    def __dealloc__(self):
        PyMem_Free(self.raw)
        PyMem_Free(self.starts)

    @property
    def values(self) -> list:
        return [self.raw[i] for i in range(self.layout.n)]


cdef inline Py_ssize_t _old_len(Lines prev, Py_ssize_t i) noexcept:
    """The length of value ``i``'s text in ``prev``: up to the newline before the next line's
    prefix (``starts[n]`` is the text's length)."""
    cdef Py_ssize_t next_prefix = prev.layout.ends[i + 1] - prev.layout.ends[i] if i + 1 < prev.layout.n else 0
    return prev.starts[i + 1] - next_prefix - 1 - prev.starts[i]


cdef bint _read_in_order(Layout layout, dict values, double* raw) except -1:
    """Read ``values`` into ``raw`` (written order) walking the dict, when its keys come in
    ``layout.order``; False (``raw`` partly written) at the first key out of that order."""
    cdef Py_ssize_t pos = 0, j = 0
    cdef PyObject* key
    cdef PyObject* value
    cdef tuple order = layout.order
    if order is None:
        return False
    while PyDict_Next(values, &pos, &key, &value):
        if j >= layout.n:  # the dict grew under a value's __float__
            return False
        expected = order[j]
        if key != <PyObject*>expected and not PyObject_RichCompareBool(<object>key, expected, Py_EQ):
            return False
        raw[layout.perm[j]] = <double>(<object>value)
        j += 1
    return j == layout.n


def lines(Layout layout, dict values, Lines prev=None):
    """The family's lines for ``values`` (label values → value) in ``layout``'s order.

    Returns ``prev`` itself when every value has the same bits as in ``prev`` (same layout),
    and None when ``values`` does not hold exactly the layout's label sets (the caller builds a
    new layout). Changed values are formatted; unchanged ones are copied from ``prev.text``.
    """
    cdef Py_ssize_t n = layout.n, i, total, at, vlen, line_start
    cdef PyObject* item
    cdef double* raw
    cdef Py_ssize_t* lens
    cdef char* texts
    cdef char* dst
    cdef const char* blob
    cdef const char* old_text
    cdef bint same_layout = prev is not None and prev.layout is layout
    cdef Lines out
    if len(values) != n:
        return None
    raw = <double*>PyMem_Malloc((n + 1) * sizeof(double))
    if raw == NULL:
        raise MemoryError()
    try:
        if not _read_in_order(layout, values, raw):
            for i in range(n):
                item = PyDict_GetItem(values, layout.keys[i])
                if item == NULL:
                    PyMem_Free(raw)
                    return None
                raw[i] = <double>(<object>item)
    except BaseException:
        PyMem_Free(raw)
        raise
    if same_layout and memcmp(raw, prev.raw, n * sizeof(double)) == 0:
        PyMem_Free(raw)
        return prev
    out = Lines.__new__(Lines)
    out.layout = layout
    out.raw = raw
    out.starts = <Py_ssize_t*>PyMem_Malloc((n + 1) * sizeof(Py_ssize_t))
    lens = <Py_ssize_t*>PyMem_Malloc((n + 1) * sizeof(Py_ssize_t))
    texts = <char*>PyMem_Malloc((n + 1) * VALUE_MAX)
    try:
        if out.starts == NULL or lens == NULL or texts == NULL:
            raise MemoryError()
        total = PyBytes_GET_SIZE(layout.blob) + n
        for i in range(n):
            if same_layout and memcmp(&raw[i], &prev.raw[i], sizeof(double)) == 0:
                lens[i] = -1  # copied from the previous text below
                total += _old_len(prev, i)
            else:
                lens[i] = format_into(raw[i], texts + i * VALUE_MAX)
                total += lens[i]
        text = PyBytes_FromStringAndSize(NULL, total)
        dst = PyBytes_AS_STRING(text)
        blob = PyBytes_AS_STRING(layout.blob)
        old_text = PyBytes_AS_STRING(prev.text) if same_layout else NULL
        at = 0
        line_start = 0
        for i in range(n):
            memcpy(dst + at, blob + line_start, layout.ends[i] - line_start)
            at += layout.ends[i] - line_start
            line_start = layout.ends[i]
            out.starts[i] = at
            if lens[i] < 0:
                vlen = _old_len(prev, i)
                memcpy(dst + at, old_text + prev.starts[i], vlen)
            else:
                vlen = lens[i]
                memcpy(dst + at, texts + i * VALUE_MAX, vlen)
            at += vlen
            dst[at] = c'\n'
            at += 1
        out.starts[n] = at
        out.text = text
    finally:
        PyMem_Free(lens)
        PyMem_Free(texts)
    return out


cdef class SeriesPrefixes:
    """One histogram series' line prefixes (each ``name{labels} ``, str or bytes already UTF-8): its
    buckets' ``_bucket`` lines, then ``_count`` and ``_sum``, joined into one buffer. Made once per
    series and shared by every layout that holds the series, so a layout costs a pointer a series."""

    cdef readonly Py_ssize_t per
    cdef bytes blob
    cdef Py_ssize_t* ends  # ends[j]: where prefix j ends in blob

    def __cinit__(self, list prefixes):
        cdef Py_ssize_t j, at = 0
        self.per = len(prefixes)
        encoded = [p if type(p) is bytes else p.encode("utf-8") for p in prefixes]  # bytes: kept encoded
        self.blob = b"".join(encoded)
        self.ends = <Py_ssize_t*>PyMem_Malloc((self.per + 1) * sizeof(Py_ssize_t))
        if self.ends == NULL:
            raise MemoryError()
        for j in range(self.per):
            at += PyBytes_GET_SIZE(encoded[j])
            self.ends[j] = at

    def __dealloc__(self):
        PyMem_Free(self.ends)


cdef class HistogramLayout:
    """A histogram family's series in the order they are written (sorted label sets), each with its
    ``SeriesPrefixes`` of ``buckets`` + 2 prefixes."""

    cdef readonly tuple keys
    cdef readonly Py_ssize_t n
    cdef readonly Py_ssize_t buckets
    cdef tuple series
    cdef Py_ssize_t prefix_bytes  # the series' prefixes together

    def __cinit__(self, tuple keys, tuple series, Py_ssize_t buckets):
        cdef Py_ssize_t i
        cdef SeriesPrefixes one
        if len(series) != len(keys):
            raise ValueError("one SeriesPrefixes per series")
        self.keys = keys
        self.series = series
        self.n = len(keys)
        self.buckets = buckets
        self.prefix_bytes = 0
        for i in range(self.n):
            one = series[i]  # (a TypeError for anything else)
            if one.per != buckets + 2:
                raise ValueError("buckets + 2 prefixes per series")
            self.prefix_bytes += PyBytes_GET_SIZE(one.blob)


cdef extern from "Python.h":
    # A new reference as a bare pointer: the text is written in place, then shrunk to its length.
    PyObject* _new_bytes "PyBytes_FromStringAndSize"(const char* v, Py_ssize_t n) except NULL


def histogram_lines(HistogramLayout layout, dict rows):
    """The family's sample lines: per series (``layout``'s order) each bucket's cumulative count,
    then ``_count`` (the last cumulative count) and ``_sum`` — the lines
    ``exporter.web.exposition._histogram_lines`` writes, the counts summed in the same order.

    ``rows``: label values → the per-bucket counts followed by the sum. None when ``rows`` does not
    hold exactly the layout's series, or a row is not a list of ``buckets + 1`` values (the caller
    makes a new layout, or writes the family in Python)."""
    cdef Py_ssize_t n = layout.n, nb = layout.buckets, per = nb + 2, i, j, at = 0, start, end
    cdef PyObject* item
    cdef PyObject* text
    cdef double cum, value
    cdef char* buf
    cdef const char* blob
    cdef const Py_ssize_t* ends
    cdef SeriesPrefixes series
    cdef list row
    if len(rows) != n:
        return None
    # Written straight into the text (no scratch buffer, no copy): at most every prefix and, per
    # line, the longest value and its newline.
    text = _new_bytes(NULL, layout.prefix_bytes + n * per * (VALUE_MAX + 1))
    buf = PyBytes_AS_STRING(<object>text)
    try:
        for i in range(n):
            item = PyDict_GetItem(rows, layout.keys[i])
            if item == NULL or type(<object>item) is not list:
                Py_XDECREF(text)
                return None
            row = <list>item
            if len(row) != nb + 1:
                Py_XDECREF(text)
                return None
            series = <SeriesPrefixes>layout.series[i]
            blob = PyBytes_AS_STRING(series.blob)
            ends = series.ends
            start = 0
            cum = 0.0
            for j in range(per):
                end = ends[j]
                memcpy(buf + at, blob + start, end - start)
                at += end - start
                start = end
                if j < nb:
                    cum += <double>row[j]
                    value = cum
                elif j == nb:
                    value = cum
                else:
                    value = <double>row[nb]
                at += format_into(value, buf + at)
                buf[at] = c'\n'
                at += 1
    except BaseException:
        Py_XDECREF(text)
        raise
    _PyBytes_Resize(&text, at)  # (on failure it frees the text and raises)
    result = <object>text
    Py_DECREF(result)  # the reference the pointer held, now held by ``result``
    return result
