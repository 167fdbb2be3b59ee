# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False, cdivision=True
"""The compiled side of ``exporter.codecs.otlp``: the wire-format walk that counts a request's
spans and elements before it is built (``count_protobuf``).

``otlp.count_protobuf_reference`` is the definition; this walk visits the messages in the same
order (a stack: a message's fields first, then its last sub-message first), so it returns the
same counts and raises the same error, with the same message, at the same point, for every
body (tests compare the two on real and mutated bodies). Varints are read as 64-bit values with
an overflow flag: a tag or length past 64 bits names no field and no length that fits.
"""

from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc
from libc.stdint cimport int64_t, uint64_t

cdef enum:
    MAX_FIELD = 64  # field numbers with a message type in the request's types are all below it

cdef struct Frame:
    Py_ssize_t pos
    Py_ssize_t end
    int kind
    int depth


cdef class Walker:
    """The request's message types as numbers: ``children[kind][field]`` is the child's kind or -1."""
    cdef int (*children)[MAX_FIELD]
    cdef int n_kinds
    cdef int request
    cdef int span
    cdef int max_depth
    cdef object error  # OtlpDecodeError

    def __cinit__(self, dict tables, str request, str span, int max_depth, error):
        names = sorted(tables)
        ids = {name: i for i, name in enumerate(names)}
        self.n_kinds = len(names)
        self.children = <int (*)[MAX_FIELD]>PyMem_Malloc(self.n_kinds * sizeof(int[MAX_FIELD]))
        if self.children == NULL:
            raise MemoryError()
        cdef int i, f
        for i in range(self.n_kinds):
            for f in range(MAX_FIELD):
                self.children[i][f] = -1
        for name, fields in tables.items():
            for number, child in fields.items():
                if not 0 <= number < MAX_FIELD:
                    raise ValueError(f"field number {number} of {name}: the walk takes numbers below {MAX_FIELD}")
                self.children[ids[name]][number] = ids[child]
        self.request = ids[request]
        self.span = ids[span] if span in ids else -1
        self.max_depth = max_depth
        self.error = error

    def __dealloc__(self):
        PyMem_Free(self.children)

    def count(self, const unsigned char[::1] body not None, budget) -> tuple:
        cdef Py_ssize_t max_spans = budget.max_spans, max_items = budget.max_items
        cdef Py_ssize_t spans = 0, items = 0, cap = 64, top = 0
        cdef Frame* stack = <Frame*>PyMem_Malloc(cap * sizeof(Frame))
        cdef Frame* grown
        cdef Frame fr
        cdef Py_ssize_t pos, end
        cdef uint64_t tag, n
        cdef bint big
        cdef int wire, child
        if stack == NULL:
            raise MemoryError()
        try:
            stack[0].pos, stack[0].end, stack[0].kind, stack[0].depth = 0, body.shape[0], self.request, 0
            top = 1
            while top:
                top -= 1
                fr = stack[top]
                pos, end = fr.pos, fr.end
                while pos < end:
                    pos = _varint(&body[0], pos, end, &tag, &big, self.error)
                    wire = <int>(tag & 7)
                    if wire == 0:
                        pos = _varint(&body[0], pos, end, &n, &big, self.error)
                    elif wire == 1:
                        pos += 8
                    elif wire == 5:
                        pos += 4
                    elif wire == 2:
                        child = -1
                        if not big and (tag >> 3) < MAX_FIELD:
                            child = self.children[fr.kind][tag >> 3]
                        pos = _varint(&body[0], pos, end, &n, &big, self.error)
                        if big or n > <uint64_t>(end - pos):
                            pos = end + 1  # runs past its message: the error below
                            break
                        if child >= 0:
                            items += 1
                            if child == self.span:
                                spans += 1
                            if spans > max_spans or items > max_items:
                                budget.check(spans, items)
                            if fr.depth >= self.max_depth:
                                raise self.error(f"values nested more than {self.max_depth} levels deep")
                            if top == cap:
                                cap *= 2
                                grown = <Frame*>PyMem_Realloc(stack, cap * sizeof(Frame))
                                if grown == NULL:
                                    raise MemoryError()
                                stack = grown
                            stack[top].pos, stack[top].end = pos, pos + <Py_ssize_t>n
                            stack[top].kind, stack[top].depth = child, fr.depth + 1
                            top += 1
                        pos += <Py_ssize_t>n
                    else:
                        raise self.error(f"not an OTLP protobuf ExportTraceServiceRequest: wire type {wire}")
                if pos > end:
                    raise self.error("not an OTLP protobuf ExportTraceServiceRequest: a field runs past its message")
        finally:
            PyMem_Free(stack)
        return spans, items


cdef Py_ssize_t _varint(const unsigned char* buf, Py_ssize_t pos, Py_ssize_t end, uint64_t* out, bint* big,
                        object error) except -1:
    """One varint from ``pos`` (its value in ``out``; ``big`` when it does not fit 64 bits)."""
    cdef uint64_t result = 0
    cdef int shift = 0
    cdef unsigned char b
    big[0] = False
    while pos < end:
        b = buf[pos]
        pos += 1
        if shift == 63:
            if (b & 0x7F) > 1:
                big[0] = True
            result |= (<uint64_t>(b & 1)) << 63
        else:
            result |= (<uint64_t>(b & 0x7F)) << shift
        if b < 0x80:
            out[0] = result
            return pos
        shift += 7
        if shift > 63:
            break
    raise error("not an OTLP protobuf ExportTraceServiceRequest: a truncated or overlong varint")


# ---- the parsed request's spans (decode_protobuf's loop) -----------------------------------------
from cpython.object cimport PyObject_GenericSetAttr


cdef dict _attrs(attrs, value_of):
    """``otlp._pb_attrs``: key -> value; arrays and key-value lists through ``value_of`` itself."""
    cdef dict out = {}
    for kv in attrs:
        v = kv.value
        kind = v.WhichOneof("value")
        if kind is None:
            value = None
        elif kind == "array_value" or kind == "kvlist_value":
            value = value_of(v)
        else:
            value = getattr(v, kind)
        out[kv.key] = value
    return out


cdef inline object _id(raw, Py_ssize_t size, str what, id_of):
    if raw and len(raw) != size:
        return id_of(raw, size, what)  # raises, with the reference's message
    return raw.hex()


def spans_of(req, span_cls, tuple names, value_of, id_of):
    """``otlp.decode_protobuf``'s spans of a parsed request, in its order and with its errors:
    each span's slots (``names``, the dataclass's fields in order) set directly."""
    cdef list out = []
    cdef Py_ssize_t i
    new = object.__new__
    for rs in req.resource_spans:
        resource = _attrs(rs.resource.attributes, value_of)
        for ss in rs.scope_spans:
            for s in ss.spans:
                values = (_id(s.trace_id, 16, "trace id", id_of), _id(s.span_id, 8, "span id", id_of), s.name,
                          s.start_time_unix_nano, s.end_time_unix_nano, _attrs(s.attributes, value_of), resource,
                          ss.scope.name, _id(s.parent_span_id, 8, "parent span id", id_of))
                span = new(span_cls)
                for i in range(9):
                    PyObject_GenericSetAttr(span, names[i], values[i])
                out.append(span)
    return out
