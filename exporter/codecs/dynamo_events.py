"""NVIDIA Dynamo's KV-event messages → ``exporter.model.KvBatch`` (pure; no NATS here).

Dynamo's worker-side ``KvEventPublisher`` reads the engine's ZMQ events and publishes one
``RouterEvent`` per message on its event plane (core NATS subject
``namespace.<ns>.component.<comp>.kv_events``, ``kv-events`` in newer code). The format, as
Dynamo's source gives it (lib/kv-router/src/protocols.rs, serde snake_case):

* ``RouterEvent {worker_id: u64, storage_tier?, residency_domain?, event, state_source?}``
  (old versions have only ``worker_id`` and ``event``);
* ``event`` is ``KvCacheEvent {event_id: u64, data, dp_rank: u32 = 0}``;
* ``data`` is externally tagged: ``{"stored": {parent_hash?, start_position?, blocks:
  [{block_hash, tokens_hash, mm_extra_info?}]}}``, ``{"removed": {block_hashes}}`` or ``"cleared"``;
* ``storage_tier`` is ``device`` (the default), ``host_pinned``, ``disk`` or ``external``.

Newer event planes wrap the payload in an envelope ``{publisher_id, sequence, published_at (ms),
published_at_ns, topic, payload}``; the codec is JSON (the first plane, and the default on NATS)
or msgpack with named fields (``rmp_serde``). This decoder takes all of these: JSON or msgpack,
bare or enveloped, the envelope's ``payload`` as an embedded object, bytes, a list of byte
values or JSON text.

What becomes what: one RouterEvent is one KvBatch of one event for the worker named
:func:`worker_name` (``worker_id``, plus ``-dp<rank>`` for a data-parallel rank above 0: each
rank has its own KV cache), with ``seq = event_id`` (Dynamo's routers detect gaps in it) and
``ts`` the envelope's ``published_at`` when present. Block hashes are the engine's hashes, the
same values vLLM's events carry, so a Dynamo deployment and a relayed vLLM stream fill the same
index. ``tokens_hash`` is not used. A stored event carries no block size, so the caller says it
(``block_size``, the engines' ``--block-size``). Storage tiers map to vLLM's media: device → GPU,
host_pinned → CPU, disk → DISK, external → EXTERNAL.

Errors: a message that is neither JSON nor msgpack, or not a RouterEvent, is rejected as a whole
(``decode``); an event whose ``data`` names an unknown kind is ``unknown_event``; a hash that is
not an unsigned 64-bit int is ``decode`` (as in :mod:`exporter.codecs.kvcodec`). Never raises.
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
from exporter.model import AllBlocksCleared, BlockRemoved, BlockStored, KvBatch, KvEvent

SOURCE = "kv_events"
MASK64 = 0xFFFF_FFFF_FFFF_FFFF
TIER_MEDIUM = {"device": "GPU", "host_pinned": "CPU", "disk": "DISK", "external": "EXTERNAL"}
ENVELOPE_KEYS = frozenset(("publisher_id", "sequence", "published_at", "published_at_ns", "topic"))


class DynamoFormatError(ValueError):
    """The message is not a Dynamo RouterEvent (the whole message is rejected)."""


class UnknownKind(ValueError):
    """A KvCacheEvent whose ``data`` names a kind this decoder does not know."""


@dataclass(frozen=True, slots=True)
class DynamoEvent:
    """One decoded RouterEvent: who, which event id, and the event in the exporter's model."""

    worker_id: int
    dp_rank: int
    event_id: int
    event: KvEvent
    published_at: float | None  # seconds, from the envelope (None when bare)

    @property
    def worker(self) -> str:
        return worker_name(self.worker_id, self.dp_rank)

    def batch(self, received_at: float) -> KvBatch:
        ts = self.published_at if self.published_at is not None else received_at
        return KvBatch(worker=self.worker, seq=self.event_id, ts=ts, events=(self.event,), dp_rank=self.dp_rank)


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


def _unwrap(obj: Any) -> tuple[Mapping[str, Any], float | None]:
    """The RouterEvent of a bare or enveloped message, and the envelope's publish time in seconds."""
    published: float | None = None
    if isinstance(obj, Mapping) and "payload" in obj and ENVELOPE_KEYS & obj.keys():
        ns, ms = obj.get("published_at_ns"), obj.get("published_at")
        if type(ns) is int and ns > 0:
            published = ns / 1e9
        elif type(ms) in (int, float) and math.isfinite(ms) and ms > 0:
            published = ms / 1e3
        inner = obj["payload"]
        if isinstance(inner, list) and all(type(b) is int and 0 <= b < 256 for b in inner):
            inner = bytes(inner)  # serde's JSON form of a byte vector
        if isinstance(inner, bytes | bytearray | str):
            inner = _load(bytes(inner) if not isinstance(inner, str) else inner)
        obj = inner
    if not isinstance(obj, Mapping) or "worker_id" not in obj or "event" not in obj:
        raise DynamoFormatError(f"not a RouterEvent {{worker_id, event}}: {excerpt(obj)}")
    return obj, published


def _u64(value: Any, what: str) -> int:
    if type(value) is int and 0 <= value <= MASK64:
        return value
    raise DynamoFormatError(f"{what} {excerpt(value)} is not an unsigned 64-bit int")


def _event(data: Any, medium: str) -> KvEvent:
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
        return BlockStored(tuple(hashes), None if parent is None else _u64(parent, "parent_hash"), 1, 0, medium)
    if kind == "removed":
        hs = body.get("block_hashes") if isinstance(body, Mapping) else None
        if not isinstance(hs, list):
            raise DynamoFormatError(f"removed without block_hashes: {excerpt(body)}")
        return BlockRemoved(tuple(_u64(h, "block_hash") for h in hs), medium)
    raise UnknownKind(str(kind))


def decode(data: bytes | str, block_size: int, *, where: str = "dynamo",
           health: Health | None = None) -> DynamoEvent | None:
    """One Dynamo KV-event message → a :class:`DynamoEvent`; ``None`` (counted) if unreadable.

    ``block_size`` is the engines' block size (Dynamo's stored event does not carry it).
    ``where`` names the message in errors (its subject).
    """
    try:
        obj, published = _unwrap(_load(data))
        worker_id = _u64(obj["worker_id"], "worker_id")
        ev = obj["event"]
        if not isinstance(ev, Mapping):
            raise DynamoFormatError(f"event {excerpt(ev)} is not a KvCacheEvent map")
        event_id = _u64(ev.get("event_id"), "event_id")
        dp_rank = ev.get("dp_rank", 0) or 0
        if type(dp_rank) is not int or dp_rank < 0:
            raise DynamoFormatError(f"dp_rank {excerpt(dp_rank)}")
        tier = obj.get("storage_tier") or "device"
        medium = TIER_MEDIUM.get(tier) if isinstance(tier, str) else None
        if medium is None:
            raise DynamoFormatError(f"storage_tier {excerpt(tier)}")
        event = _event(ev.get("data"), medium)
        if isinstance(event, BlockStored):
            event = BlockStored(event.hashes, event.parent, block_size, block_size * len(event.hashes), medium)
    except UnknownKind as kind:
        if health is not None:
            health.error(SOURCE, "unknown_event", f"{where}: event kind {kind}")
        return None
    except DynamoFormatError as exc:
        if health is not None:
            health.error(SOURCE, "decode", f"{where}: {exc}")
        return None
    return DynamoEvent(worker_id, dp_rank, event_id, event, published)
