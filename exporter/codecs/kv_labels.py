"""The labels a KV batch carries, read from its raw fields: LoRA adapter and tenant (cache salt).

vLLM's ``BlockStored`` names the request's LoRA adapter (``lora_name``, ≥ 0.14) and lists per
block what the block hash mixes in besides the tokens (``extra_keys``, ≥ 0.20: the adapter,
multimodal ids and, for a prompt's *first* block only, the request's ``cache_salt``). The salt is
the last string of the root block's entry that is neither the adapter's name nor a hex digest (a
multimodal hash); an entry whose last value is something else names no tenant.

The decoder keeps both fields raw (unparsed msgpack, so garbage in them cannot reject a batch
whose blocks are well formed) and hands the batch's events here; :func:`label_events` turns them
into the model's :data:`~exporter.model.LabelEvent` values that ``exporter.core.attribution``
reads. An unreadable label reads as None: a label is never worth rejecting blocks the index
accepted. Inputs are the typed path's structs or the careful path's raw maps and tagged arrays.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import msgpack
import msgspec

from exporter.core.index.tiers import EXTERNAL
from exporter.model import CLEARED, BlockRemoved, LabelEvent, StoredLabels

MASK64 = 0xFFFF_FFFF_FFFF_FFFF
DEFAULT_MEDIUM = "GPU"  # an event without a medium (vLLM before tiers) acts on the GPU pool
_NIL = msgspec.Raw(b"\xc0")  # a raw msgpack nil (a field left out reads as this too)
_UNSEEN = object()
_DIGEST = re.compile(r"[0-9a-fA-F]{64}")  # 256-bit hex: a multimodal content hash, not a salt
_LORA_CACHE_MAX = 4096


def _unpack(raw: bytes) -> object:
    return msgpack.unpackb(raw, raw=False, strict_map_key=False, use_list=False)


def salt_of(entry: object, lora_name: str | None) -> str | None:
    """The cache salt in one block's ``extra_keys`` entry (the root block's), or None."""
    if type(entry) not in (tuple, list) or not entry:
        return None
    last = entry[-1]
    if type(last) is not str or not last or last == lora_name or _DIGEST.fullmatch(last):
        return None
    return last


def _first_entry(extra: object) -> object:
    return extra[0] if type(extra) in (tuple, list) and extra else None


_lora_names: dict[bytes, str | None] = {}  # raw msgpack -> adapter name (few distinct values)


def _lora(raw: msgspec.Raw) -> str | None:
    if raw == _NIL:
        return None
    key = bytes(raw)
    name = _lora_names.get(key, _UNSEEN)
    if name is _UNSEEN:
        try:
            value = _unpack(key)
        except Exception:  # garbage in a field the index does not need: no label
            value = None
        name = value if type(value) is str and value else None
        if len(_lora_names) >= _LORA_CACHE_MAX:
            _lora_names.clear()
        _lora_names[key] = name
    return name  # type: ignore[return-value]


def _salt(raw: msgspec.Raw, lora_name: str | None) -> str | None:
    if raw == _NIL:
        return None
    try:
        return salt_of(_first_entry(_unpack(raw)), lora_name)
    except Exception:
        return None


def _no_salt(raw: msgspec.Raw) -> bool:
    """True when raw ``extra_keys`` surely name no salt: nil, or an array whose first entry is nil
    (read off the msgpack header, without decoding the rest)."""
    if raw == _NIL:
        return True
    b = bytes(raw)
    head = b[0]
    at = 1 if 0x90 <= head <= 0x9F else 3 if head == 0xDC else 5 if head == 0xDD else 0
    return at > 0 and len(b) > at and b[at] == 0xC0


def _u64(h: object) -> int | None:
    if type(h) is int:
        return h if 0 <= h <= MASK64 else None
    if isinstance(h, bytes | bytearray) and h:
        return int.from_bytes(bytes(h[-8:]), "big")
    return None


def _hash_list(hs: object) -> tuple[int, ...]:
    if type(hs) not in (tuple, list):
        return ()
    out = tuple(h for h in map(_u64, hs) if h is not None)
    return out if len(out) == len(hs) else ()  # type: ignore[arg-type]


def _medium(value: object) -> str:
    return value if type(value) is str else DEFAULT_MEDIUM


def _plain(ev: object) -> LabelEvent | None:
    """One careful-path event (a raw map or tagged array) as a label event; None when unreadable."""
    try:
        if type(ev) is dict:
            tag = ev.get("type")
            if tag == "BlockStored":
                lora = ev.get("lora_name")
                lora = lora if type(lora) is str and lora else None
                parent = ev.get("parent_block_hash")
                salt = salt_of(_first_entry(ev.get("extra_keys")), lora) if parent is None else None
                return StoredLabels(_hash_list(ev.get("block_hashes")), None if parent is None else _u64(parent),
                                    _local(_medium(ev.get("medium", DEFAULT_MEDIUM)), ev.get("locality")), lora, salt)
            if tag == "BlockRemoved":
                return BlockRemoved(_hash_list(ev.get("block_hashes")),
                                    _local(_medium(ev.get("medium", DEFAULT_MEDIUM)), ev.get("locality")))
            return CLEARED if tag == "AllBlocksCleared" else None
        if type(ev) is tuple and ev:
            tag, n = ev[0], len(ev)
            if tag == "BlockStored" and n >= 5:
                lora = ev[7] if n > 7 and type(ev[7]) is str and ev[7] else None
                parent = ev[2]
                salt = salt_of(_first_entry(ev[8] if n > 8 else None), lora) if parent is None else None
                return StoredLabels(_hash_list(ev[1]), None if parent is None else _u64(parent),
                                    _local(_medium(ev[6] if n > 6 else DEFAULT_MEDIUM), ev[12] if n > 12 else None),
                                    lora, salt)
            if tag == "BlockRemoved" and n >= 2:
                return BlockRemoved(_hash_list(ev[1]), _local(_medium(ev[2] if n > 2 else DEFAULT_MEDIUM),
                                                              ev[4] if n > 4 else None))
            return CLEARED if tag == "AllBlocksCleared" else None
    except Exception:
        return None
    return None


def _local(medium: str, locality: object) -> str:
    """A block vLLM marks ``locality: REMOTE`` is held outside the worker: the ``EXTERNAL`` tier."""
    return EXTERNAL if locality == "REMOTE" else medium


def _stored_struct(ev: object) -> StoredLabels:
    """A typed stored struct's labels; the adapter and salt are read only when they can name one."""
    parent = ev.parent_block_hash  # type: ignore[attr-defined]
    medium = _local(ev.medium or DEFAULT_MEDIUM, ev.locality)  # type: ignore[attr-defined]
    raw_lora, extra = ev.lora_name, ev.extra_keys  # type: ignore[attr-defined]
    if raw_lora == _NIL and (parent is not None or _no_salt(extra)):
        return StoredLabels(ev.block_hashes, parent, medium, None, None)  # type: ignore[attr-defined]
    lora = _lora(raw_lora)
    salt = _salt(extra, lora) if parent is None else None
    return StoredLabels(ev.block_hashes, parent, medium, lora, salt)  # type: ignore[attr-defined]


def struct_reader(stored: tuple[type, ...], removed: tuple[type, ...],
                  cleared: tuple[type, ...]) -> Callable[[tuple[object, ...]], tuple[LabelEvent, ...]]:
    """The reader of one decoder's events: its typed stored/removed/cleared struct types, and the
    careful path's raw maps and arrays."""

    def label_events(raw_events: tuple[object, ...]) -> tuple[LabelEvent, ...]:
        out: list[LabelEvent] = []
        append = out.append
        for ev in raw_events:
            kind = type(ev)
            if kind in stored:
                append(_stored_struct(ev))
            elif kind in removed:
                append(BlockRemoved(ev.block_hashes, _local(ev.medium or DEFAULT_MEDIUM, ev.locality)))  # type: ignore[attr-defined]
            elif kind in cleared:
                append(CLEARED)
            else:
                p = _plain(ev)
                if p is not None:
                    append(p)
        return tuple(out)

    return label_events
