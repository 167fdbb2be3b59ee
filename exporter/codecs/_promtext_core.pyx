# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False, cdivision=True
"""The compiled side of ``exporter.codecs.promtext``: one pass in C over an ASCII page.

``promtext.parse_reference`` is the definition; this scanner returns the same ``ParseResult``
for every text (tests compare the two on the fixtures, edge cases and generated pages). It reads
the page's characters in place (an ASCII ``str`` stores one byte per character), finds each
line's end with ``memchr``, checks the metric name's characters, reuses the previous line's
name object while the name repeats (a family's lines are consecutive), and reads values with
Python's own correctly rounded ``PyOS_string_to_double`` (what ``float()`` calls).

A label block is parsed by the reference's ``parse_labels`` once per distinct series text (the
line up to its last ``}``); the ``cache`` dict the caller keeps from one page to the next maps
that text to the parsed labels, so the next scrape of the same series only looks the text up.
The cached dicts are shared by the samples that carry them: they are read, never changed.

Anything off the common path — a line the scanner cannot take as written (an escape in the
name's place, an odd whitespace character, a value ``float()`` reads differently from the C
parse, a malformed label block, a bad label value) — is handed whole to the reference parser,
so errors, their excerpts and kinds are the reference's own.
"""

from cpython.object cimport PyObject, PyTypeObject
from cpython.ref cimport Py_INCREF
from libc.string cimport memchr, memcmp

cdef extern from "Python.h":
    const char* PyUnicode_DATA_ "PyUnicode_DATA"(object)
    Py_ssize_t PyUnicode_GET_LENGTH(object)
    bint PyUnicode_IS_ASCII(object)
    object PyUnicode_FromStringAndSize(const char*, Py_ssize_t)
    double PyOS_string_to_double(const char*, char**, PyObject*)
    PyObject* PyErr_Occurred()
    void PyErr_Clear()

cdef extern from *:
    """
    /* A Sample (a NamedTuple: a tuple subclass) filled without calling its Python __new__. */
    static PyObject* ps_sample(PyObject* type, PyObject* labels, double value, int has_ts, double ts) {
        PyTypeObject* t = (PyTypeObject*)type;
        PyObject* v = PyFloat_FromDouble(value);
        if (v == NULL) return NULL;
        PyObject* stamp;
        if (has_ts) {
            stamp = PyFloat_FromDouble(ts);
            if (stamp == NULL) { Py_DECREF(v); return NULL; }
        } else {
            stamp = Py_None; Py_INCREF(stamp);
        }
        PyObject* s = t->tp_alloc(t, 3);
        if (s == NULL) { Py_DECREF(v); Py_DECREF(stamp); return NULL; }
        Py_INCREF(labels);
        PyTuple_SET_ITEM(s, 0, labels);
        PyTuple_SET_ITEM(s, 1, v);
        PyTuple_SET_ITEM(s, 2, stamp);
        return s;
    }
    """
    object ps_sample(object, object, double, int, double)

# Bound to promtext's classes and reference functions by ``bind`` (promtext imports this module).
cdef object _ParseResult = None
cdef object _ParseError = None
cdef object _Sample = None
cdef object _parse_labels = None
cdef object _parse_reference = None
cdef object _ParseTimeout = None
cdef object _monotonic = None
cdef Py_ssize_t _deadline_every = 2048
cdef Py_ssize_t _max_key = 256
cdef Py_ssize_t _max_cached = 20000


def bind(ParseResult, ParseError, Sample, parse_labels, parse_reference, ParseTimeout, monotonic,
         Py_ssize_t deadline_every, Py_ssize_t max_key, Py_ssize_t max_cached) -> None:
    global _ParseResult, _ParseError, _Sample, _parse_labels, _parse_reference, _ParseTimeout, _monotonic
    global _deadline_every, _max_key, _max_cached
    _ParseResult, _ParseError, _Sample = ParseResult, ParseError, Sample
    _parse_labels, _parse_reference, _ParseTimeout, _monotonic = parse_labels, parse_reference, ParseTimeout, monotonic
    _deadline_every, _max_key, _max_cached = deadline_every, max_key, max_cached


cdef inline bint _name_start(char c) noexcept nogil:
    return (b'a' <= c <= b'z') or (b'A' <= c <= b'Z') or c == b'_' or c == b':'


cdef inline bint _name_char(char c) noexcept nogil:
    return _name_start(c) or (b'0' <= c <= b'9')


cdef inline bint _read_double(const char* p, const char* end, double* out):
    """``float()`` of the token [p, end) when the C parse takes all of it; else False."""
    cdef char* stop = NULL
    out[0] = PyOS_string_to_double(p, &stop, NULL)
    if PyErr_Occurred() != NULL:
        PyErr_Clear()
        return False
    return stop == end


cdef void _merge(object result, object one, Py_ssize_t lineno, dict samples, list errors) except *:
    """Fold the reference's parse of one line (its line 1 is ``lineno``) into ``result``."""
    for name, got in one.samples.items():
        bucket = samples.get(name)
        if bucket is None:
            samples[name] = got
        else:
            (<list>bucket).extend(got)
    for e in one.errors:
        errors.append(_ParseError(lineno, e.excerpt, e.reason, e.kind))
    result.other_names.update(one.other_names)
    result.families.update(one.families)


def parse(str text, wanted, deadline, object series_cache):
    """``promtext.parse_reference(text, wanted, deadline)`` for an ASCII ``text``; ``cache`` (or
    ``None``) keeps parsed label blocks by series text between calls."""
    if not PyUnicode_IS_ASCII(text):
        raise ValueError("the compiled scanner reads ASCII text only")
    result = _ParseResult()
    cdef dict samples = result.samples
    cdef list errors = result.errors
    cdef set other = result.other_names
    cdef set families = result.families
    cdef bint keep_all = wanted is None
    cdef object want = None
    if series_cache is not None and type(series_cache) is not dict:
        raise TypeError("the series cache is a dict (promtext.SeriesCache())")
    cdef dict cache = series_cache
    if not keep_all:
        want = wanted if type(wanted) is frozenset else frozenset(wanted)
    cdef bint timed = deadline is not None
    cdef double stop_at = deadline if timed else 0.0
    cdef const char* buf = PyUnicode_DATA_(text)
    cdef Py_ssize_t n = PyUnicode_GET_LENGTH(text)
    cdef Py_ssize_t pos = 0, a, b, i, j, t0, t1, t2, t3, lineno = 0, n_lines = 0
    cdef const char* nl
    cdef const char* prev_name = NULL
    cdef Py_ssize_t prev_len = -1
    cdef object name = None
    cdef bint wanted_name = False
    cdef object bucket = None
    cdef object labels
    cdef object key
    cdef double value = 0.0, ts = 0.0
    cdef bint has_ts
    cdef char c
    while pos <= n:
        lineno += 1
        if timed and lineno % _deadline_every == 0 and _monotonic() > stop_at:
            raise _ParseTimeout(f"parsing stopped at line {lineno}: past the deadline")
        a = pos
        nl = <const char*>memchr(buf + pos, b'\n', n - pos)
        if nl == NULL:
            b = n
            pos = n + 1
        else:
            b = nl - buf
            pos = b + 1
        if b > a and buf[b - 1] == b'\r':
            b -= 1
        if a == b:
            continue
        c = buf[a]
        if c == b'#':
            if b - a >= 7 and memcmp(buf + a, b"# TYPE ", 7) == 0:
                i = a + 7
                while i < b and buf[i] != b' ':
                    i += 1
                families.add(PyUnicode_FromStringAndSize(buf + a + 7, i - a - 7))
            continue
        # ---- the name: up to the first space or "{", every character a name's ----
        if not _name_start(c):
            _slow(text, a, pos, lineno, want, result, samples, errors)
            prev_len = -1
            continue
        i = a + 1
        while i < b and _name_char(buf[i]):
            i += 1
        if i < b and buf[i] != b' ' and buf[i] != b'{':
            _slow(text, a, pos, lineno, want, result, samples, errors)
            prev_len = -1
            continue
        if i - a != prev_len or memcmp(buf + a, prev_name, i - a) != 0:
            name = PyUnicode_FromStringAndSize(buf + a, i - a)
            prev_name = buf + a
            prev_len = i - a
            wanted_name = keep_all or name in want
            if wanted_name:
                bucket = samples.get(name)
            else:
                other.add(name)
        if not wanted_name:
            n_lines += 1
            continue
        # ---- the label block: up to the line's last "}" ----
        if i < b and buf[i] == b'{':
            j = b - 1
            while j > i and buf[j] != b'}':
                j -= 1
            if j == i:  # no closing brace
                _slow(text, a, pos, lineno, want, result, samples, errors)
                prev_len = -1
                continue
            if j == i + 1:
                labels = {}
            else:
                labels = None
                key = None
                if cache is not None and j + 1 - a <= _max_key:
                    key = PyUnicode_FromStringAndSize(buf + a, j + 1 - a)
                    labels = cache.get(key)
                if labels is None:
                    try:
                        labels = _parse_labels(PyUnicode_FromStringAndSize(buf + i + 1, j - i - 1))
                    except ValueError:
                        _slow(text, a, pos, lineno, want, result, samples, errors)
                        prev_len = -1
                        continue
                    if key is not None:
                        if len(cache) >= _max_cached:
                            cache.clear()
                        cache[key] = labels
            i = j + 1
        else:
            labels = {}
        # ---- the value and an optional timestamp: one or two tokens split by blanks ----
        t0 = i
        while t0 < b and (buf[t0] == b' ' or buf[t0] == b'\t'):
            t0 += 1
        t1 = t0
        while t1 < b and <unsigned char>buf[t1] > 32:
            t1 += 1
        t2 = t1
        while t2 < b and (buf[t2] == b' ' or buf[t2] == b'\t'):
            t2 += 1
        t3 = t2
        while t3 < b and <unsigned char>buf[t3] > 32:
            t3 += 1
        j = t3
        while j < b and (buf[j] == b' ' or buf[j] == b'\t'):
            j += 1
        # a third token, an odd blank (str.split() takes \v, \f, \r, \x1c-\x1f too) or no value
        if j != b or t0 == t1 or not _read_double(buf + t0, buf + t1, &value):
            _slow(text, a, pos, lineno, want, result, samples, errors)
            prev_len = -1
            continue
        has_ts = t2 != t3
        if has_ts:
            if not _read_double(buf + t2, buf + t3, &ts):
                _slow(text, a, pos, lineno, want, result, samples, errors)
                prev_len = -1
                continue
            ts = ts / 1000.0
        sample = ps_sample(_Sample, labels, value, has_ts, ts)
        if bucket is None:
            bucket = [sample]
            samples[name] = bucket
        else:
            (<list>bucket).append(sample)
        n_lines += 1
    result.lines += n_lines  # the lines handed to the reference are counted there
    return result


cdef void _slow(str text, Py_ssize_t a, Py_ssize_t end, Py_ssize_t lineno, object want, object result,
                dict samples, list errors) except *:
    """The reference's reading of the line starting at ``a`` (``end`` is past its newline)."""
    one = _parse_reference(text[a:end - 1], want, None)
    _merge(result, one, lineno, samples, errors)
    result.lines += one.lines
