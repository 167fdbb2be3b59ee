# ---- KV events from the decoder's typed structs, and the per-batch result objects -----------------
# Part of ``_prefix_core.pyx``, which ``include``s it: one extension module, its names the module's
# (the DEFs, structs and types it uses are declared in the files included before it).

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
    cdef object cleared, tokens, remote, external
    cdef tuple stored_kinds, removed_kinds

    def __init__(self, type stored_cls, type removed_cls, cleared, tuple stored_kinds, tuple removed_kinds, tokens,
                 remote, external):
        """``remote``: the locality of a block held outside the worker, read as the ``external`` medium."""
        self.stored_cls, self.removed_cls, self.cleared = stored_cls, removed_cls, cleared
        self.stored_kinds, self.removed_kinds, self.tokens = stored_kinds, removed_kinds, tokens
        self.remote, self.external = remote, external

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
                PyObject_GenericSetAttr(o, "medium", ev.medium if ev.locality != self.remote else self.external)
            elif kind is self.stored_kinds[0] or kind is self.stored_kinds[1]:
                raw = ev.token_ids
                o = _new_slotted(self.stored_cls)
                PyObject_GenericSetAttr(o, "hashes", ev.block_hashes)
                PyObject_GenericSetAttr(o, "parent", ev.parent_block_hash)
                PyObject_GenericSetAttr(o, "block_size", ev.block_size)
                PyObject_GenericSetAttr(o, "token_count", _raw_array_len(raw))
                PyObject_GenericSetAttr(o, "medium", ev.medium if ev.locality != self.remote else self.external)
                # a root store's tokens always (prefix instability compares openings)
                PyObject_GenericSetAttr(o, "token_ids", self.tokens(raw)
                                        if token_ids or ev.parent_block_hash is None else ())
            else:
                o = self.cleared
            out[i] = o
        return tuple(out)
