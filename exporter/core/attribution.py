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
the raw fields only when the exporter's ``attribution`` switch is on, and reads them into
label events (``exporter.codecs.kv_labels``): this module sees only model values.

Bounds. The resident gauges keep the ``top_adapters`` / ``top_tenants`` values with the most blocks (cluster-wide) and sum
the rest under ``other``, so totals stay whole; the tracker itself knows at most
``max_values`` distinct labels and counts newer ones as ``other`` at once. The record counters use
:class:`exporter.core.cardinality.LabelBudget` (a value idle long enough frees its slot and its series).
Not thread-safe: ``ClusterState`` calls everything here under its lock.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping

from exporter.core.cardinality import OTHER, LabelBudget
from exporter.core.metric_store import MetricStore
from exporter.model import BlockRemoved, BlockStored, KvEvent, LabelEvent, StoredLabels
from prefixscope import catalog
from prefixscope.records import RequestRecord

NONE = "none"  # the label of blocks and requests that name no adapter (no tenant)
DEFAULT_MEDIUM = "GPU"  # an event without a medium (vLLM before tiers) acts on the GPU pool

P = catalog.NAMESPACE
ADAPTER_RESIDENT = f"{P}_adapter_resident_blocks"
TENANT_RESIDENT = f"{P}_tenant_resident_blocks"
ADAPTER_QUERIED = f"{P}_adapter_prefix_cache_queried_tokens"
ADAPTER_HIT = f"{P}_adapter_prefix_cache_hit_tokens"
TENANT_QUERIED = f"{P}_tenant_prefix_cache_queried_tokens"
TENANT_HIT = f"{P}_tenant_prefix_cache_hit_tokens"

Key = tuple[str, str]  # (adapter, tenant)


class KvAttribution:
    """Which adapter and tenant each resident block was stored for, per (worker, medium).

    Fed the ``label_events`` of decoded batches (:meth:`apply`); told when a worker's view is
    dropped (:meth:`clear_worker`). :meth:`resident` turns it into the two gauges with the index's
    counts for the unlabelled rest.
    """

    def __init__(self, top_adapters: int = 20, top_tenants: int = 50, max_values: int = 1000) -> None:
        self.top_adapters = top_adapters
        self.top_tenants = top_tenants
        self.max_values = max_values
        self.seen = False  # a batch with attribution fields arrived (the gauges exist from then on)
        self._key_id: dict[Key, int] = {}
        self._keys: list[Key] = []
        self._adapters: set[str] = set()
        self._tenants: set[str] = set()
        # worker -> medium -> labelled block -> key id; a worker is here only while it has some
        self._blocks: dict[str, dict[str, dict[int, int]]] = {}
        self._counts: dict[str, dict[str, Counter[int]]] = {}  # worker -> medium -> key id -> blocks
        # A family shard keeps only the labelled blocks of its own families (exporter.core.sharding):
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

    def apply(self, worker: str, events: Iterable[LabelEvent | KvEvent]) -> None:
        """One batch's events, in order (after the index applied them): a labelled batch's label
        events (``KvBatch.label_events``), or a batch's plain events, which carry no label."""
        self.seen = True
        if worker not in self._blocks:
            # Nothing labelled on this worker: removals and resets cannot change anything and a
            # store with a parent has no tenant to inherit, so only stores naming an adapter or a
            # salt count.
            for ev in events:
                if type(ev) is StoredLabels and (ev.lora is not None or ev.salt is not None):
                    self._stored(worker, ev.hashes, ev.parent, ev.medium, ev.lora, ev.salt)
            return
        for ev in events:
            kind = type(ev)
            if kind is StoredLabels:
                self._stored(worker, ev.hashes, ev.parent, ev.medium, ev.lora, ev.salt)  # type: ignore[union-attr]
            elif kind is BlockStored:
                if ev.parent is not None:  # type: ignore[union-attr]
                    self._stored(worker, ev.hashes, ev.parent, ev.medium or DEFAULT_MEDIUM, None, None)  # type: ignore[union-attr]
            elif kind is BlockRemoved:
                self._removed(worker, ev.hashes, ev.medium or DEFAULT_MEDIUM)  # type: ignore[union-attr]
            else:
                self.clear_worker(worker)

    def apply_unlabelled(self, worker: str, events: Iterable[KvEvent]) -> None:
        """A batch that carries no label, as model events (``model.unlabelled_events``): its
        stores take only an inherited tenant, its removals and clears take labels away."""
        self.seen = True
        if worker in self._blocks:
            self.apply(worker, events)

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

    def labels_of(self, block: int, workers: Iterable[str]) -> tuple[str | None, str | None]:
        """(adapter, tenant) a resident block was stored for on the first of ``workers`` that
        holds it labelled; (None, None) when none does (no adapter, no salt, or unattributed)."""
        for worker in workers:
            for blocks in self._blocks.get(worker, {}).values():
                kid = blocks.get(block)
                if kid is not None:
                    adapter, tenant = self._keys[kid]
                    return (None if adapter == NONE else adapter), (None if tenant == NONE else tenant)
        return None, None

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
