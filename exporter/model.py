"""Normalised inputs: what every source adapter hands to the cluster state.

Sources (worker /metrics, KV events, request records, router /metrics) differ in names and
encodings; they all reduce to these plain values, so the state and the metric maths never see
a vendor format. Counters are cumulative as the source reports them; ``None`` means the source
does not carry that signal (which is different from zero).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

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
    # so a prefix family can be named (exporter/prefix_text.py); not part of an event's identity.
    token_ids: tuple[int, ...] = field(default=(), compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    hashes: tuple[int, ...]
    medium: str | None = "GPU"


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class KvBatch:
    """One decoded KV-event batch of one worker (one ZMQ message)."""

    worker: str
    seq: int
    ts: float
    events: tuple[KvEvent, ...]
    dp_rank: int | None = None
    # The events as decoded, for readers of fields the model leaves out (LoRA adapter, cache
    # salt: ``exporter.attribution``); set only when the decoder was asked for them. Each item is
    # a typed stored/removed struct of ``exporter.kvcodec`` or, from its careful path, the raw
    # msgpack event (a map or a tagged array), not necessarily aligned with ``events``.
    raw_events: tuple[object, ...] | None = None


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


@dataclass(frozen=True, slots=True)
class CumulativeHistogram:
    """A router histogram summed over its label sets: ``counts[i]`` observations ≤ ``bounds[i]``
    (cumulative, like ``_bucket``; the last bound is +Inf), in the catalogue's unit."""

    bounds: tuple[float, ...]
    counts: tuple[float, ...]
    sum: float
    count: float


@dataclass(slots=True)
class RouterSnapshot:
    """One scrape of a router's /metrics (``exporter.routers``: SGLang gateway, vllm-router,
    Dynamo's KV router, llm-d's scheduler). A field the router does not export stays empty/None."""

    router: str
    kind: str  # an adapter's kind: "sglang-router", "vllm-router", "dynamo", "llm-d"
    decisions: dict[str, float] = field(default_factory=dict)  # worker URL -> cumulative decisions
    healthy: dict[str, float] = field(default_factory=dict)  # worker URL -> 1/0
    prefix_outcomes: dict[str, float] = field(default_factory=dict)  # "hit"/"miss" -> cumulative count
    lookup_seconds: CumulativeHistogram | None = None  # the router's prefix-index lookup latency
    predicted_hit_ratio: CumulativeHistogram | None = None  # per request: predicted cached share of the prompt


class StateSink(Protocol):
    """What source adapters call. ``exporter.state.ClusterState`` implements it."""

    def apply_kv_batch(self, batch: KvBatch, received_at: float) -> None:
        """Apply one decoded KV-event batch (events in order) to the worker's view and the tree."""

    def worker_restarted(self, worker: str) -> None:
        """The worker's sequence restarted at 0: clear its view (its cache is empty now)."""

    def reset_view(self, worker: str) -> None:
        """A rebuild of the worker's view starts: forget the view (the replay follows)."""

    def view_repaired(self, worker: str, reason: str, reliable: bool) -> None:
        """A view was repaired after unhealed loss or drift; ``reliable`` False: the rebuild was
        incomplete (or impossible), so the view stays marked until the worker's cache turns over."""

    def observe_worker(self, snapshot: WorkerSnapshot, scraped_at: float) -> None:
        """A successful scrape of a worker's /metrics."""

    def observe_router(self, snapshot: RouterSnapshot, scraped_at: float) -> None:
        """A successful scrape of a router's /metrics."""

    def ingest_records(self, records: Sequence[RequestRecord], received_at: float) -> None:
        """Request records that passed the prefixscope.request/v1 schema."""

    def signal_seen(self, signal: str, ts: float) -> None:
        """A source other than records and scrapes carried ``signal`` (a catalogue signal) at ``ts``."""
