"""Fuzz the exporter's input edges: the KV-event decoder and the Prometheus text parser.

``python -m fuzz.run [--inputs N] [--seed S]`` (``make fuzz``) feeds N generated inputs (default
1,000,000), half to each target, and reports crashes. A crash is any exception other than a
target's documented error, or an output that breaks the edge's promise:

* ``kvcodec.decode_batch`` never raises; a batch it returns holds only hashes and parents in
  0..2^64-1, positive block sizes and a finite timestamp; the root keys the compiled reader reads
  from the payload of a scanned batch are those of the event path's root stores;
* ``promtext.parse`` never raises; every label value it returns passes
  ``exporter.core.labels.valid_label_value``;
* ``normalize.parse_worker`` and ``parse_router`` raise only ``UnrecognisedMetrics``; every
  number they return is finite.

Inputs are mutations of the real fixtures (byte flips, splices, truncations, repeats), structured
values shaped like batches and pages with hostile fields, and plain random bytes. The first few
crashing inputs are written to ``fuzz/crashes/`` (``repr`` of the input and the traceback).
Deterministic for a given seed.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import msgpack

from exporter.codecs import kvcodec, normalize, promtext
from exporter.core.index.eviction import is_gpu
from exporter.core.index.prefix_instability import (
    COMPARED_BLOCKS,
    EARLY_SPAN_BLOCKS,
    MIN_SHARED_BLOCKS,
    ROOT_KEYS,
    root_key,
)
from exporter.core.labels import valid_label_value
from exporter.model import BlockRemoved, BlockStored

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
CRASH_DIR = Path(__file__).resolve().parent / "crashes"
MASK64 = (1 << 64) - 1
KEEP_CRASHES = 20

# ---- checks ----------------------------------------------------------------------------------


def check_kv(payload: bytes) -> None:
    batch = kvcodec.decode_batch(payload, "w", 1)
    if batch is None:
        return
    if type(batch) is kvcodec.ScannedBatch and batch.scan.roots and ROOT_KEYS:
        # the compiled reader's root keys (read from the payload) are the event path's
        got = batch.scan.root_keys(COMPARED_BLOCKS, EARLY_SPAN_BLOCKS, MIN_SHARED_BLOCKS)
        typed = kvcodec.decode_batch(payload, "w", 1, token_ids=True)
        assert typed is not None
        roots = [ev for ev in typed.events if type(ev) is BlockStored and ev.parent is None and ev.hashes
                 and is_gpu(ev.medium)]
        assert got == [root_key(ev) for ev in roots], (got, roots)
    assert math.isfinite(batch.ts), batch.ts
    for ev in batch.events:
        if isinstance(ev, BlockStored | BlockRemoved):
            assert all(type(h) is int and 0 <= h <= MASK64 for h in ev.hashes), ev
        if isinstance(ev, BlockStored):
            assert ev.parent is None or (type(ev.parent) is int and 0 <= ev.parent <= MASK64), ev
            assert type(ev.block_size) is int and ev.block_size > 0, ev


def check_text(text: str) -> None:
    result = promtext.parse(text)
    for samples in result.samples.values():
        for s in samples:
            assert all(valid_label_value(v) for v in s.labels.values()), s
            assert isinstance(s.value, float), s
    try:
        snap, _errors = normalize.parse_worker("w", text)
    except normalize.UnrecognisedMetrics:
        return
    for name in snap.__slots__:
        value = getattr(snap, name)
        if isinstance(value, float):
            assert math.isfinite(value), (name, value)
    try:
        router, _errors = normalize.parse_router("r", text)
    except normalize.UnrecognisedMetrics:
        return
    for values in (router.decisions, router.healthy, router.prefix_outcomes):
        assert all(math.isfinite(v) and valid_label_value(k) for k, v in values.items()), values


# ---- inputs ----------------------------------------------------------------------------------
HOSTILE_SCALARS: list[object] = [0, 1, -1, 2**63, 2**64 - 1, -(2**63), 1.5, float("nan"), float("inf"), True, False,
                                 None, "", "x", "\u2028", b"", b"\x00" * 8, b"\xff" * 40, [], {}, "BlockStored"]
EVENT_TAGS = ["BlockStored", "BlockRemoved", "AllBlocksCleared", "Other", 7, None]
LABEL_BITS = ['"', "\\", "\\n", "\\\\", '\\"', "}", "{", ",", "=", " ", "\t", "é", "\u2028", "\x85", "\ud800",
              "\udcff", "a" * 300, "x"]
VALUE_BITS = ["1", "0", "-1", "NaN", "+Inf", "-Inf", "1e308", "1e309", "0x10", "", "1_000", "٣", "nan", "2 3", "4 5 6"]
NAMES = [*sorted(normalize.WORKER_NAMES | normalize.ROUTER_NAMES), "x", "a:b", "9bad", "", "vllm:", "with space"]


def _scalar(rng: random.Random) -> object:
    pick = rng.random()
    if pick < 0.4:
        return rng.choice(HOSTILE_SCALARS)
    if pick < 0.7:
        return rng.getrandbits(rng.choice((8, 32, 63, 64)))
    if pick < 0.85:
        return rng.randbytes(rng.choice((1, 8, 32)))
    return rng.uniform(-1e20, 1e20)


def _hashes(rng: random.Random) -> object:
    if rng.random() < 0.1:
        return _scalar(rng)
    return [_scalar(rng) if rng.random() < 0.1 else rng.getrandbits(64) for _ in range(rng.randrange(0, 5))]


def _event(rng: random.Random) -> object:
    tag = rng.choice(EVENT_TAGS)
    fields: dict[str, object] = {"block_hashes": _hashes(rng), "parent_block_hash": rng.choice([None, _scalar(rng)]),
                                 "token_ids": rng.choice([None, [], list(range(16)), _scalar(rng)]),
                                 "block_size": rng.choice([16, 0, -16, 16.0, None, _scalar(rng)]),
                                 "lora_id": None, "medium": rng.choice(["GPU", "CPU", None, _scalar(rng)])}
    if rng.random() < 0.2:
        fields.pop(rng.choice(list(fields)))
    if rng.random() < 0.5:
        return {"type": tag, **fields}
    return [tag, *list(fields.values())[: rng.randrange(0, len(fields) + 2)]]


def kv_structured(rng: random.Random) -> bytes:
    events = [_event(rng) for _ in range(rng.randrange(0, 6))]
    batch: list[object] = [rng.choice([1.5, 0, -1.0, float("nan"), float("inf"), True, "ts", rng.random() * 2e9]), events]
    if rng.random() < 0.7:
        batch.append(rng.choice([0, None, -1, "0", 2**40]))
    if rng.random() < 0.05:
        batch = rng.choice([{"ts": 1}, events, [batch], "x"])  # type: ignore[list-item]
    return msgpack.packb(batch, use_bin_type=rng.random() < 0.8)


def _mutate(rng: random.Random, data: bytes, pool: list[bytes]) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.randrange(1, 6)):
        op = rng.randrange(6)
        if op == 0 and buf:  # flip a byte
            buf[rng.randrange(len(buf))] = rng.randrange(256)
        elif op == 1 and buf:  # cut
            i = rng.randrange(len(buf))
            del buf[i:i + rng.randrange(1, 64)]
        elif op == 2:  # insert hostile bytes
            i = rng.randrange(len(buf) + 1)
            buf[i:i] = rng.choice([b"\xed\xa0\x80", b"\xff", b"\x00", b'"', b"\\", b"{", b"}", b"\n", b"\r", b"\xc1",
                                   b"\xcf\xff\xff\xff\xff\xff\xff\xff\xff", b"\xd3\x80\x00\x00\x00\x00\x00\x00\x00"])
        elif op == 3:  # splice another seed
            other = rng.choice(pool)
            i, j = rng.randrange(len(buf) + 1), rng.randrange(len(other) + 1)
            buf[i:] = other[j:j + rng.randrange(1, 400)]
        elif op == 4 and buf:  # repeat a slice
            i = rng.randrange(len(buf))
            piece = bytes(buf[i:i + rng.randrange(1, 32)])
            buf[i:i] = piece * rng.randrange(1, 50)
        elif op == 5:
            buf = buf[: rng.randrange(len(buf) + 1)]
    return bytes(buf)


def _label_value(rng: random.Random) -> str:
    return "".join(rng.choice(LABEL_BITS) for _ in range(rng.randrange(0, 6)))


def text_structured(rng: random.Random) -> str:
    lines = []
    for _ in range(rng.randrange(1, 8)):
        name = rng.choice(NAMES)
        if rng.random() < 0.2:
            lines.append(rng.choice(["# HELP x y", "# TYPE x counter", "", "   ", "#"]))
            continue
        labels = ",".join(f'{rng.choice(["engine", "model_name", "num_gpu_blocks", "block_size", "tp_rank", "worker", "outcome", "9x", ""])}'
                          f'{rng.choice(["=", " = ", ""])}"{_label_value(rng)}"' for _ in range(rng.randrange(0, 4)))
        block = rng.choice([f"{{{labels}}}", f"{{{labels},}}", f"{{{labels}", "", "{}"])
        ts = rng.choice(["", " 1700000000000", " x"])
        lines.append(f"{name}{block} {rng.choice(VALUE_BITS)}{ts}")
    return rng.choice(["\n", "\r\n"]).join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=int, default=1_000_000, help="generated inputs in all (half per target)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    kv_seeds = [p.read_bytes() for p in sorted(FIXTURES.glob("*.msgpack"))]
    text_seeds = [p.read_bytes() for p in sorted(FIXTURES.glob("*.txt"))]
    # Small pieces of the pages keep each input cheap; whole pages are fed now and then.
    text_pieces = [page[i:i + 600] for page in text_seeds for i in range(0, len(page), 300)]

    def kv_input() -> bytes:
        pick = rng.random()
        if pick < 0.45:
            return kv_structured(rng)
        if pick < 0.9:
            return _mutate(rng, rng.choice(kv_seeds), kv_seeds)
        return rng.randbytes(rng.randrange(0, 64))

    def text_input() -> str:
        pick = rng.random()
        if pick < 0.45:
            return text_structured(rng)
        if pick < 0.95:
            seed = rng.choice(text_seeds) if pick > 0.94 else rng.choice(text_pieces)
            return _mutate(rng, seed, text_pieces).decode("utf-8", "surrogateescape")
        return rng.randbytes(rng.randrange(0, 200)).decode("utf-8", "surrogateescape")

    targets: list[tuple[str, Callable[[], object], Callable[[object], None]]] = [
        ("kv-decoder", kv_input, check_kv),  # type: ignore[list-item]
        ("text-parser", text_input, check_text),  # type: ignore[list-item]
    ]
    counts = dict.fromkeys((t[0] for t in targets), 0)
    crashes = dict.fromkeys(counts, 0)
    kept = 0
    started = time.monotonic()
    for i in range(args.inputs):
        name, make, check = targets[i % 2]
        data = make()
        counts[name] += 1
        try:
            check(data)
        except Exception:
            crashes[name] += 1
            if kept < KEEP_CRASHES:
                CRASH_DIR.mkdir(exist_ok=True)
                (CRASH_DIR / f"{name}-{i}.txt").write_text(f"{data!r}\n\n{traceback.format_exc()}",
                                                           errors="backslashreplace")
                kept += 1
        if (i + 1) % 100_000 == 0:
            print(f"{i + 1:>9} inputs, {sum(crashes.values())} crashes, {time.monotonic() - started:.0f}s", flush=True)
    for name in counts:
        print(f"{name}: {counts[name]} inputs, {crashes[name]} crashes")
    total = sum(crashes.values())
    print(f"total: {sum(counts.values())} inputs, {total} crashes" + (f" (see {CRASH_DIR})" if total else ""))
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
