"""Normalised inputs: what every source adapter hands to the cluster state.

Sources (worker /metrics, KV events, request records, router /metrics) differ in names and
encodings; they all reduce to these plain values, so the state and the metric maths never see
a vendor format. Counters are cumulative as the source reports them; ``None`` means the source
does not carry that signal (which is different from zero).
"""

from __future__ import annotations

import dataclasses
import queue
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from prefixscope.records import RequestRecord


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Consecutive blocks newly cached on a worker; ``parent`` is the block before the first."""

    hashes: tuple[int, ...]
    parent: int | None
    block_size: int
    token_count: int = 0
    medium: str | None = "GPU"
    # The tokens of the stored blocks as the event sent them (vLLM's ``token_ids``), kept only
    # so a prefix family can be named (exporter/core/prefix_text.py); not part of an event's identity.
    token_ids: tuple[int, ...] = field(default=(), compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    hashes: tuple[int, ...]
    medium: str | None = "GPU"


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


def _maker(cls: type, *names: str) -> Callable[..., Any]:
    """A positional constructor for a frozen, slotted event dataclass that fills its slots directly.

    The generated ``__init__`` of a frozen dataclass assigns each field through
    ``object.__setattr__``: that is most of a decoded event's cost. This builds an equal object
    at about half of it. If the class ever gains a ``__post_init__``, loses its slots or changes
    its fields, its own constructor is used instead.
    """
    if (hasattr(cls, "__post_init__") or "__slots__" not in vars(cls)
            or tuple(f.name for f in dataclasses.fields(cls)) != names):
        return cls
    new = object.__new__
    setters = [getattr(cls, n).__set__ for n in names]
    if len(setters) == 2:
        s0, s1 = setters

        def make2(a: Any, b: Any) -> Any:
            o = new(cls)
            s0(o, a)
            s1(o, b)
            return o
        return make2
    if len(setters) == 6:
        s0, s1, s2, s3, s4, s5 = setters

        def make6(a: Any, b: Any, c: Any, d: Any, e: Any, f: Any) -> Any:
            o = new(cls)
            s0(o, a)
            s1(o, b)
            s2(o, c)
            s3(o, d)
            s4(o, e)
            s5(o, f)
            return o
        return make6
    return cls


# The decoders' fast constructors, always called with every field given.
new_stored = _maker(BlockStored, "hashes", "parent", "block_size", "token_count", "medium", "token_ids")
new_removed = _maker(BlockRemoved, "hashes", "medium")
new_stored_plain = _maker(BlockStored, "hashes", "parent", "block_size", "token_count", "medium")
CLEARED = AllBlocksCleared()


@dataclass(frozen=True, slots=True)
class StoredLabels:
    """What attribution reads of one stored event: its chain, tier, LoRA adapter and (for a root
    store) the cache salt that names its tenant. The codec reads these from the event's raw
    fields (``exporter.codecs.kv_labels``); an unreadable label is None, never an error."""

    hashes: tuple[int, ...]
    parent: int | None
    medium: str
    lora: str | None
    salt: str | None


# A labelled batch's events as attribution reads them, in order.
LabelEvent = StoredLabels | BlockRemoved | AllBlocksCleared


# One store that names its session: (session id, parent, the store's last block or None, medium).
# A plain tuple: the compiled reader builds it in C, and the typed and careful paths compare equal.
SessionStore = tuple[str, int | None, int | None, str | None]


@dataclass(frozen=True, slots=True)
class KvBatch:
    """One decoded KV-event batch of one worker (one ZMQ message)."""

    worker: str
    seq: int
    ts: float
    events: tuple[KvEvent, ...]
    dp_rank: int | None = None
    # The events with the labels the model's events leave out (LoRA adapter, cache salt), for
    # ``exporter.core.attribution``; set only when the decoder was asked for them.
    label_events: tuple[LabelEvent, ...] | None = None
    # The stores that name their request's session (vLLM >= 0.30 ``BlockStored.session_id``), in
    # order, for the session table; None when no store of the batch names one (the common case).
    sessions: tuple[SessionStore, ...] | None = None
    # The compiled reader's arrays (``_prefix_core.KvScan``) when it read the batch, which the
    # index applies without event objects; opaque here, None for a batch of plain events.
    scan: ClassVar[object | None] = None


@dataclass(frozen=True)
class Limits:
    """What clients can make the exporter hold: label values from records, sessions, hit history.

    A value beyond its limit is counted under ``other``; a value unseen for ``label_idle``
    seconds (never less than the window) frees its slot and its series are dropped.
    """

    models: int = 50
    segments: int = 50
    workers: int = 2000
    label_idle: float = 3600.0
    sessions: int = 100_000
    hit_history: int = 200_000  # hits kept for hot branches and "what changed" (an hour at most)
    adapters: int = 20  # LoRA adapter label values (records, spans, KV events)
    tenants: int = 50  # tenant label values (records, spans; KV events: cache salts)


@dataclass(slots=True)
class WorkerSnapshot:
    """One scrape of a worker's /metrics, normalised across vLLM (current and pre-0.9.2) and SGLang."""

    worker: str
    flavour: str  # "vllm", "vllm-legacy", "sglang"
    model: str | None = None
    prefix_queried_tokens: float | None = None
    prefix_hit_tokens: float | None = None
    kv_usage_ratio: float | None = None
    num_gpu_blocks: int | None = None
    block_size: int | None = None
    running: float | None = None
    waiting: float | None = None
    max_running: float | None = None
    prompt_tokens: float | None = None
    spec_draft_tokens: float | None = None
    spec_accepted_tokens: float | None = None
    requests_success: float | None = None
    # KV-connector / offload cache (vLLM's external_prefix_cache_*), where the engine exports it
    external_queried_tokens: float | None = None
    external_hit_tokens: float | None = None
    tier_hit_tokens: dict[str, float] | None = None  # cached prompt tokens by the tier that served them
    offload_usage_ratio: dict[str, float] | None = None  # offload tier (KV-event medium) -> used share of it
    # vLLM's sampled block residency (--kv-cache-metrics): "lifetime", "idle_before_evict", "reuse_gap"
    # -> its histogram summed over engines; None without the flag
    residency: dict[str, CumulativeHistogram] | None = None
    # LMCache inside the engine: "retrieve", "store", "lookup" -> its time histogram; lookup tokens and hits
    lmcache_seconds: dict[str, CumulativeHistogram] | None = None
    lmcache_lookup_tokens: float | None = None
    lmcache_lookup_hit_tokens: float | None = None


@dataclass(frozen=True, slots=True)
class CumulativeHistogram:
    """A source's histogram summed over its label sets: ``counts[i]`` observations ≤ ``bounds[i]``
    (cumulative, like ``_bucket``; the last bound is +Inf), in the catalogue's unit."""

    bounds: tuple[float, ...]
    counts: tuple[float, ...]
    sum: float
    count: float


@dataclass(slots=True)
class RouterSnapshot:
    """One scrape of a router's /metrics (``exporter.codecs.routers``: SGLang gateway, vllm-router,
    Dynamo's KV router, llm-d's scheduler). A field the router does not export stays empty/None."""

    router: str
    kind: str  # an adapter's kind: "sglang-router", "vllm-router", "dynamo", "llm-d"
    decisions: dict[str, float] = field(default_factory=dict)  # worker URL -> cumulative decisions
    healthy: dict[str, float] = field(default_factory=dict)  # worker URL -> 1/0
    prefix_outcomes: dict[str, float] = field(default_factory=dict)  # "hit"/"miss" -> cumulative count
    lookup_seconds: CumulativeHistogram | None = None  # the router's prefix-index lookup latency
    predicted_hit_ratio: CumulativeHistogram | None = None  # per request: predicted cached share of the prompt
    # (policy, outcome) -> cumulative keyed follow-ups: kept, collision, migration (the router's policy branches)
    sticky_followups: dict[tuple[str, str], float] = field(default_factory=dict)
    # kind -> cumulative faults of the router's own KV-event-fed index (apply_failed, gap_unrecovered, stream_resync)
    index_faults: dict[str, float] = field(default_factory=dict)
    kv_event_lag_seconds: CumulativeHistogram | None = None  # publisher stamp to apply, all workers
    regret_selections: float | None = None  # picks with less cached overlap than the best eligible worker
    regret_blocks: float | None = None  # cached blocks those picks gave up (summed)
    routed_requests: float | None = None  # the router's own request count
    # The router's largest prefix tree, in the router's own unit (characters of an HTTP tree, tokens
    # of a gRPC one), and the bound each tree is evicted down to (its --max-tree-size).
    largest_tree: float | None = None
    # worker URL -> the engine's prefix-cache hit ratio as the router polled it (SGLang gateway)
    engine_hit_ratio: dict[str, float] = field(default_factory=dict)
    tree_bound: float | None = None
    # routing phase -> the router's own time per request in it (Dynamo's overhead histograms, in seconds)
    overhead_seconds: dict[str, CumulativeHistogram] = field(default_factory=dict)


def unlabelled_events(batch: KvBatch) -> tuple[KvEvent, ...]:
    """A scanned batch's events from the reader's own arrays (no second decode, no token ids):
    all that attribution reads of a batch that carries no label — its stores' chains (a child
    inherits its parent's tenant), its removals and clears."""
    return batch.scan.events(new_stored_plain, new_removed, CLEARED)  # type: ignore[attr-defined]


# Root stores as events (``KvScan.root_events``), for a root tracker fed events (a shard's shared one):
# the event class's fast constructor. The state's own tracker reads ``KvScan.root_keys`` instead.
new_root_event = new_stored


class KvStreamSink(Protocol):
    """What a KV-event stream's sequence tracking tells its sink about a worker's view: a restart,
    and a rebuild from the worker's replay (the relay, which keeps no view, needs only this)."""

    def worker_restarted(self, worker: str) -> None:
        """The worker restarted (its KV-event sequence went back, as the source judges it): clear its view (its cache is empty now)."""

    def reset_view(self, worker: str) -> None:
        """A rebuild of the worker's view starts: forget the view (the replay follows)."""

    def view_repaired(self, worker: str, reason: str, reliable: bool) -> None:
        """A view was repaired after unhealed loss or drift; ``reliable`` False: the rebuild was
        incomplete (or impossible), so the view stays marked until a complete rebuild, a cache reset or a restart."""


class KvSink(KvStreamSink, Protocol):
    """What the KV-event subscribers (ZMQ, NATS) call: decoded batches and the stream's events."""

    def apply_kv_batch(self, batch: KvBatch, received_at: float) -> None:
        """Apply one decoded KV-event batch (events in order) to the worker's view and the tree."""


class StateSink(KvSink, Protocol):
    """What source adapters call. ``exporter.core.state.ClusterState`` implements it."""

    def observe_worker(self, snapshot: WorkerSnapshot, scraped_at: float) -> None:
        """A successful scrape of a worker's /metrics."""

    def observe_router(self, snapshot: RouterSnapshot, scraped_at: float) -> None:
        """A successful scrape of a router's /metrics."""

    def ingest_records(self, records: Sequence[RequestRecord], received_at: float) -> None:
        """Request records that passed the prefixscope.request/v1 schema."""

    def signal_seen(self, signal: str, ts: float) -> None:
        """A source other than records and scrapes carried ``signal`` (a catalogue signal) at ``ts``."""


# Asks the KV source to rebuild a worker's view from its replay; False when it cannot (no replay
# endpoint). The source tells the sink ``reset_view`` and then ``view_repaired`` when it is done.
RebuildRequest = Callable[[str, str], bool]


class RebuildRequests:
    """The views the state asks its KV source to rebuild: asked from any thread, taken by the source
    on its own. The composition root makes one and hands it to both, so neither holds the other."""

    def __init__(self, replayable: Iterable[str]) -> None:
        self.replayable = frozenset(replayable)  # workers with a replay endpoint: only they can be rebuilt
        self._asked: queue.SimpleQueue[tuple[str, str]] = queue.SimpleQueue()

    def __call__(self, worker: str, reason: str) -> bool:
        """Ask for ``worker``'s view to be rebuilt (a :data:`RebuildRequest`); False if it cannot be."""
        if worker not in self.replayable:
            return False
        self._asked.put((worker, reason))
        return True

    def take(self) -> tuple[str, str] | None:
        """The oldest request not yet taken, as (worker, reason)."""
        try:
            return self._asked.get_nowait()
        except queue.Empty:
            return None

    def empty(self) -> bool:
        return self._asked.empty()
