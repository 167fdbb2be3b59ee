"""NVIDIA Dynamo's KV-event messages → ``exporter.model.KvBatch`` values (pure; no NATS here).

Dynamo's worker-side ``KvEventPublisher`` (the engine's ZMQ events relayed, or events pushed
through its Python API) publishes ``RouterEvent`` values on its event plane. What arrives, as
published by the ``ai-dynamo-runtime`` wheels themselves (tests/e2e/test_dynamo_runtime.py):

* **1.6 and later** (event plane, core NATS): subject
  ``namespace.<ns>.component.<component>.endpoint.<endpoint>.kv-events``; a MessagePack
  ``EventEnvelope {publisher_id, sequence, published_at (ms), topic, payload}`` whose ``payload``
  (bytes) is a MessagePack **array** of RouterEvents — a batch;
* **1.0** with the worker-local indexer (event plane, core NATS): subject
  ``namespace.<ns>.component.<component>.kv-events``; the same envelope with **one** RouterEvent
  as its payload;
* **1.0** without it (the legacy JetStream path, deprecated upstream): bare JSON RouterEvents on
  ``namespace-<ns>-component-<component>-kv-events.kv-events`` (a JetStream stream's subject; a
  core NATS subscription reads them as they are published).

The schema (ai-dynamo/dynamo lib/kv-router/src/protocols.rs, serde snake_case):

* ``RouterEvent {worker_id: u64, storage_tier?, residency_domain?, event, state_source?}``
  (1.0 has only ``worker_id`` and ``event``);
* ``event`` is ``KvCacheEvent {event_id: u64, data, dp_rank: u32 = 0}``;
* ``data`` is externally tagged: ``{"stored": {parent_hash?, start_position?, blocks:
  [{block_hash, tokens_hash, mm_extra_info?}]}}``, ``{"removed": {block_hashes}}`` or ``"cleared"``;
* ``storage_tier`` is ``device`` (the default), ``host_pinned``, ``disk`` or ``external``.

Newer code may choose JSON for the envelope (``DYN_EVENT_PLANE_CODEC``), and serde's JSON form
of the payload is a list of byte values: this decoder takes JSON or msgpack, bare or enveloped,
the payload as an embedded value, bytes, a list of byte values or JSON text, and a payload that
is one RouterEvent or an array of them.

What becomes what: each RouterEvent is one event of the worker named :func:`worker_name`
(``worker_id``, plus ``-dp<rank>`` for a data-parallel rank above 0: each rank has its own KV
cache); a message's consecutive events of one worker become one KvBatch, stamped with the
envelope's ``published_at`` when there is one. Block hashes are the engine's hashes, the same
values vLLM's events carry, so a Dynamo deployment and a relayed vLLM stream fill the same index;
``tokens_hash`` is not used. A stored event carries no block size, so the caller says it
(``block_size``, the engines' ``--block-size``). Storage tiers map onto the media vLLM's events
name (:data:`TIER_MEDIUM`), so a worker's tiers read the same whichever way its events come.

Sequencing (done by the source, from what this module returns): the envelope's ``sequence``
counts a publisher's messages, so on core NATS a jump in it is loss (whose sequence it is:
:meth:`DynamoMessage.sequence_key`); ``event_id`` is judged per worker and rank for bare
messages. A number lower than one seen — a 1.0 publisher's ``sequence``, a worker and rank's
``event_id`` (a restarted 1.6 worker publishes under a new publisher id) — may be the worker's
restart, taken for one only once what follows confirms it (:mod:`exporter.sources.kv_nats`).
(``event_id`` is no loss detector for enveloped messages: 1.6's publisher numbers the events of
every rank it relays in one series.)

Errors: a message that is neither JSON nor msgpack, or holds no RouterEvent, is rejected as a
whole (``decode``); in a batch, a RouterEvent that is malformed is ``decode`` and one whose
``data`` names an unknown kind is ``unknown_event``, and the rest of the batch is kept; a hash
that is not an unsigned 64-bit int is ``decode`` (as in :mod:`exporter.codecs.kvcodec`). Never raises.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgpack

from exporter.codecs.kvcodec import excerpt
from exporter.core.health import Health
from exporter.core.index.tiers import CPU, EXTERNAL, GPU, STORAGE
from exporter.model import AllBlocksCleared, BlockRemoved, BlockStored, KvBatch, KvEvent

SOURCE = "kv_events"
MASK64 = 0xFFFF_FFFF_FFFF_FFFF
# Dynamo's storage tiers onto the medium vocabulary of vLLM's events (the inverse of Dynamo's own
# mapping: GPU → device, CPU/CPU_PINNED → host_pinned, STORAGE/DISK → disk, EXTERNAL/REMOTE → external).
TIER_MEDIUM = {"device": GPU, "host_pinned": CPU, "disk": STORAGE, "external": EXTERNAL}
ENVELOPE_KEYS = frozenset(("publisher_id", "sequence", "published_at", "published_at_ns", "topic"))


class DynamoFormatError(ValueError):
    """The message (or one RouterEvent of it) is not in Dynamo's format."""


class UnknownKind(ValueError):
    """A KvCacheEvent whose ``data`` names a kind this decoder does not know."""


@dataclass(frozen=True, slots=True)
class DynamoEvent:
    """One decoded RouterEvent: who, which event id, and the event in the exporter's model."""

    worker_id: int
    dp_rank: int
    event_id: int
    event: KvEvent

    @property
    def worker(self) -> str:
        return worker_name(self.worker_id, self.dp_rank)


@dataclass(frozen=True, slots=True)
class DynamoMessage:
    """One NATS message: its envelope's publisher and sequence (None when bare) and its events."""

    publisher_id: int | None
    sequence: int | None
    published_at: float | None  # seconds, from the envelope (None when bare)
    events: tuple[DynamoEvent, ...]
    batched: bool = False  # the payload was an array of RouterEvents (1.6+), not one (1.0)

    def sequence_key(self) -> tuple[int, str | None] | None:
        """Whose sequence the envelope's ``sequence`` counts: the publisher's (1.6+: each publisher
        has an id of its own), or, for a one-event payload (1.0, whose publisher id is the worker's
        instance id, shared by the publishers of its data-parallel ranks), the publisher's rank's.
        None when the message is bare or has no event to say whose it is."""
        if self.publisher_id is None or self.sequence is None:
            return None
        if self.batched:
            return self.publisher_id, None
        return (self.publisher_id, self.events[0].worker) if self.events else None

    def batches(self, received_at: float) -> list[KvBatch]:
        """The events as KvBatches: each run of consecutive events of one worker (and rank) is one."""
        ts = self.published_at if self.published_at is not None else received_at
        out: list[KvBatch] = []
        run: list[DynamoEvent] = []
        for ev in self.events:
            if run and ev.worker != run[0].worker:
                out.append(_batch(run, ts))
                run = []
            run.append(ev)
        if run:
            out.append(_batch(run, ts))
        return out


def _batch(run: list[DynamoEvent], ts: float) -> KvBatch:
    first = run[0]
    return KvBatch(worker=first.worker, seq=first.event_id, ts=ts, events=tuple(e.event for e in run),
                   dp_rank=first.dp_rank)


def worker_name(worker_id: int, dp_rank: int = 0) -> str:
    """The exporter's worker name for a Dynamo worker (and DP rank)."""
    return str(worker_id) if not dp_rank else f"{worker_id}-dp{dp_rank}"


def _load(data: bytes | str) -> Any:
    """JSON (text starting with ``{``/``[``/``"``) or msgpack; DynamoFormatError if neither."""
    if isinstance(data, str):
        data = data.encode()
    head = data.lstrip()[:1]
    if head in (b"{", b"[", b'"'):
        try:
            return json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise DynamoFormatError(f"not JSON: {exc}") from None
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises a family of ValueError/TypeError subclasses
        raise DynamoFormatError(f"neither JSON nor msgpack ({exc})") from None


def _is_byte_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(type(b) is int and 0 <= b < 256 for b in value)


def _unwrap(obj: Any) -> tuple[list[Any], bool, int | None, int | None, float | None]:
    """The RouterEvents of a bare or enveloped message, whether they came as an array, the
    envelope's publisher id and sequence, and its publish time in seconds."""
    publisher = sequence = None
    published: float | None = None
    if isinstance(obj, Mapping) and "payload" in obj and ENVELOPE_KEYS & obj.keys():
        ns, ms = obj.get("published_at_ns"), obj.get("published_at")
        # u64 in Dynamo's envelope: a number past that reads as no time (and never overflows a float)
        if type(ns) is int and 0 < ns <= MASK64:
            published = ns / 1e9
        elif (type(ms) is int and 0 < ms <= MASK64) or (type(ms) is float and math.isfinite(ms) and ms > 0):
            published = ms / 1e3
        pid, seq = obj.get("publisher_id"), obj.get("sequence")
        publisher = pid if type(pid) is int and 0 <= pid <= MASK64 else None
        sequence = seq if type(seq) is int and 0 <= seq <= MASK64 else None
        inner = obj["payload"]
        if _is_byte_list(inner):
            inner = bytes(inner)  # serde's JSON form of a byte vector
        if isinstance(inner, bytes | bytearray | str):
            inner = _load(bytes(inner) if not isinstance(inner, str) else inner)
        obj = inner
    if isinstance(obj, list):  # a batch (1.6+): each RouterEvent is judged on its own
        return obj, True, publisher, sequence, published
    if isinstance(obj, Mapping) and "worker_id" in obj and "event" in obj:
        return [obj], False, publisher, sequence, published
    raise DynamoFormatError(f"not a RouterEvent {{worker_id, event}} or an array of them: {excerpt(obj)}")


def _u64(value: Any, what: str) -> int:
    if type(value) is int and 0 <= value <= MASK64:
        return value
    raise DynamoFormatError(f"{what} {excerpt(value)} is not an unsigned 64-bit int")


def _event(data: Any, medium: str, block_size: int) -> KvEvent:
    if data == "cleared" or (isinstance(data, Mapping) and "cleared" in data):
        return AllBlocksCleared()
    if not isinstance(data, Mapping) or len(data) != 1:
        raise DynamoFormatError(f"event data {excerpt(data)} is not one tagged kind")
    kind, body = next(iter(data.items()))
    if kind == "stored":
        if not isinstance(body, Mapping) or not isinstance(body.get("blocks"), list) or not body["blocks"]:
            raise DynamoFormatError(f"stored without blocks: {excerpt(body)}")
        hashes = []
        for b in body["blocks"]:
            if not isinstance(b, Mapping):
                raise DynamoFormatError(f"stored block {excerpt(b)} is not a map")
            hashes.append(_u64(b.get("block_hash"), "block_hash"))
        parent = body.get("parent_hash")
        return BlockStored(tuple(hashes), None if parent is None else _u64(parent, "parent_hash"),
                           block_size, block_size * len(hashes), medium)
    if kind == "removed":
        hs = body.get("block_hashes") if isinstance(body, Mapping) else None
        if not isinstance(hs, list):
            raise DynamoFormatError(f"removed without block_hashes: {excerpt(body)}")
        return BlockRemoved(tuple(_u64(h, "block_hash") for h in hs), medium)
    raise UnknownKind(str(kind))


def _router_event(obj: Any, block_size: int) -> DynamoEvent:
    if not isinstance(obj, Mapping) or "worker_id" not in obj:
        raise DynamoFormatError(f"not a RouterEvent {{worker_id, event}}: {excerpt(obj)}")
    worker_id = _u64(obj["worker_id"], "worker_id")
    ev = obj.get("event")
    if not isinstance(ev, Mapping):
        raise DynamoFormatError(f"event {excerpt(ev)} is not a KvCacheEvent map")
    event_id = _u64(ev.get("event_id"), "event_id")
    dp_rank = ev.get("dp_rank", 0) or 0
    if type(dp_rank) is not int or not 0 <= dp_rank < 2**32:
        raise DynamoFormatError(f"dp_rank {excerpt(dp_rank)}")
    tier = obj.get("storage_tier") or "device"
    medium = TIER_MEDIUM.get(tier) if isinstance(tier, str) else None
    if medium is None:
        raise DynamoFormatError(f"storage_tier {excerpt(tier)}")
    return DynamoEvent(worker_id, dp_rank, event_id, _event(ev.get("data"), medium, block_size))


def decode_message(data: bytes | str, block_size: int, *, where: str = "dynamo",
                   health: Health | None = None) -> DynamoMessage | None:
    """One Dynamo KV-event message → a :class:`DynamoMessage`; ``None`` (counted) if unreadable.

    ``block_size`` is the engines' block size (Dynamo's stored event does not carry it).
    ``where`` names the message in errors (its subject). A message whose every RouterEvent was
    rejected still returns (with no events), so its envelope's sequence is judged.
    """
    try:
        raw, batched, publisher, sequence, published = _unwrap(_load(data))
    except DynamoFormatError as exc:
        if health is not None:
            health.error(SOURCE, "decode", f"{where}: {exc}")
        return None
    events: list[DynamoEvent] = []
    for obj in raw:
        try:
            events.append(_router_event(obj, block_size))
        except UnknownKind as kind:
            if health is not None:
                health.error(SOURCE, "unknown_event", f"{where}: event kind {kind}")
        except DynamoFormatError as exc:
            if health is not None:
                health.error(SOURCE, "decode", f"{where}: {exc}")
    return DynamoMessage(publisher, sequence, published, tuple(events), batched)


def decode(data: bytes | str, block_size: int, *, where: str = "dynamo",
           health: Health | None = None) -> DynamoEvent | None:
    """The one RouterEvent of a message that holds one (Dynamo 1.0's form); ``None`` otherwise."""
    msg = decode_message(data, block_size, where=where, health=health)
    return msg.events[0] if msg is not None and len(msg.events) == 1 else None
