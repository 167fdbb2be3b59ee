"""KV-event ingest: decode + apply to the real ClusterState, against bare ``msgpack.unpackb``.

Payloads model a busy vLLM worker with a full cache (map encoding, vLLM ≥ 0.24). One batch is
one scheduler step: 0–2 prefill chunks, each a BlockStored of 8–64 new 16-token blocks chained
to a resident parent (with their token_ids, as vLLM sends them), 0–6 decode-time BlockStored of
one block each, and as many single-hash BlockRemoved evictions as keep the cache at capacity.
Both sides read the same payloads in the same run, interleaved, best of several repeats.
Target: ingest within 3× of the bare decode.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from typing import Any

import msgpack

from exporter import kvcodec
from exporter.health import Health

TARGET_FACTOR = 3.0
BLOCK_SIZE = 16


def _stored(rng: random.Random, hashes: list[int], parent: int | None) -> dict:
    n = len(hashes)
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": [rng.randrange(128000) for _ in range(n * BLOCK_SIZE)],
            "block_size": BLOCK_SIZE, "lora_id": None, "medium": "GPU", "lora_name": None,
            "extra_keys": [None] * n, "group_idx": 0, "kv_cache_spec_kind": "full_attention"}


def payloads(n_batches: int = 2000, capacity: int = 4000, seed: int = 1) -> tuple[list[bytes], int]:
    """(payloads, block events) for one worker."""
    rng = random.Random(seed)
    resident: list[int] = []
    out: list[bytes] = []
    blocks = 0
    next_hash = 1 << 63  # hashes ≥ 2^63 are the common case for u64 digests
    for i in range(n_batches):
        events: list[dict] = []
        sizes = [rng.randint(8, 64) for _ in range(rng.randint(0, 2))] + [1] * rng.randint(0, 6)
        for n in sizes:
            hashes = list(range(next_hash, next_hash + n))
            next_hash += n
            parent = rng.choice(resident) if resident and rng.random() < 0.8 else None
            events.append(_stored(rng, hashes, parent))
            resident.extend(hashes)
            blocks += n
        while len(resident) > capacity:  # one hash per BlockRemoved, as vLLM evicts
            h = resident.pop(rng.randrange(len(resident) // 2))
            events.append({"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU", "group_idx": 0})
            blocks += 1
        out.append(msgpack.packb([1.8e9 + i * 0.01, events, 0]))
    return out, blocks


def _bare(data: list[bytes], _unused: Any = None) -> None:
    unpackb = msgpack.unpackb
    for p in data:
        unpackb(p, raw=False, strict_map_key=False)


def _decode(data: list[bytes], health: Health) -> None:
    decode = kvcodec.decode_batch
    for seq, p in enumerate(data):
        decode(p, "w0", seq, health)


def _fresh_state() -> Any:
    from exporter.bootstrap import bootstrap

    return bootstrap().state


def _ingest(data: list[bytes], state: Any) -> None:
    health = state.health
    decode, apply = kvcodec.decode_batch, state.apply_kv_batch
    for seq, p in enumerate(data):
        batch = decode(p, "w0", seq, health)
        apply(batch, batch.ts)


def _timed(fn: Any, data: list[bytes], setup: Any) -> float:
    arg = setup()  # a fresh state per run, built outside the timing
    t0 = time.perf_counter()
    fn(data, arg)
    return time.perf_counter() - t0


def run(repeats: int = 7) -> Iterator[dict[str, Any]]:
    data, blocks = payloads()
    sides = {"bare": (_bare, Health), "decode": (_decode, Health), "ingest": (_ingest, _fresh_state)}
    best = dict.fromkeys(sides, float("inf"))
    for _ in range(repeats):  # interleaved, so a burst of load elsewhere hits every side alike
        for key, (fn, setup) in sides.items():
            best[key] = min(best[key], _timed(fn, data, setup))
    for name, key, gated in (("KV ingest: decode + apply to ClusterState, block events/s", "ingest", True),
                             ("KV decode only (kvcodec), block events/s", "decode", False)):
        factor = best[key] / best["bare"]
        yield {"name": name, "value": blocks / best[key], "baseline": blocks / best["bare"], "ratio": factor,
               "target": f"≤ {TARGET_FACTOR:g}× bare msgpack decode time" if gated else "-",
               "ok": factor <= TARGET_FACTOR if gated else True}

if __name__ == "__main__":
    for row in run():
        print(row)
