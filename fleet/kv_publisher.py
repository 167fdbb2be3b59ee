"""KV-cache events on ZMQ, in vLLM's wire format (vllm.md §2).

Each batch is one ZMQ message of three frames: the topic, an 8-byte big-endian sequence number
(from 0 per publisher process, so a restarted worker starts again at 0) and the msgpack payload
``[ts, events, dp_rank]``. Events are positional arrays tagged by class name (vLLM ≤ 0.23,
``encoding="array"``) or maps with a ``"type"`` key (≥ 0.24, ``encoding="map"``). Hashes are
unsigned 64-bit ints (vLLM's default) or raw digest bytes (``hash_form="bytes"``: 32 bytes
whose last 8 are the int, as consumers reduce them).

A ROUTER replay socket answers an 8-byte start sequence with every buffered batch from there
on, then an end marker: ``[topic, seq, payload]`` … ``[b"", END_SEQ, b""]`` (vLLM ≥ 0.26,
``replay_shape="0.26"``) or ``[seq, payload]`` … ``[END_SEQ, b""]`` (≤ 0.25).
A batch dropped by the ``drop`` share (the dropped-events fault) still takes its sequence number
and stays in the replay buffer — what a subscriber sees when the PUB socket drops under HWM.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
from collections import deque
from collections.abc import Callable, Sequence
from hashlib import blake2b
from typing import Any

import msgpack
import zmq

from fleet.cache import CacheEvent, Cleared, Removed, Stored

log = logging.getLogger("prefixscope.fleet.kv")

END_SEQ = b"\xff" * 8
ENCODINGS = ("array", "map")
HASH_FORMS = ("int", "bytes")
REPLAY_SHAPES = ("0.26", "0.25")


def wire_hash(h: int, hash_form: str) -> int | bytes:
    if hash_form == "int":
        return h
    # A 32-byte digest (like sha256) whose low 64 bits are the block's hash.
    return blake2b(h.to_bytes(8, "big"), digest_size=24).digest() + h.to_bytes(8, "big")


def encode_event(ev: CacheEvent, encoding: str = "array", hash_form: str = "int") -> Any:
    if isinstance(ev, Stored):
        hashes = [wire_hash(h, hash_form) for h in ev.hashes]
        parent = None if ev.parent is None else wire_hash(ev.parent, hash_form)
        # one entry per block: vLLM lists there what its hash mixes in besides the tokens — a LoRA
        # adapter's name, untagged, and on the prompt's first block (no parent) the request's
        # cache_salt, last (the simulated hashes leave both out: tenants' prompts differ anyway)
        extra = [None if ev.lora_name is None else [ev.lora_name]] * len(ev.hashes)
        if ev.parent is None and ev.cache_salt is not None and extra:
            extra[0] = [*(extra[0] or ()), ev.cache_salt]
        if encoding == "array":
            # block_hashes, parent, token_ids, block_size, lora_id, medium, lora_name, extra_keys,
            # group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window (0.23 field order)
            return ["BlockStored", hashes, parent, ev.token_ids, ev.block_size, ev.lora_id, ev.medium,
                    ev.lora_name, extra, 0, "full_attention", None]
        return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
                "token_ids": ev.token_ids, "block_size": ev.block_size, "lora_id": ev.lora_id,
                "medium": ev.medium, "lora_name": ev.lora_name, "extra_keys": extra, "group_idx": 0,
                "kv_cache_spec_kind": "full_attention"}
    if isinstance(ev, Removed):
        hashes = [wire_hash(h, hash_form) for h in ev.hashes]
        if encoding == "array":
            return ["BlockRemoved", hashes, ev.medium, 0]
        return {"type": "BlockRemoved", "block_hashes": hashes, "medium": ev.medium, "group_idx": 0}
    if isinstance(ev, Cleared):
        return ["AllBlocksCleared"] if encoding == "array" else {"type": "AllBlocksCleared"}
    raise TypeError(f"not a cache event: {ev!r}")


def encode_batch(events: Sequence[CacheEvent], ts: float, dp_rank: int = 0, encoding: str = "array",
                 hash_form: str = "int") -> bytes:
    if encoding not in ENCODINGS or hash_form not in HASH_FORMS:
        raise ValueError(f"encoding must be one of {ENCODINGS}, hash_form one of {HASH_FORMS}")
    return msgpack.packb([ts, [encode_event(e, encoding, hash_form) for e in events], dp_rank],
                         use_bin_type=True)


class KvEventPublisher:
    """PUB + ROUTER replay sockets served by one thread (ZMQ sockets are not thread-safe).

    :meth:`publish` may be called from any thread; batches are numbered and sent in call order.
    """

    def __init__(
        self,
        endpoint: str = "tcp://127.0.0.1:0",
        replay_endpoint: str | None = "tcp://127.0.0.1:0",
        topic: str = "",
        encoding: str = "array",
        hash_form: str = "int",
        replay_shape: str = "0.26",
        buffer_steps: int = 10000,
        dp_rank: int = 0,
        hwm: int = 100000,
        drop_share: Callable[[], float] | None = None,
        seed: int = 0,
    ) -> None:
        if encoding not in ENCODINGS or hash_form not in HASH_FORMS or replay_shape not in REPLAY_SHAPES:
            raise ValueError("bad encoding, hash_form or replay_shape")
        self.topic = topic.encode()
        self.encoding, self.hash_form, self.replay_shape = encoding, hash_form, replay_shape
        self.dp_rank = dp_rank
        self._drop_share = drop_share or (lambda: 0.0)
        self._rng = random.Random(seed)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._queue: queue.Queue[tuple[list[CacheEvent], float] | None] = queue.Queue()
        self._seq = 0
        self._pending = 0
        self._idle = threading.Condition()
        self.sent = 0
        self.dropped = 0
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.endpoint = ""
        self.replay_endpoint: str | None = None
        self._thread = threading.Thread(
            target=self._run, args=(endpoint, replay_endpoint, hwm), name="kv-publisher", daemon=True
        )
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            raise RuntimeError(f"KV publisher failed to bind: {self._error}") from self._error

    # -- producer side --------------------------------------------------------------------
    def publish(self, events: list[CacheEvent], ts: float) -> None:
        if not events:
            return
        with self._idle:
            self._pending += 1
        self._queue.put((list(events), ts))

    __call__ = publish  # usable directly as a SimEngine on_events callback

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every published batch has been sent (or dropped)."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    @property
    def next_seq(self) -> int:
        return self._seq

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(5)

    # -- socket thread --------------------------------------------------------------------
    def _run(self, endpoint: str, replay_endpoint: str | None, hwm: int) -> None:
        ctx = zmq.Context.instance()
        pub = ctx.socket(zmq.PUB)
        router = None
        try:
            pub.setsockopt(zmq.LINGER, 0)
            pub.set_hwm(hwm)
            pub.bind(endpoint)
            self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
            if replay_endpoint:
                router = ctx.socket(zmq.ROUTER)
                router.setsockopt(zmq.LINGER, 0)
                router.set_hwm(2 * (self._buffer.maxlen or 1) + 2)
                router.bind(replay_endpoint)
                self.replay_endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as e:
            self._error = e
            pub.close(0)
            if router is not None:
                router.close(0)
            self._ready.set()
            return
        self._ready.set()
        poller = zmq.Poller()
        if router is not None:
            poller.register(router, zmq.POLLIN)
        try:
            while True:
                if router is not None and poller.poll(0):
                    self._serve_replay(router)
                try:
                    item = self._queue.get(timeout=0.01)
                except queue.Empty:
                    continue
                if item is None:
                    break
                self._send(pub, *item)
        finally:
            pub.close(0)
            if router is not None:
                router.close(0)

    def _send(self, pub: zmq.Socket, events: list[CacheEvent], ts: float) -> None:
        try:
            payload = encode_batch(events, ts, self.dp_rank, self.encoding, self.hash_form)
            seq = self._seq
            self._seq += 1
            self._buffer.append((seq, payload))
            if self._rng.random() < self._drop_share():
                self.dropped += 1
            else:
                pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
                self.sent += 1
        except Exception:  # a publisher must never take the worker down
            log.exception("failed to publish a KV-event batch")
        finally:
            with self._idle:
                self._pending -= 1
                self._idle.notify_all()

    def _serve_replay(self, router: zmq.Socket) -> None:
        while True:
            try:
                frames = router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            ident, rest = frames[0], frames[1:]
            envelope = [ident, b""] if rest and rest[0] == b"" else [ident]  # REQ clients send a delimiter
            body = [f for f in rest if f != b""]
            if len(body) != 1 or len(body[0]) != 8:
                log.warning("ignoring a malformed replay request (%d frames)", len(frames))
                continue
            start = int.from_bytes(body[0], "big")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    seq8 = seq.to_bytes(8, "big")
                    msg = [self.topic, seq8, payload] if self.replay_shape == "0.26" else [seq8, payload]
                    router.send_multipart(envelope + msg)
            end = [b"", END_SEQ, b""] if self.replay_shape == "0.26" else [END_SEQ, b""]
            router.send_multipart(envelope + end)
