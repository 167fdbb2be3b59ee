"""vLLM KV-cache event payloads (msgpack) → ``exporter.model.KvBatch``.

The batch is always the array ``[ts, events, dp_rank]`` (dp_rank may be missing or nil).
Events are either arrays with the tag first and positional fields (vLLM ≤ 0.23; trailing
fields optional, extra trailing fields tolerated) or maps with a ``"type"`` key (≥ 0.24;
fields equal to their default omitted). Block hashes (and parents) are unsigned 64-bit ints
or non-empty digest bytes (the last 8 bytes, big-endian, as vLLM's int conversion and llm-d do),
nothing else: a float, bool, string, negative or out-of-range hash means the publisher does not
speak this format, so the whole batch is rejected as a ``decode`` error (dropping just that
event would break the parent chain of the events after it). Other unreadable events are
counted (``bad_event``, ``unknown_event``) and left out, the rest of the batch kept. A batch
timestamp must be a finite number. ``decode_batch`` never raises.

Two paths, one result. The typed path decodes the payload with msgspec into structs shaped like
vLLM's own (``msgspec.msgpack.Decoder``; a tagged union of map-encoded events, else of
array-encoded ones), which checks every field the exporter reads in C: hashes and parents
unsigned 64-bit ints, a positive int block size, a string or nil medium. ``token_ids`` is
decoded for root stores (no parent: the opening of a prompt, which prefix instability compares)
and for the rest only when asked for (``token_ids=True``, for prefix text); otherwise its count is
read from the array header. Whatever the typed path does not accept — bytes hashes, a bad or unknown event, a mix of
encodings, a non-finite timestamp, bytes that are not msgpack — goes to the careful path, which
decides and words the error: one ``msgpack.unpackb`` call (``use_list=False`` so the hash arrays
arrive as tuples), an inline check of the common shapes, then per-field readers. The two agree
on every batch both read (tests/exporter/codecs/test_kvcodec_paths.py). One difference is deliberate:
fields the exporter never reads (``lora_name``, ``extra_keys``, …) are skipped unread by the
typed path, so garbage inside them (invalid UTF-8, a malformed msgpack timestamp) no longer
rejects a batch whose blocks are well formed.

Newer fields (vLLM 0.26–0.33, ``vllm/distributed/kv_events.py``): ``locality`` (``LOCAL``/``REMOTE``)
on stores and removals, and ``session_id`` on stores (array positions 12 and 14 of a stored event,
4 of a removal; map keys otherwise). A ``REMOTE`` block is held outside the worker, whatever its
``medium`` names: it is read as the ``EXTERNAL`` tier (where Dynamo's publisher puts vLLM's remote
blocks too), so it never counts as the worker's GPU residency. A store's ``session_id`` joins the
batch's ``sessions`` (``(session, parent, last block, medium)`` per store, None when no store names
one), which the session table reads. ``ownership`` and ``lookahead_token_ids`` are not read. A
``locality`` or ``session_id`` that is not a string is ignored by the careful path (the typed path
and the compiled reader leave such a batch to it).

Attribution (``attribution=True``): the stored structs also keep ``lora_name`` and ``extra_keys``
as raw msgpack (unparsed, so they still cannot reject a batch), read into the model's label
events (``exporter.codecs.kv_labels``) that the batch carries as ``KvBatch.label_events`` for
``exporter.core.attribution``. Off, nothing changes.

When the compiled core is in use, a third path comes first: ``_prefix_core.scan_kv_batch`` reads
the common well-formed batch (a strict subset of what the typed path accepts) into C arrays, and
:class:`ScannedBatch` carries them to the state, whose prefix index and eviction tracker apply
them without an event object (``apply_scan``). Its events, if anyone reads them, are the typed
path's own (tests/exporter/codecs/test_kvcodec_paths.py holds the reader to the typed path).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from operator import attrgetter
from typing import Annotated, Any, ClassVar

import msgpack
import msgspec

from exporter.codecs.kv_labels import struct_reader
from exporter.core.health import Health
from exporter.core.index.tiers import EXTERNAL
from exporter.model import (
    CLEARED,
    BlockRemoved,
    BlockStored,
    KvBatch,
    KvEvent,
    SessionStore,
    new_removed,
    new_stored,
)

SOURCE = "kv_events"
MASK64 = 0xFFFF_FFFF_FFFF_FFFF
EVENT_NAMES = ("BlockStored", "BlockRemoved", "AllBlocksCleared")
_CLEARED = CLEARED
_new_stored, _new_removed = new_stored, new_removed
_EXCERPT = 64
_INT_ONLY = frozenset((int,))


class BadEvent(ValueError):
    """A known event type whose fields cannot be read."""


class BadHash(ValueError):
    """A block hash that is neither an unsigned 64-bit int nor digest bytes: the batch is rejected."""


def _plain(hs: object) -> bool:
    """True for a non-empty tuple of ints in 0..2^64-1, the common case (type checks at C speed)."""
    if type(hs) is not tuple:
        return False
    if len(hs) == 1:
        h = hs[0]
        return type(h) is int and 0 <= h <= MASK64
    return _INT_ONLY.issuperset(map(type, hs)) and min(hs) >= 0 and max(hs) <= MASK64


def _hash(h: object) -> int:
    if type(h) is int:
        if 0 <= h <= MASK64:
            return h
        raise BadHash(f"block hash {h} outside 0..2^64-1")
    if isinstance(h, bytes | bytearray | memoryview):
        b = bytes(h)
        if not b:
            raise BadHash("empty hash bytes")
        return int.from_bytes(b[-8:], "big")
    raise BadHash(f"block hash of type {type(h).__name__}: {excerpt(h)}")


def _hashes(hs: object) -> tuple[int, ...]:
    if type(hs) is tuple:
        if _INT_ONLY.issuperset(map(type, hs)) and min(hs, default=0) >= 0 and max(hs, default=0) <= MASK64:
            return hs
        return tuple([_hash(h) for h in hs])
    if isinstance(hs, list):
        return tuple([_hash(h) for h in hs])
    raise BadEvent(f"block_hashes of type {type(hs).__name__}")


def _parent(p: object) -> int | None:
    return None if p is None else _hash(p)


def _medium(m: object) -> str | None:
    if m is None or type(m) is str:
        return m
    raise BadEvent(f"medium of type {type(m).__name__}")


def _token_count(tokens: object) -> int:
    return len(tokens) if isinstance(tokens, tuple | list) else 0


def _token_ids(tokens: object) -> tuple[int, ...]:
    """The event's token ids (the decoded tuple itself: no copy; readers check what they use)."""
    return tokens if type(tokens) is tuple else tuple(tokens) if isinstance(tokens, list) else ()


REMOTE = "REMOTE"  # vLLM's locality of a block held outside the worker (its other value: LOCAL)


def _local_medium(medium: str | None, locality: object) -> str | None:
    """The tier a block is counted in: a ``REMOTE`` block's is ``EXTERNAL`` (not the worker's own)."""
    return EXTERNAL if locality == REMOTE else medium


def _session_of(ev: object) -> object:
    """A raw stored event's ``session_id`` (map key, or array position 14), None when absent."""
    if type(ev) is dict:
        return ev.get("session_id")
    return ev[14] if type(ev) is tuple and len(ev) > 14 else None


def _session_store(session: object, stored: BlockStored) -> SessionStore | None:
    if type(session) is not str or not session:
        return None
    return (session, stored.parent, stored.hashes[-1] if stored.hashes else None, stored.medium)


def _block_size(bs: object) -> int:
    if type(bs) is int and bs > 0:
        return bs
    raise BadEvent(f"block_size {bs!r}")


def _from_array(ev: tuple) -> KvEvent:
    tag = ev[0]
    n = len(ev)
    if tag == "BlockStored":
        if n < 5:
            raise BadEvent(f"BlockStored with {n - 1} fields")
        return BlockStored(_hashes(ev[1]), _parent(ev[2]), _block_size(ev[4]), _token_count(ev[3]),
                           _local_medium(_medium(ev[6] if n > 6 else "GPU"), ev[12] if n > 12 else None),
                           _token_ids(ev[3]))
    if tag == "BlockRemoved":
        if n < 2:
            raise BadEvent("BlockRemoved without block_hashes")
        return BlockRemoved(_hashes(ev[1]), _local_medium(_medium(ev[2] if n > 2 else "GPU"), ev[4] if n > 4 else None))
    if tag == "AllBlocksCleared":
        return _CLEARED
    raise KeyError(tag)


def _from_map(ev: dict) -> KvEvent:
    tag = ev.get("type")
    if tag == "BlockStored":
        try:
            hashes, size = ev["block_hashes"], ev["block_size"]
        except KeyError as missing:
            raise BadEvent(f"BlockStored without {missing}") from None
        return BlockStored(_hashes(hashes), _parent(ev.get("parent_block_hash")), _block_size(size),
                           _token_count(ev.get("token_ids")),
                           _local_medium(_medium(ev.get("medium", "GPU")), ev.get("locality")),
                           _token_ids(ev.get("token_ids")))
    if tag == "BlockRemoved":
        if "block_hashes" not in ev:
            raise BadEvent("BlockRemoved without block_hashes")
        return BlockRemoved(_hashes(ev["block_hashes"]), _local_medium(_medium(ev.get("medium", "GPU")), ev.get("locality")))
    if tag == "AllBlocksCleared":
        return _CLEARED
    raise KeyError(tag)


def excerpt(obj: object) -> str:
    """A bounded repr of a bad input for an error message (logged once, never the whole frame)."""
    text = repr(obj)
    return text if len(text) <= _EXCERPT else text[:_EXCERPT] + "…"


# ---- the typed path (msgspec) ---------------------------------------------------------------------
# The structs name only what the exporter reads; msgspec skips the other fields (and, for an
# array-encoded event, extra trailing ones). A msgpack int is at most 2^64-1, so ``ge=0`` is the
# whole hash check. ``token_ids`` stays raw msgpack until asked for.
_U64 = Annotated[int, msgspec.Meta(ge=0)]
_SIZE = Annotated[int, msgspec.Meta(gt=0)]
_NIL = msgspec.Raw(b"\xc0")


class _MapStored(msgspec.Struct, tag="BlockStored", tag_field="type", gc=False):
    block_hashes: tuple[_U64, ...]
    block_size: _SIZE
    parent_block_hash: _U64 | None = None
    token_ids: msgspec.Raw = _NIL
    medium: str | None = "GPU"
    locality: str | None = None  # vLLM >= 0.26
    session_id: str | None = None  # vLLM >= 0.30


# Removals and clears name no session: ``session_id`` as a class constant lets one C-level pass
# (``_ANY_SESSION``) tell a batch without sessions from one with, whatever its events.
class _MapRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type", gc=False):
    block_hashes: tuple[_U64, ...]
    medium: str | None = "GPU"
    locality: str | None = None
    session_id: ClassVar[None] = None


class _MapCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type", gc=False):
    session_id: ClassVar[None] = None
    locality: ClassVar[None] = None


class _ArrayStored(msgspec.Struct, tag="BlockStored", array_like=True, gc=False):
    block_hashes: tuple[_U64, ...]
    parent_block_hash: _U64 | None
    token_ids: msgspec.Raw
    block_size: _SIZE
    lora_id: msgspec.Raw = _NIL
    medium: str | None = "GPU"
    lora_name: msgspec.Raw = _NIL  # field 7 (read raw by attribution, skipped otherwise)
    extra_keys: msgspec.Raw = _NIL  # field 8
    group_idx: msgspec.Raw = _NIL
    kv_cache_spec_kind: msgspec.Raw = _NIL
    kv_cache_spec_sliding_window: msgspec.Raw = _NIL
    locality: str | None = None  # field 12 (vLLM >= 0.26)
    ownership: msgspec.Raw = _NIL
    session_id: str | None = None  # field 14 (vLLM >= 0.30); lookahead_token_ids (15) and later: ignored


class _ArrayRemoved(msgspec.Struct, tag="BlockRemoved", array_like=True, gc=False):
    block_hashes: tuple[_U64, ...]
    medium: str | None = "GPU"
    group_idx: msgspec.Raw = _NIL
    locality: str | None = None  # field 4 (vLLM >= 0.26)
    session_id: ClassVar[None] = None


class _ArrayCleared(msgspec.Struct, tag="AllBlocksCleared", array_like=True, gc=False):
    session_id: ClassVar[None] = None
    locality: ClassVar[None] = None


class _MapBatch(msgspec.Struct, array_like=True, gc=False):  # vLLM ≥ 0.24
    ts: float
    events: tuple[_MapStored | _MapRemoved | _MapCleared, ...]
    dp_rank: int | None = None


class _ArrayBatch(msgspec.Struct, array_like=True, gc=False):  # vLLM ≤ 0.23
    ts: float
    events: tuple[_ArrayStored | _ArrayRemoved | _ArrayCleared, ...]
    dp_rank: int | None = None


class _MapStoredLabelled(_MapStored, tag="BlockStored", tag_field="type", gc=False):
    """A stored event with the fields attribution reads, raw (vLLM ≥ 0.14 / ≥ 0.20)."""

    lora_name: msgspec.Raw = _NIL
    extra_keys: msgspec.Raw = _NIL


class _ArrayStoredLabelled(_ArrayStored, tag="BlockStored", array_like=True, gc=False):
    """The array-encoded store keeps ``lora_name`` and ``extra_keys`` (fields 7, 8) raw already."""


class _MapBatchLabelled(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: tuple[_MapStoredLabelled | _MapRemoved | _MapCleared, ...]
    dp_rank: int | None = None


class _ArrayBatchLabelled(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: tuple[_ArrayStoredLabelled | _ArrayRemoved | _ArrayCleared, ...]
    dp_rank: int | None = None


_TYPED = (msgspec.msgpack.Decoder(_MapBatch).decode, msgspec.msgpack.Decoder(_ArrayBatch).decode)
_TYPED_LABELLED = (msgspec.msgpack.Decoder(_MapBatchLabelled).decode,
                   msgspec.msgpack.Decoder(_ArrayBatchLabelled).decode)
_REMOVED = (_MapRemoved, _ArrayRemoved)
_STORED = (_MapStored, _ArrayStored)
_STORED_LABELLED = (_MapStoredLabelled, _ArrayStoredLabelled)
# With ``attribution=True`` a batch's events are read for their labels (``KvBatch.label_events``).
_labels = struct_reader(_STORED_LABELLED, _REMOVED, (_MapCleared, _ArrayCleared))


def _array_len(raw: msgspec.Raw) -> int:
    """The length of a raw msgpack array from its header; 0 for anything else (as for a non-array)."""
    b = memoryview(raw)
    head = b[0]
    if 0x90 <= head <= 0x9F:
        return head & 0x0F
    if head == 0xDC:
        return int.from_bytes(b[1:3], "big")
    if head == 0xDD:
        return int.from_bytes(b[1:5], "big")
    return 0


def _tokens(raw: msgspec.Raw) -> tuple:
    t = msgpack.unpackb(raw, raw=False, strict_map_key=False, use_list=False)
    return t if type(t) is tuple else ()


def _build_events_py(structs: tuple, token_ids: bool, stored: tuple[type, ...] = _STORED) -> tuple[KvEvent, ...]:
    """The model events of the typed structs (the definition; ``_prefix_core.EventBuilder`` does
    the same with the slots filled in C)."""
    events: list[KvEvent] = []
    append = events.append
    new_stored, new_removed, removed, count = _new_stored, _new_removed, _REMOVED, _array_len
    for ev in structs:
        kind = type(ev)
        if kind in removed:
            append(new_removed(ev.block_hashes, ev.medium if ev.locality != REMOTE else EXTERNAL))
        elif kind in stored:
            raw = ev.token_ids
            parent = ev.parent_block_hash
            append(new_stored(ev.block_hashes, parent, ev.block_size, count(raw),
                              ev.medium if ev.locality != REMOTE else EXTERNAL,
                              _tokens(raw) if token_ids or parent is None else ()))
        else:
            append(_CLEARED)
    return tuple(events)


def _event_builder(stored: tuple[type, ...] = _STORED) -> Callable[[tuple, bool], tuple[KvEvent, ...]]:
    """The compiled builder when the extension is in use and the event classes are the slotted
    ones it fills (the same check as ``exporter.model._maker``'s), else the Python one."""
    from exporter.core.index.prefix_index import CORE

    if CORE != "compiled" or _new_stored is BlockStored or _new_removed is BlockRemoved:
        return lambda structs, token_ids: _build_events_py(structs, token_ids, stored)
    from exporter.core.index._prefix_core import EventBuilder

    return EventBuilder(BlockStored, BlockRemoved, _CLEARED, stored, _REMOVED, _tokens, REMOTE, EXTERNAL).build


_build_events = _event_builder()
_build_events_labelled = _event_builder(_STORED_LABELLED)
_SESSION_IDS = attrgetter("session_id")
_STORED_ANY = frozenset((*_STORED, *_STORED_LABELLED))


def _sessions(structs: tuple) -> tuple[SessionStore, ...] | None:
    """The stores that name a session, as the batch's ``sessions``; None when none does (one
    C-level pass over the events: the common batch costs no Python step per event)."""
    if not any(map(_SESSION_IDS, structs)):
        return None
    return tuple([(ev.session_id, ev.parent_block_hash, ev.block_hashes[-1] if ev.block_hashes else None,
                   ev.medium if ev.locality != REMOTE else EXTERNAL)
                  for ev in structs if type(ev) in _STORED_ANY and ev.session_id])


def _typed(payload: bytes, worker: str, seq: int, token_ids: bool, attribution: bool = False) -> KvBatch | None:
    """The batch when the typed path accepts the payload, else None (the careful path decides)."""
    for decode in _TYPED_LABELLED if attribution else _TYPED:
        try:
            obj = decode(payload)
        except Exception:  # msgspec's ValidationError / DecodeError, or a recursion limit
            continue
        break
    else:
        return None
    if not math.isfinite(obj.ts):
        return None
    try:
        events = (_build_events_labelled if attribution else _build_events)(obj.events, token_ids)
    except Exception:  # token ids msgpack cannot read: the careful path rejects the payload, as before
        return None
    return KvBatch(worker=worker, seq=seq, ts=obj.ts, events=events, dp_rank=obj.dp_rank,
                   label_events=_labels(obj.events) if attribution else None, sessions=_sessions(obj.events))


# ---- the scanned path (compiled) ------------------------------------------------------------------
# The compiled reader (``_prefix_core.scan_kv_batch``) reads the common well-formed batch into C
# arrays that the prefix index and the eviction tracker apply directly (``apply_scan``): no event
# object is built unless a reader asks for the events. It accepts a strict subset of what the
# typed path accepts, and the events of a scanned batch are the typed path's own, built on first
# read, so every reader sees the same batch whichever path decoded it.


class ScannedBatch(KvBatch):
    """A :class:`KvBatch` read by the compiled reader: ``scan`` holds its events as C arrays and
    ``events`` is built from the payload by the typed path on first read (then kept); ``attributed``:
    decoded with tenant/adapter attribution on. Equal to,
    and hashed and pickled as, the plain ``KvBatch`` of the same fields."""

    __slots__ = ("_events", "attributed", "scan")

    @classmethod
    def of(cls, scan: Any, worker: str, seq: int) -> ScannedBatch:
        b = _new(cls)
        _set_worker(b, worker)  # the slots' own setters: the frozen class's __setattr__ refuses
        _set_seq(b, seq)
        _set_ts(b, scan.ts)
        _set_dp_rank(b, scan.dp_rank)
        _set_scan(b, scan)
        _set_events(b, None)
        _set_label_events(b, None)
        _set_sessions(b, scan.sessions)
        _set_attributed(b, False)
        return b

    @property  # type: ignore[override]
    def events(self) -> tuple[KvEvent, ...]:
        events = self._events
        if events is None:
            batch = _typed(self.scan.payload, self.worker, self.seq, False)
            assert batch is not None, "the typed path reads every batch the compiled reader reads"
            events = batch.events
            _set(self, "_events", events)
        return events

    @events.setter
    def events(self, value: tuple[KvEvent, ...]) -> None:  # the dataclass __init__ (``dataclasses.replace``)
        _set(self, "_events", value)
        _set(self, "scan", None)

    def _fields(self) -> tuple[object, ...]:
        return (self.worker, self.seq, self.ts, self.events, self.dp_rank, self.label_events, self.sessions)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, KvBatch):
            return NotImplemented
        return self._fields() == (other.worker, other.seq, other.ts, other.events, other.dp_rank, other.label_events,
                                  other.sessions)

    def __hash__(self) -> int:
        return hash(self._fields())

    def __reduce__(self) -> tuple[type, tuple[object, ...]]:
        return KvBatch, self._fields()


_new = object.__new__
_set = object.__setattr__
_set_worker, _set_seq, _set_ts, _set_dp_rank, _set_label_events, _set_sessions = (
    getattr(KvBatch, n).__set__ for n in ("worker", "seq", "ts", "dp_rank", "label_events", "sessions"))
_set_scan, _set_events = ScannedBatch.scan.__set__, ScannedBatch._events.__set__
# ``attributed``: decoded for tenant/adapter attribution (its stores carry no label: a labelled
# batch takes the typed path), so the state follows removals of labelled blocks through it
_set_attributed = ScannedBatch.attributed.__set__


def _scanner() -> Callable[..., Any] | None:
    """The compiled reader when the extension is in use (as for :func:`_event_builder`)."""
    from exporter.core.index.prefix_index import CORE

    if CORE != "compiled":
        return None
    from exporter.core.index._prefix_core import scan_kv_batch

    return scan_kv_batch


_scan = _scanner()


def decode_batch(payload: bytes, worker: str, seq: int, health: Health | None = None, *,
                 token_ids: bool = False, attribution: bool = False) -> KvBatch | None:
    """Decode one payload; ``None`` (and a ``decode`` error) when it is not a batch at all.

    A hash that is not an unsigned 64-bit int or bytes rejects the whole batch (``decode``).
    Unknown event types and unreadable events are counted (``unknown_event``, ``bad_event``)
    and left out; the rest of the batch is kept in order. ``token_ids``: fill the stored events'
    token ids (else they are left empty, but for root stores; ``token_count`` is always read).
    ``attribution``: the events' labels as ``label_events`` (with ``lora_name`` and
    ``extra_keys``); a batch whose stores carry either takes the typed path. Never raises.
    """
    if _scan is not None and not token_ids and type(payload) is bytes:
        scanned = _scan(payload, ScannedBatch, worker, seq)  # ScannedBatch.of(scan, worker, seq), built in C
        if scanned is not None:
            if not attribution:  # (built with ``attributed`` False)
                return scanned
            if not scanned.scan.labelled:
                _set_attributed(scanned, True)
                return scanned
    batch = _typed(payload, worker, seq, token_ids, attribution)
    return batch if batch is not None else decode_careful(payload, worker, seq, health, attribution=attribution)


def _careful_newer(ev: dict | tuple, events: list[KvEvent], sessions: list[SessionStore]) -> bool:
    """An event that carries ``locality`` or ``session_id``, read here (True: appended, with its
    session); False for every other event, which the careful loop reads as before. Errors are
    the loop's: this reads only events whose known fields the careful readers accept."""
    if type(ev) is dict:
        if "locality" not in ev and "session_id" not in ev:
            return False
        reader = _from_map
    else:
        n = len(ev)
        if not ((n > 12 and ev[0] == "BlockStored") or (n > 4 and ev[0] == "BlockRemoved")):
            return False
        reader = _from_array
    try:
        event = reader(ev)
    except Exception:  # the loop reads it again and words the error
        return False
    events.append(event)
    if type(event) is BlockStored:
        store = _session_store(_session_of(ev), event)
        if store is not None:
            sessions.append(store)
    return True


def decode_careful(payload: bytes, worker: str, seq: int, health: Health | None = None, *,
                   attribution: bool = False) -> KvBatch | None:
    """The careful path of :func:`decode_batch` on its own (every shape, every error worded)."""
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False, use_list=False)
    except Exception as exc:  # msgpack raises a family of ValueError/TypeError subclasses
        if health is not None:
            health.error(SOURCE, "decode", f"worker {worker} seq {seq}: not msgpack ({exc})")
        return None
    if type(obj) is not tuple or len(obj) < 2 or type(obj[1]) is not tuple \
            or type(obj[0]) not in (int, float) or not math.isfinite(obj[0]):
        if health is not None:
            health.error(SOURCE, "decode", f"worker {worker} seq {seq}: not a [ts, events, dp_rank] batch: {excerpt(obj)}")
        return None
    dp_rank = obj[2] if len(obj) > 2 and type(obj[2]) is int else None
    events: list[KvEvent] = []
    sessions: list[SessionStore] = []
    append = events.append
    new_stored, new_removed, plain = _new_stored, _new_removed, _plain
    for ev in obj[1]:
        # the newer fields: a remote block's tier, a store's session (rare: one test per event)
        if (type(ev) is dict or type(ev) is tuple) and _careful_newer(ev, events, sessions):
            continue
        # Fast path for the well-formed common shapes (int hashes, positive int block size),
        # inline so a typical event costs a few dict/tuple reads; anything unusual (bytes or
        # negative hashes, missing fields, unknown types) falls through to the careful readers,
        # which also word the errors.
        try:
            if type(ev) is dict:
                tag = ev["type"]
                if tag == "BlockStored":
                    hs, bs, p = ev["block_hashes"], ev["block_size"], ev.get("parent_block_hash")
                    if plain(hs) and type(bs) is int and bs > 0 \
                            and (p is None or (type(p) is int and 0 <= p <= MASK64)) \
                            and ((m := ev.get("medium", "GPU")) is None or type(m) is str):
                        append(new_stored(hs, p, bs, len(t) if type(t := ev.get("token_ids")) is tuple else 0, m,
                                          t if type(t) is tuple else ()))
                        continue
                elif tag == "BlockRemoved":
                    hs = ev["block_hashes"]
                    if plain(hs) and ((m := ev.get("medium", "GPU")) is None or type(m) is str):
                        append(new_removed(hs, m))
                        continue
            elif type(ev) is tuple:
                tag, n = ev[0], len(ev)
                if tag == "BlockStored":
                    hs, p, bs = ev[1], ev[2], ev[4]
                    if plain(hs) and type(bs) is int and bs > 0 \
                            and (p is None or (type(p) is int and 0 <= p <= MASK64)) \
                            and ((m := ev[6] if n > 6 else "GPU") is None or type(m) is str):
                        append(new_stored(hs, p, bs, len(t) if type(t := ev[3]) is tuple else 0, m,
                                          t if type(t) is tuple else ()))
                        continue
                elif tag == "BlockRemoved":
                    hs = ev[1]
                    if plain(hs) and ((m := ev[2] if n > 2 else "GPU") is None or type(m) is str):
                        append(new_removed(hs, m))
                        continue
        except Exception:  # any surprise is re-read (and reported) by the careful path
            pass
        try:
            if type(ev) is dict:
                append(_from_map(ev))
            elif type(ev) is tuple and ev:
                append(_from_array(ev))
            else:
                raise BadEvent("event is neither a tagged array nor a map")
        except BadHash as exc:
            if health is not None:
                health.error(SOURCE, "decode", f"worker {worker} seq {seq}: batch rejected: {exc}: {excerpt(ev)}")
            return None
        except KeyError as tag:
            if health is not None:
                health.error(SOURCE, "unknown_event", f"worker {worker} seq {seq}: event type {tag}: {excerpt(ev)}")
        except (BadEvent, TypeError, IndexError, ValueError) as exc:
            if health is not None:
                health.error(SOURCE, "bad_event", f"worker {worker} seq {seq}: {exc}: {excerpt(ev)}")
    return KvBatch(worker=worker, seq=seq, ts=float(obj[0]), events=tuple(events), dp_rank=dp_rank,
                   label_events=_labels(obj[1]) if attribution else None, sessions=tuple(sessions) or None)


def event_name(event: KvEvent) -> str:
    """The vLLM event type name (the ``event`` label of kv_events_applied)."""
    return type(event).__name__
