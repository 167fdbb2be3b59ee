"""Tenant and adapter attribution: resident blocks and prefix-cache hits per LoRA adapter and
per tenant (vLLM's ``cache_salt``), with bounded label sets.

Where the labels come from:

- **KV events.** vLLM's ``BlockStored`` names the request's LoRA adapter (``lora_name``, ≥ 0.14)
  and lists per block what the block hash mixes in besides the tokens (``extra_keys``, ≥ 0.20:
  the adapter, multimodal ids and, for a prompt's *first* block only, the request's
  ``cache_salt``). So a chain's tenant is read once, at its root (a store without a parent), and
  every later block of the chain inherits it from its parent: a salt changes the root's hash and
  so the hash of every block after it, which is why no two tenants share a salted block. The
  salt is the last string of the root block's entry that is neither the adapter's name nor a
  hex digest (a multimodal hash); an entry whose last value is something else names no tenant.
  A block stored by a request with neither an adapter nor a salt is labelled :data:`NONE`.
- **Records and spans.** ``lora_name`` and ``tenant`` of ``prefixscope.request/v1`` (spans: the
  attributes the OTLP config names) count queried and hit prompt tokens per adapter and tenant.

Cost. The KV tracker keeps a hash → label entry only for blocks that *have* a label: a fleet
without adapters or salts keeps nothing and reads only its stored events. The unlabelled
blocks of a (worker, medium) are the index's count minus the labelled ones. The decoder keeps
the raw fields only when the exporter's ``attribution`` switch is on (``kvcodec``).

Bounds. The resident gauges keep the ``top_adapters`` / ``top_tenants`` values with the most blocks (cluster-wide) and sum
the rest under ``other``, so totals stay whole; the tracker itself knows at most
``max_values`` distinct labels and counts newer ones as ``other`` at once. The record counters use
:class:`exporter.cardinality.LabelBudget` (a value idle long enough frees its slot and its series).
Not thread-safe: ``ClusterState`` calls everything here under its lock.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from itertools import compress

import msgpack
import msgspec

from exporter.cardinality import OTHER, LabelBudget
from exporter.kvcodec import CLEARED_STRUCTS, LABELLED_STORED, MASK64, REMOVED_STRUCTS
from exporter.metric_store import MetricStore
from exporter.model import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from prefixscope import catalog
from prefixscope.records import RequestRecord

NONE = "none"  # the label of blocks and requests that name no adapter (no tenant)
DEFAULT_MEDIUM = "GPU"  # an event without a medium (vLLM before tiers) acts on the GPU pool
_NIL = msgspec.Raw(b"\xc0")  # a raw msgpack nil (a field left out reads as this too)
_UNSEEN = object()
_DIGEST = re.compile(r"[0-9a-fA-F]{64}")  # 256-bit hex  # a multimodal content hash, not a salt
_LORA_CACHE_MAX = 4096

P = catalog.NAMESPACE
ADAPTER_RESIDENT = f"{P}_adapter_resident_blocks"
TENANT_RESIDENT = f"{P}_tenant_resident_blocks"
ADAPTER_QUERIED = f"{P}_adapter_prefix_cache_queried_tokens"
ADAPTER_HIT = f"{P}_adapter_prefix_cache_hit_tokens"
TENANT_QUERIED = f"{P}_tenant_prefix_cache_queried_tokens"
TENANT_HIT = f"{P}_tenant_prefix_cache_hit_tokens"

Key = tuple[str, str]  # (adapter, tenant)


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


class _Reader:
    """The adapter and root salt of stored events, from typed structs (raw msgpack fields) or
    from the careful path's maps and arrays; unreadable values read as None (a label is never
    worth rejecting blocks the index accepted)."""

    def __init__(self) -> None:
        self._lora: dict[bytes, str | None] = {}  # raw msgpack -> adapter name (few distinct values)

    def lora(self, raw: msgspec.Raw) -> str | None:
        if raw == _NIL:
            return None
        key = bytes(raw)
        name = self._lora.get(key, _UNSEEN)
        if name is _UNSEEN:
            try:
                value = _unpack(key)
            except Exception:  # garbage in a field the index does not need: no label
                value = None
            name = value if type(value) is str and value else None
            if len(self._lora) >= _LORA_CACHE_MAX:
                self._lora.clear()
            self._lora[key] = name
        return name  # type: ignore[return-value]

    @staticmethod
    def salt(raw: msgspec.Raw, lora_name: str | None) -> str | None:
        if raw == _NIL:
            return None
        try:
            return salt_of(_first_entry(_unpack(raw)), lora_name)
        except Exception:
            return None


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
    return out if len(out) == len(hs) else ()


# A careful-path event normalised: ("stored", hashes, parent, medium, lora, salt), ("removed", hashes,
# medium), ("cleared",) or None when unreadable.
_Plain = tuple


def _plain(ev: object) -> _Plain | None:
    """The fields attribution reads from a raw msgpack event (map or tagged array)."""
    try:
        if type(ev) is dict:
            tag = ev.get("type")
            if tag == "BlockStored":
                lora = ev.get("lora_name")
                lora = lora if type(lora) is str and lora else None
                parent = ev.get("parent_block_hash")
                salt = salt_of(_first_entry(ev.get("extra_keys")), lora) if parent is None else None
                return ("stored", _hash_list(ev.get("block_hashes")), None if parent is None else _u64(parent),
                        ev.get("medium", DEFAULT_MEDIUM), lora, salt)
            if tag == "BlockRemoved":
                return ("removed", _hash_list(ev.get("block_hashes")), ev.get("medium", DEFAULT_MEDIUM))
            return ("cleared",) if tag == "AllBlocksCleared" else None
        if type(ev) is tuple and ev:
            tag, n = ev[0], len(ev)
            if tag == "BlockStored" and n >= 5:
                lora = ev[7] if n > 7 and type(ev[7]) is str and ev[7] else None
                parent = ev[2]
                salt = salt_of(_first_entry(ev[8] if n > 8 else None), lora) if parent is None else None
                return ("stored", _hash_list(ev[1]), None if parent is None else _u64(parent),
                        ev[6] if n > 6 else DEFAULT_MEDIUM, lora, salt)
            if tag == "BlockRemoved" and n >= 2:
                return ("removed", _hash_list(ev[1]), ev[2] if n > 2 else DEFAULT_MEDIUM)
            return ("cleared",) if tag == "AllBlocksCleared" else None
    except Exception:
        return None
    return None


_IS_LABELLED_STORED = frozenset(LABELLED_STORED).__contains__


def _no_salt(raw: msgspec.Raw) -> bool:
    """True when raw ``extra_keys`` surely name no salt: nil, or an array whose first entry is nil
    (read off the msgpack header, without decoding the rest)."""
    if raw == _NIL:
        return True
    b = bytes(raw)
    head = b[0]
    at = 1 if 0x90 <= head <= 0x9F else 3 if head == 0xDC else 5 if head == 0xDD else 0
    return at > 0 and len(b) > at and b[at] == 0xC0


_MODEL_EVENTS = (BlockStored, BlockRemoved, AllBlocksCleared)


class KvAttribution:
    """Which adapter and tenant each resident block was stored for, per (worker, medium).

    Fed the ``raw_events`` of decoded batches (:meth:`apply`); told when a worker's view is
    dropped (:meth:`clear_worker`). :meth:`resident` turns it into the two gauges with the index's
    counts for the unlabelled rest.
    """

    def __init__(self, top_adapters: int = 20, top_tenants: int = 50, max_values: int = 1000) -> None:
        self.top_adapters = top_adapters
        self.top_tenants = top_tenants
        self.max_values = max_values
        self.seen = False  # a batch with attribution fields arrived (the gauges exist from then on)
        self._read = _Reader()
        self._key_id: dict[Key, int] = {}
        self._keys: list[Key] = []
        self._adapters: set[str] = set()
        self._tenants: set[str] = set()
        # worker -> medium -> labelled block -> key id; a worker is here only while it has some
        self._blocks: dict[str, dict[str, dict[int, int]]] = {}
        self._counts: dict[str, dict[str, Counter[int]]] = {}  # worker -> medium -> key id -> blocks
        # A family shard keeps only the labelled blocks of its own families (exporter.sharding):
        # its index holds only those, and the rest of each worker is counted against them.
        self.keeps: Callable[[int], bool] | None = None

    # ---- labels ------------------------------------------------------------------------------
    def _bounded(self, value: str, known: set[str]) -> str:
        if value == NONE or value in known:
            return value
        if len(known) >= self.max_values:
            return OTHER
        known.add(value)
        return value

    def _key(self, adapter: str | None, tenant: str | None) -> int:
        key = (self._bounded(adapter or NONE, self._adapters), self._bounded(tenant or NONE, self._tenants))
        kid = self._key_id.get(key)
        if kid is None:
            kid = self._key_id[key] = len(self._keys)
            self._keys.append(key)
        return kid

    # ---- events ------------------------------------------------------------------------------
    def holds_labels(self, worker: str) -> bool:
        """The worker holds labelled blocks: its removals and clears change what is attributed.
        A batch without labels for a worker that holds none changes nothing here (the compiled
        reader's batches skip :meth:`apply` then; :meth:`note_batch` keeps the gauges alive)."""
        return worker in self._blocks

    def note_batch(self) -> None:
        """A batch arrived that needed no attribution work: the gauges exist from now on."""
        self.seen = True

    def apply(self, worker: str, raw_events: tuple[object, ...]) -> None:
        """One batch's events, in order (after the index applied them)."""
        self.seen = True
        if not raw_events:
            return
        first = raw_events[0]
        if type(first) is dict or type(first) is tuple:  # the careful path's raw events
            self._apply_plain(worker, raw_events)
            return
        if type(first) in _MODEL_EVENTS:  # a scanned batch's events, which carry no label
            self.apply_unlabelled(worker, raw_events)  # type: ignore[arg-type]
            return
        if worker not in self._blocks:
            # Nothing labelled on this worker: removals and resets cannot change anything and a
            # store with a parent has no tenant to inherit, so only the stored events are read
            # (picked out at C speed), and of those only the ones naming an adapter or a salt.
            for ev in compress(raw_events, map(_IS_LABELLED_STORED, map(type, raw_events))):
                if ev.lora_name == _NIL and (ev.parent_block_hash is not None or _no_salt(ev.extra_keys)):
                    continue
                self._stored_struct(worker, ev)
            return
        for ev in raw_events:
            kind = type(ev)
            if kind in LABELLED_STORED:
                self._stored_struct(worker, ev)
            elif kind in REMOVED_STRUCTS:
                self._removed(worker, ev.block_hashes, ev.medium or DEFAULT_MEDIUM)
            elif kind in CLEARED_STRUCTS:
                self.clear_worker(worker)

    def apply_unlabelled(self, worker: str, events: Iterable[KvEvent]) -> None:
        """A batch that carries no label, as model events (``kvcodec.unlabelled_events``): its
        stores take only an inherited tenant, its removals and clears take labels away."""
        self.seen = True
        if worker not in self._blocks:
            return  # nothing labelled here: nothing to inherit or take away
        for ev in events:
            kind = type(ev)
            if kind is BlockStored:
                if ev.parent is not None:  # type: ignore[attr-defined]
                    self._stored(worker, ev.hashes, ev.parent, ev.medium or DEFAULT_MEDIUM, None, None)  # type: ignore[attr-defined]
            elif kind is BlockRemoved:
                self._removed(worker, ev.hashes, ev.medium or DEFAULT_MEDIUM)  # type: ignore[attr-defined]
            else:
                self.clear_worker(worker)

    def _stored_struct(self, worker: str, ev: object) -> None:
        read = self._read
        lora = read.lora(ev.lora_name)  # type: ignore[attr-defined]
        parent = ev.parent_block_hash  # type: ignore[attr-defined]
        salt = read.salt(ev.extra_keys, lora) if parent is None else None  # type: ignore[attr-defined]
        self._stored(worker, ev.block_hashes, parent, ev.medium or DEFAULT_MEDIUM, lora, salt)  # type: ignore[attr-defined]

    def _apply_plain(self, worker: str, raw_events: tuple[object, ...]) -> None:
        for ev in raw_events:
            p = _plain(ev)
            if p is None:
                continue
            if p[0] == "stored":
                medium = p[3] if type(p[3]) is str else DEFAULT_MEDIUM
                self._stored(worker, p[1], p[2], medium, p[4], p[5])
            elif p[0] == "removed":
                self._removed(worker, p[1], p[2] if type(p[2]) is str else DEFAULT_MEDIUM)
            else:
                self.clear_worker(worker)

    def _tenant_of_parent(self, worker: str, parent: int, medium: str) -> str | None:
        media = self._blocks.get(worker)
        if not media:
            return None
        kid = media.get(medium, {}).get(parent)
        if kid is None:  # the parent may sit on another tier (offloaded chains keep their root)
            kid = next((b[parent] for b in media.values() if parent in b), None)
        return None if kid is None else self._keys[kid][1]

    def _stored(self, worker: str, hashes: tuple[int, ...], parent: int | None, medium: str,
                lora: str | None, salt: str | None) -> None:
        tenant = salt if parent is None else self._tenant_of_parent(worker, parent, medium)
        if (lora is None and tenant is None) or not hashes:
            return  # unlabelled: counted as the index's rest
        if self.keeps is not None:
            hashes = tuple(filter(self.keeps, hashes))
            if not hashes:
                return
        kid = self._key(lora, tenant)
        blocks = self._blocks.setdefault(worker, {}).setdefault(medium, {})
        counts = self._counts.setdefault(worker, {}).setdefault(medium, Counter())
        for h in hashes:
            if h not in blocks:  # a block already resident keeps the label it was stored with
                blocks[h] = kid
                counts[kid] += 1

    def _removed(self, worker: str, hashes: Iterable[int], medium: str) -> None:
        blocks = self._blocks.get(worker, {}).get(medium)
        if not blocks:
            return
        counts = self._counts[worker][medium]
        for h in hashes:
            kid = blocks.pop(h, None)
            if kid is not None:
                counts[kid] -= 1
        if not blocks:
            del self._blocks[worker][medium], self._counts[worker][medium]
            if not self._blocks[worker]:
                del self._blocks[worker], self._counts[worker]

    def clear_worker(self, worker: str) -> None:
        """The worker's view was dropped (reset, restart, repair): its labels go with it."""
        self._blocks.pop(worker, None)
        self._counts.pop(worker, None)

    # ---- gauges ------------------------------------------------------------------------------
    def resident(self, index_resident: Mapping[str, Mapping[str, int]]
                 ) -> tuple[dict[tuple[str, str], float], dict[tuple[str, str], float]]:
        """(adapter, medium) -> blocks and (tenant, medium) -> blocks, cluster-wide, top-K + other.

        ``index_resident``: worker -> medium -> resident blocks (the index's), whose unlabelled
        rest is counted under :data:`NONE`.
        """
        adapters: Counter[tuple[str, str]] = Counter()
        tenants: Counter[tuple[str, str]] = Counter()
        for worker, media in index_resident.items():
            counts = self._counts.get(worker, {})
            for medium, total in media.items():
                labelled = counts.get(medium, Counter())
                rest = total
                for kid, n in labelled.items():
                    if n <= 0:
                        continue
                    adapter, tenant = self._keys[kid]
                    adapters[(adapter, medium)] += n
                    tenants[(tenant, medium)] += n
                    rest -= n
                if rest > 0 or not labelled:  # (an empty cache reads 0, not missing)
                    adapters[(NONE, medium)] += max(0, rest)
                    tenants[(NONE, medium)] += max(0, rest)
        return top_k(adapters, self.top_adapters), top_k(tenants, self.top_tenants)


def top_k(values: Mapping[tuple[str, str], float], k: int) -> dict[tuple[str, str], float]:
    """Keep the ``k`` first-label values with the largest totals (and :data:`NONE`); sum the rest
    under :data:`OTHER`, per second label, so every total stays whole."""
    totals: Counter[str] = Counter()
    for (value, _), n in values.items():
        totals[value] += n
    kept = {v for v, _ in sorted(((v, n) for v, n in totals.items() if v not in (NONE, OTHER)),
                                 key=lambda vn: (-vn[1], vn[0]))[:k]}
    kept.add(NONE)
    out: dict[tuple[str, str], float] = {}
    for (value, second), n in values.items():
        label = (value if value in kept else OTHER, second)
        out[label] = out.get(label, 0.0) + float(n)
    return out


class RecordAttribution:
    """Queried and hit prompt tokens per adapter and per tenant, from records and spans.

    A record counts when it carries ``cached_tokens`` (the hit needs it) and names an adapter or a
    tenant — or once any record has named one (then a record naming neither counts as
    :data:`NONE`): a fleet whose producers never send the fields gets no series at all.
    """

    def __init__(self, store: MetricStore, adapters: int, tenants: int, idle_s: float) -> None:
        self.store = store
        self.adapter = LabelBudget("adapter", adapters, idle_s, pinned=(NONE,))
        self.tenant = LabelBudget("tenant", tenants, idle_s, pinned=(NONE,))
        self.named = False

    def account(self, rec: RequestRecord, now: float) -> None:
        """One record, at the exporter's input time ``now`` (which ages the label budgets)."""
        self.expire(now)
        if rec.lora_name is not None or rec.tenant is not None:
            self.named = True
        if not self.named or rec.cached_tokens is None:
            return
        ts, inc = rec.ts, self.store.inc
        adapter = self.adapter.admit(rec.lora_name or NONE, ts)
        tenant = self.tenant.admit(rec.tenant or NONE, ts)
        hit = float(min(rec.cached_tokens, rec.prompt_tokens))
        inc(ts, ADAPTER_QUERIED, (adapter,), float(rec.prompt_tokens))
        inc(ts, ADAPTER_HIT, (adapter,), hit)
        inc(ts, TENANT_QUERIED, (tenant,), float(rec.prompt_tokens))
        inc(ts, TENANT_HIT, (tenant,), hit)

    def expire(self, now: float) -> None:
        """Drop the series of values idle long enough (O(values expired))."""
        for budget in (self.adapter, self.tenant):
            for value in budget.expire(now):
                self.store.drop_label_value(budget.label, value)


class Attribution:
    """The KV tracker and the record counters, as ``ClusterState`` holds them."""

    def __init__(self, store: MetricStore, adapters: int, tenants: int, idle_s: float) -> None:
        self.kv = KvAttribution(adapters, tenants, max_values=max(10 * (adapters + tenants), 100))
        self.records = RecordAttribution(store, adapters, tenants, idle_s)

    def gauges(self, index_resident: Mapping[str, Mapping[str, int]]) -> dict[str, dict[tuple[str, ...], float]]:
        """The resident gauges (none before a batch with attribution fields arrived)."""
        if not self.kv.seen:
            return {}
        adapters, tenants = self.kv.resident(index_resident)
        return {ADAPTER_RESIDENT: dict(adapters), TENANT_RESIDENT: dict(tenants)}
